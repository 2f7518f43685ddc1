"""A request as a worker runs it: the *entry*, with every tensor located.

The client's request descriptor (descriptor.py) says where a tensor lies relative to its own
block; whoever checks it first (the broker's ``Intake``, or the worker for a request on its lane,
workers/requests.py) resolves each tensor to a segment, an offset and a size it has bounds-checked,
and keeps the request's options under these names. The broker sends a batch of entries to a
worker as one JSON document (``{"requests": [...]}``, ``Scheduler.send_batch``); an ensemble's
step requests are entries the broker builds itself.

Defined once here, as TypedDicts: the entry is JSON on the wire (orjson writes and reads dicts
faster than any class), and these say which keys it has and what they hold.
"""
from __future__ import annotations

from typing import Any, TypedDict, Union

# A tensor's place: in a segment (a client's arena, a worker's, the broker's) at ``off``; or in a
# registered region (region_io.py: ``ino`` pins the object it named when
# registered, ``region`` its name); or in a CUDA region (``cuda``: the IPC handle, base64, and its
# ``device``). An input also has its ``datatype`` and ``shape``; a requested output may have
# ``class``, Triton's classification count.
LocatedTensor = TypedDict("LocatedTensor", {
    "name": str, "datatype": str, "shape": list, "seg": str, "off": int, "size": int, "ino": int,
    "region": str, "cuda": str, "device": int, "class": int,
}, total=False)


class StreamPlace(TypedDict):
    """A streaming request's response ring, in its client's segment."""

    seg: str
    off: int


class AnswerTarget(TypedDict):
    """Where an answer goes: the client's segment, its liveness ticket and the completion slot."""

    client: str
    ticket: int
    slot: int


class BatchEntry(AnswerTarget, total=False):
    """One request of a batch (``AnswerTarget``'s fields always present)."""

    id: str  # the request's id, echoed in its answer
    parameters: dict[str, Any] | None  # the model's request parameters
    sequence_id: Union[int, str]  # 0: not in a sequence
    sequence_flags: int  # descriptor.SEQUENCE_START | SEQUENCE_END
    slot_index: int  # the batch slot its sequence holds on the instance (the sequence batcher's)
    sent_ns: int  # when the client sent it (monotonic ns): queue delays and latency count from it
    timeout_us: int  # present only when the client gave one: its timeout, which the model may read
    trace_queued_ns: int  # present only when traced: its QUEUE_START (0: it never queued in the broker)
    inputs: list[LocatedTensor]
    outputs: list[LocatedTensor] | None  # None: every output of the model
    regions: list[str]  # the registered regions it names, held while it is in flight
    stream: StreamPlace  # present for a streaming (decoupled) request
    # Set by the worker's response cache, in the worker only: the request's key (None: not
    # cacheable) and how long its lookup took.
    cache_key: bytes | None
    cache_lookup_ns: int
