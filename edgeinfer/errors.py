"""The exceptions edgeinfer raises for bad input: each carries one line a user can act on."""


class EdgeInferError(Exception):
    """Base of every error edgeinfer reports to a user (the CLI prints it as one line, exit 2)."""


class GGUFError(EdgeInferError):
    """A model file that is malformed, truncated, inconsistent or uses an unsupported feature."""

    def __init__(self, path, message: str):
        self.path = str(path)
        self.detail = message
        super().__init__(f"{self.path}: {message}")


class ModelNotFoundError(EdgeInferError):
    """An unknown short model name, or a path that does not exist."""


class PullError(EdgeInferError):
    """A model could not be fetched or failed its integrity check."""


class DeviceLostError(EdgeInferError):
    """A device holding layers and their KV cache was lost mid-request (a ggml RPC server): the
    requests using it fail, and the prefixes cached on it are forgotten."""
