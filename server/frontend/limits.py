"""The HTTP connection limits a frontend keeps (``--http-*-timeout-secs``, ``--http-max-header-bytes``,
``--http-max-connections``): one typed structure, built by the launcher from its flags and handed
to each frontend in its spec (the connection bound's default: ``shmserve.descriptor_limit``).

Kept free of uvicorn and Starlette so that the launcher can import it cheaply.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

NEVER_S = 1e9  # an idle timeout of 0: about 30 years


@dataclass(frozen=True)
class HttpLimits:
    """How long a connection may take over each part of a request, and how many a frontend holds."""

    idle_timeout_s: float = 0.0  # no request in progress: from the accept, and after each answer (0: never)
    header_timeout_s: float = 30.0  # from a request head's first byte until it is complete
    body_timeout_s: float = 60.0  # while a body is read, between two reads
    send_timeout_s: float = 60.0  # while an answer waits in the send buffer, between two reads of the client
    max_header_bytes: int = 64 << 10  # request line and header fields
    max_connections: int = 0  # per frontend process; 0: derived from its descriptor limit

    @property
    def keep_alive_s(self) -> float:
        """uvicorn's keep-alive timeout for ``idle_timeout_s`` (never: a timer past any lifetime)."""
        return self.idle_timeout_s or NEVER_S

    def to_spec(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_spec(cls, doc: dict[str, Any] | None) -> "HttpLimits":
        return cls(**(doc or {}))


def descriptors_problem() -> str | None:
    """Why this process cannot take one more descriptor, if it cannot (a probe: open and close
    /dev/null): a frontend out of descriptors can neither accept nor reach its broker."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        return f"the frontend cannot open a file descriptor: {e}"
    return None
