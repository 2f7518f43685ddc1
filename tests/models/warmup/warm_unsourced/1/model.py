class TritonPythonModel:
    """Never executes: its warm-up sample gives Y no data source, which fails the load first."""

    def execute(self, requests):
        raise AssertionError("a warm-up sample with an input of no data source was run")
