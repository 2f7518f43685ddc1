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

from shmserve.shm.channel import ClientSegment
from shmserve.shm.region_table import RegionTable, locate
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import from_buffer

from . import device_tensors
from .cuda import runtime as cuda_runtime
from .input_views import InputViews
from shmserve.signature import ModelSignature, queue_options


class RequestError(Exception):
    """A problem with one request (not the batch): answered as a 400 to that client only."""

    status = 400


class DecoupledOnly(RequestError):
    """A single-answer request to a decoupled model: Triton's UNSUPPORTED (501), with its text."""

    status = 501

    def __init__(self) -> None:
        super().__init__("HTTP end point doesn't support models with decoupled transaction policy")


def check_request(signature: ModelSignature, regions: RegionTable, decoupled: bool, client: ClientSegment,
                  doc: dict, data_start: int, entry: dict) -> tuple[int, int, int, int]:
    """Check a lane request's descriptor ``doc`` (its tensor bytes start at ``data_start``) and
    fill ``entry``; returns (batch size, priority, queue timeout in us, send time). Raises
    InvalidRequest or RequestError for what the client got wrong."""
    if decoupled and "stream" not in doc:
        raise DecoupledOnly()  # before the inputs are looked at, as in Triton
    batch = signature.check_inputs(doc["inputs"], doc.get("id", ""))
    signature.check_outputs(doc.get("outputs"))
    priority, timeout_us, sent_ns = queue_options(doc)
    entry.update(id=doc.get("id", ""), params=doc.get("params"), corr=doc.get("corr", 0),
                 flags=doc.get("flags", 0), t=sent_ns)
    if "tr" in doc:
        entry["tr"] = 0  # traced; no broker queue (the frontend's submit is its QUEUE_START)
    entry["inputs"] = [_locate(regions, client, t, data_start) for t in doc["inputs"]]
    outputs = doc.get("outputs")
    entry["outputs"] = [_output(regions, client, o, data_start) for o in outputs] if outputs else None
    if "stream" in doc:
        entry["stream"] = {"seg": client.name, "off": data_start + int(doc["stream"])}
        if not client.arena_offset <= entry["stream"]["off"] <= client.seg.size - 4096:
            raise RequestError("the response ring lies outside the client's arena")
    return batch, priority, timeout_us, sent_ns


def _output(regions: RegionTable, client: ClientSegment, o: dict, data_start: int) -> dict:
    out = {"name": o["name"]} if "data" not in o and "region" not in o \
        else _locate(regions, client, o, data_start)
    if "class" in o:
        out["class"] = o["class"]  # classification: answered as the top classes
    return out


def _locate(regions: RegionTable, client: ClientSegment, t: dict, data_start: int) -> dict:
    size = int(t["size"])
    if "region" in t:  # a registered region, as the broker published it (shm/region_table.py)
        name = t["region"]
        region = regions.get(name)
        if region is not None and region.leaving:
            region = None  # unregistered: the broker waits only for lane requests that began before
        off = locate(name, region, int(t.get("offset", 0)), size)  # RegionUseError: a 400
        assert region is not None
        out = {"name": t["name"], "seg": region.key, "ino": region.ino, "region": name, "off": off, "size": size}
    else:
        off = data_start + int(t["data"])
        if size < 0 or off < client.arena_offset or off + size > client.seg.size:
            raise RequestError(f"tensor '{t['name']}' lies outside the client's arena")
        out = {"name": t["name"], "seg": client.name, "off": off, "size": size}
    if "datatype" in t:
        out.update(datatype=t["datatype"], shape=t["shape"])
    return out


def read_inputs(entry: dict, segments: SegmentCache, on_device: bool = False,
                views: InputViews | None = None) -> tuple[dict[str, Any], frozenset[str]]:
    """The entry's inputs as arrays, and the names of those that are this process's own (a model
    may write into them). An input in a client's arena (or a step's output in a worker's) is a
    view over that memory, or with ``views`` a private copy-on-write view when it is large
    (``input_views.py``; not for a stream, whose request outlives the round); one in a
    registered region is read into memory of our own (its client may truncate it under us,
    ``shm/region_io.py``); one in a client's CUDA region stays there as a device tensor when
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
            data = memoryview(segments.regions.read(t))  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
            own.append(t["name"])
        else:
            view = views.array(t["seg"], off, size, t["datatype"], t["shape"]) if views is not None else None
            if view is not None:
                inputs[t["name"]] = view
                own.append(t["name"])
                continue
            data = segments.get(t["seg"]).buf[off:off + size]
        inputs[t["name"]] = from_buffer(data, t["datatype"], t["shape"])
    return inputs, frozenset(own)
