"""One connection's requests over KServe v2 gRPC with ``tritonclient.grpc``: tensors as raw binary
contents or in shared-memory regions; a decoupled model's responses through a bidirectional
stream, each timed as it arrives."""
from __future__ import annotations

import queue
import time
from typing import Any

from shmserve.tools.perf.http_caller import Seq, prebuilt_inputs, prebuilt_outputs
from shmserve.tools.perf.plan import Requests, Target
from shmserve.tools.perf.shm_regions import Regions


class GrpcCaller:
    """Prebuilt requests (one per data entry) on one gRPC channel; a stream for decoupled models."""

    def __init__(self, target: Target, req: Requests, tag: str) -> None:
        import tritonclient.grpc as grpcclient

        self.req = req
        self.client = grpcclient.InferenceServerClient(target.address)
        self.regions = Regions(self.client, req.shared_memory, tag) if req.shared_memory != "none" else None
        self.responses: queue.Queue = queue.Queue()
        self.sent = 0
        try:
            self.outputs = prebuilt_outputs(grpcclient, req, self.regions)
            self.requests = [prebuilt_inputs(grpcclient, req, self.regions, i, entry)
                             for i, entry in enumerate(req.entries())]
            if req.decoupled:
                self.client.start_stream(callback=self._arrived)
        except Exception:
            self.close()
            raise

    def _arrived(self, result: Any, error: Any) -> None:
        self.responses.put((time.monotonic_ns(), result, error))

    def call(self, entry: int, seq: Seq) -> list[int]:
        """One request; the time of each response (monotonic ns)."""
        if not self.req.decoupled:
            self.client.infer(self.req.model, self.requests[entry], model_version=self.req.version,
                              outputs=self.outputs, sequence_id=seq[0], sequence_start=seq[1], sequence_end=seq[2],
                              client_timeout=self.req.timeout_s)
            return [time.monotonic_ns()]
        self.sent += 1
        self.client.async_stream_infer(self.req.model, self.requests[entry], model_version=self.req.version,
                                       outputs=self.outputs, request_id=str(self.sent), sequence_id=seq[0],
                                       sequence_start=seq[1], sequence_end=seq[2], enable_empty_final_response=True)
        times = []
        while True:
            at, result, error = self.responses.get(timeout=self.req.timeout_s)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                times.append(at)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return times

    def close(self) -> None:
        if self.req.decoupled:
            self.client.stop_stream()
        if self.regions is not None:
            self.regions.close()
        self.client.close()
