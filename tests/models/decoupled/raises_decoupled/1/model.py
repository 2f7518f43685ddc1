class TritonPythonModel:
    """A decoupled model whose execute raises before it sends anything."""

    def execute(self, requests):
        raise ValueError("decoupled boom")
