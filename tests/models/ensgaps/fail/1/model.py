class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("boom from fail")
