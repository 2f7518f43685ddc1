"""One local client's requests (``shmserve.Client`` by server id: shared memory, no network);
with ``--shared-memory system`` the inputs live in a region the client created, so they travel by
reference instead of being copied into the client's arena."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from shmserve.tools.perf.http_caller import Seq
from shmserve.tools.perf.plan import Requests, Target

ALIGN = 64


def in_region(client: Any, arrays: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """The same arrays copied into one region the client creates, each 64-byte aligned."""
    region = client.create_region(name, sum((a.nbytes + ALIGN - 1) & ~(ALIGN - 1) for a in arrays.values()))
    placed, offset = {}, 0
    for key, array in arrays.items():
        view = region.array(array.dtype, array.shape, offset)
        view[...] = array
        placed[key] = view
        offset += (array.nbytes + ALIGN - 1) & ~(ALIGN - 1)
    return placed


class LocalCaller:
    """Prebuilt input dicts (one per data entry) on one local client."""

    def __init__(self, target: Target, req: Requests, tag: str) -> None:
        from shmserve.shm.client import Client

        self.req = req
        self.client = Client(target.address)
        try:
            entries = req.entries()
            if req.shared_memory == "system":
                entries = [in_region(self.client, e, f"shmperf_{tag}_{i}") for i, e in enumerate(entries)]
            self.requests = entries
        except Exception:
            self.client.close()
            raise

    def call(self, entry: int, seq: Seq) -> list[int]:
        """One request; the time of each response (monotonic ns)."""
        options = {"version": self.req.version, "sequence_id": seq[0], "sequence_start": seq[1],
                   "sequence_end": seq[2]}
        if not self.req.decoupled:
            self.client.infer(self.req.model, self.requests[entry], **options).release()
            return [time.monotonic_ns()]
        times = []
        for result in self.client.stream(self.req.model, self.requests[entry], wait_s=self.req.timeout_s, **options):
            times.append(time.monotonic_ns())
            result.release()
        return times

    def close(self) -> None:
        self.client.close()
