"""One connection's requests over KServe v2 HTTP with ``tritonclient.http``: binary tensors in the
body, or in shared-memory regions. Every request is built once, before the load starts."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from shmserve.tools.perf.plan import Requests, Target, TensorSpec
from shmserve.tools.perf.shm_regions import Regions, byte_size

Seq = tuple[int, bool, bool]  # sequence id, start, end; (0, False, False) outside sequences


def output_size(spec: TensorSpec, default: int) -> int:
    """Bytes an output region needs: what its shape fixes, else ``--output-shared-memory-size``."""
    from shmserve.shm.tensors import DTYPES

    if spec.datatype == "BYTES" or any(d < 0 for d in spec.shape):
        return default
    return int(np.prod(spec.shape, dtype=np.int64)) * DTYPES[spec.datatype].itemsize


def prebuilt_inputs(module: Any, req: Requests, regions: Regions | None, index: int,
                    entry: dict[str, np.ndarray], **data_options: Any) -> list[Any]:
    """Data entry ``index`` as tritonclient InferInputs of ``module`` (tritonclient.http or
    .grpc): in the message, or in regions written once."""
    inputs = []
    for spec in req.inputs:
        array = entry[spec.name]
        inp = module.InferInput(spec.name, list(array.shape), spec.datatype)
        if regions is None:
            inp.set_data_from_numpy(array, **data_options)
        else:
            size = byte_size(array)
            inp.set_shared_memory(regions.add(f"in{index}_{spec.name}", size, array), size)
        inputs.append(inp)
    return inputs


def prebuilt_outputs(module: Any, req: Requests, regions: Regions | None, **options: Any) -> list[Any]:
    """The outputs asked for, each into a region of its own when there are regions."""
    outputs = []
    for spec in req.outputs:
        out = module.InferRequestedOutput(spec.name, **options)
        if regions is not None:
            size = output_size(spec, req.output_shm_size)
            out.set_shared_memory(regions.add(f"out_{spec.name}", size), size)
        outputs.append(out)
    return outputs


class HttpCaller:
    """Prebuilt requests (one per data entry) on one tritonclient HTTP connection."""

    def __init__(self, target: Target, req: Requests, tag: str) -> None:
        import tritonclient.http as httpclient

        self.req = req
        self.client = httpclient.InferenceServerClient(target.address, connection_timeout=10.0,
                                                       network_timeout=req.timeout_s)
        self.regions = Regions(self.client, req.shared_memory, tag) if req.shared_memory != "none" else None
        try:
            self.outputs = prebuilt_outputs(httpclient, req, self.regions, binary_data=True)
            self.requests = [prebuilt_inputs(httpclient, req, self.regions, i, entry, binary_data=True)
                             for i, entry in enumerate(req.entries())]
        except Exception:
            self.close()
            raise

    def call(self, entry: int, seq: Seq) -> list[int]:
        """One request; the time its answer came (monotonic ns)."""
        self.client.infer(self.req.model, self.requests[entry], model_version=self.req.version,
                          outputs=self.outputs, sequence_id=seq[0], sequence_start=seq[1], sequence_end=seq[2])
        return [time.monotonic_ns()]

    def close(self) -> None:
        if self.regions is not None:
            self.regions.close()
        self.client.close()
