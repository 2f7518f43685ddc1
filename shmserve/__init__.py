"""shmserve: an inference server speaking KServe v2 / Triton's protocol over HTTP, with tensors
moving between its processes (and local programs) through POSIX shared memory.

The public import name. The repository keeps its process layout at the top (``server/``,
``workers/``, ``shm/``, ``tools/``); they are installed as ``shmserve.server``, ``shmserve.workers``,
``shmserve.shm`` and ``shmserve.tools`` (pyproject.toml's package-dir). What a program imports:

    from shmserve import Client
    with Client("shmserve") as client:                 # the server's --id
        result = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})

and, to serve functions from a script with no repository, ``shmserve.model`` and
``shmserve.serve`` (bind.py, docs/binding.md).
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Loaded on first use: every process of the server imports this package first, and most of them
# never need the client library (numpy and the connection code).
_CLIENT_NAMES = ("Client", "InferResult", "InferenceServerError", "ErrorCode", "Region", "ServerUnavailable",
                 "Backpressure", "RequestTooLarge")
_BIND_NAMES = ("model", "serve")  # serving functions from a script (bind.py)
__all__ = [*_CLIENT_NAMES, *_BIND_NAMES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from .shm import client

        return getattr(client, name)
    if name in _BIND_NAMES:
        from . import bind

        return getattr(bind, name)
    raise AttributeError(f"module 'shmserve' has no attribute {name!r}")
