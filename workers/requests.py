"""What a request on a worker's lane asks for, checked here instead of in the broker.

A client puts an inference request straight on a worker's lane: a descriptor in the client's own
arena (inputs, outputs, options) followed by the tensor bytes. The worker checks the descriptor
against the model's signature, and turns it into an *entry*: the same request with every tensor
located (a segment name, an offset, a size), bounds-checked against the client's arena or a
region the broker published. Requests the broker forwards arrive as entries already.
"""
from __future__ import annotations

import base64
from typing import Any

from shmserve.shm.answer import DECOUPLED_REFUSAL
from shmserve.shm.batch_entry import BatchEntry, LocatedTensor
from shmserve.shm.channel import ClientSegment
from shmserve.shm.descriptor import InferRequest, InputTensor, RequestedOutput
from shmserve.shm.region_table import RegionTable, locate
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import BytesFraming, from_buffer

from . import device_tensors
from .cuda import runtime as cuda_runtime
from .input_views import InputViews
from shmserve.signature import ModelSignature


class RequestError(Exception):
    """A problem with one request (not the batch): answered as a 400 to that client only."""

    status = 400


class DecoupledOnly(RequestError):
    """A single-answer request to a decoupled model: Triton's UNSUPPORTED (501), with its text."""

    status = 501

    def __init__(self) -> None:
        super().__init__(DECOUPLED_REFUSAL)


def check_request(signature: ModelSignature, regions: RegionTable, decoupled: bool, client: ClientSegment,
                  req: InferRequest, data_start: int, entry: BatchEntry) -> int:
    """Check a lane request ``req`` (its tensor bytes start at ``data_start``) and fill
    ``entry``; returns its batch size. Raises InvalidRequest or RequestError for what the client
    got wrong."""
    if decoupled and req.stream is None:
        raise DecoupledOnly()  # before the inputs are looked at, as in Triton
    batch = signature.check_inputs(req.inputs, req.id)
    signature.check_outputs(req.outputs)
    entry.update(id=req.id, parameters=req.parameters, sequence_id=req.sequence_id,
                 sequence_flags=req.sequence_flags, sent_ns=req.sent_ns)
    if req.timeout_us:
        entry["timeout_us"] = req.timeout_us
    if req.traced:
        entry["trace_queued_ns"] = 0  # no broker queue (the frontend's submit is its QUEUE_START)
    entry["inputs"] = [_input(regions, client, t, data_start) for t in req.inputs]
    outputs = req.outputs
    entry["outputs"] = [_output(regions, client, o, data_start) for o in outputs] if outputs else None
    if req.stream is not None:
        entry["stream"] = {"seg": client.name, "off": data_start + req.stream}
        if not client.arena_offset <= entry["stream"]["off"] <= client.seg.size - 4096:
            raise RequestError("the response ring lies outside the client's arena")
    return batch


def _input(regions: RegionTable, client: ClientSegment, t: InputTensor, data_start: int) -> LocatedTensor:
    return {**_locate(regions, client, t.name, t.region, t.offset, t.size, t.data, data_start),
            "datatype": t.datatype, "shape": t.shape}


def _output(regions: RegionTable, client: ClientSegment, o: RequestedOutput, data_start: int) -> LocatedTensor:
    out = {"name": o.name} if o.data is None and not o.region \
        else _locate(regions, client, o.name, o.region, o.offset, o.size, o.data or 0, data_start)
    if o.classes:
        out["class"] = o.classes  # classification: answered as the top classes
    return out


def _locate(regions: RegionTable, client: ClientSegment, name: str, region_name: str, offset: int, size: int,
            data: int, data_start: int) -> LocatedTensor:
    if region_name:  # a registered region, as the broker published it (shm/region_table.py)
        region = regions.get(region_name)
        if region is not None and region.leaving:
            region = None  # unregistered: the broker waits only for lane requests that began before
        off = locate(region_name, region, offset, size)  # RegionUseError: its status (404: no such region)
        assert region is not None
        return {"name": name, "seg": region.key, "ino": region.ino, "region": region_name, "off": off, "size": size}
    off = data_start + data
    if off < client.arena_offset or off + size > client.seg.size:
        raise RequestError(f"tensor '{name}' lies outside the client's arena")
    return {"name": name, "seg": client.name, "off": off, "size": size}


def read_inputs(entry: BatchEntry, segments: SegmentCache, on_device: bool = False,
                views: InputViews | None = None) -> tuple[dict[str, Any], frozenset[str]]:
    """The entry's inputs as arrays, and the names of those that are this process's own (a model
    may write into them). An input in a client's arena (or a step's output in a worker's) is a
    view over that memory, or with ``views`` a private copy-on-write view when it is large
    (``input_views.py``; not for a stream, whose request outlives the round); one in a
    registered region is a read-only view of its guarded mapping (``shm/region_io.py``: a
    truncation under us is grown back), or where the guard is not built a copy of our own; one in a client's CUDA region stays there as a device tensor when
    the instance takes device inputs (``on_device``), and is copied to the host otherwise."""
    if "stream" in entry:
        views = None
    inputs: dict[str, Any] = {}
    own: list[str] = []
    for t in entry["inputs"]:
        off, size = t["off"], t["size"]
        if "cuda" in t:
            ptr = cuda_runtime().open(base64.b64decode(t["cuda"]), t["device"]) + off
            if on_device and t["datatype"] != "BYTES":
                inputs[t["name"]] = device_tensors.region_tensor(ptr, t["datatype"], t["shape"], t["device"])
                continue
            host = memoryview(bytearray(size))
            cuda_runtime().to_host(host, ptr)
            inputs[t["name"]] = from_buffer(host, t["datatype"], t["shape"])
            own.append(t["name"])
            continue
        if "ino" in t:  # a registered region: StaleRegion (a 400) if it was truncated
            in_place = segments.regions.view(t)  # (a guarded mapping: as an arena's, not our own)
            if in_place is not None:
                data = memoryview(in_place)  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
            else:  # (no guard library: read through the descriptor, a copy of our own)
                data = memoryview(segments.regions.read(t))  # type: ignore[arg-type]
                own.append(t["name"])
        else:
            view = views.array(t["seg"], off, size, t["datatype"], t["shape"]) if views is not None else None
            if view is not None:
                inputs[t["name"]] = view
                own.append(t["name"])
                continue
            data = segments.get(t["seg"]).buf[off:off + size]
        try:
            inputs[t["name"]] = from_buffer(data, t["datatype"], t["shape"])
        except BytesFraming as e:
            e.input_name = t["name"]  # (the worker words it as Triton does, naming it)
            raise
    return inputs, frozenset(own)
