class TritonPythonModel:
    """Never loads: its initialize raises."""

    def initialize(self, args):
        raise RuntimeError("boom at init")

    def execute(self, requests):
        return []
