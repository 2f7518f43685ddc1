class TritonPythonModel:
    """Loads; version 2 beside it does not."""

    def execute(self, requests):
        return []
