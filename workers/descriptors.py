"""Request descriptors a worker has checked before, kept by their bytes.

A client repeats itself: the requests of a closed loop carry the same descriptor but for the
send time ``t``, which clients write last. The worker keeps what it derived from a descriptor
(the inputs checked against the signature, the outputs, the queue options) under the bytes
before ``t``; a request with known bytes then costs a lookup, the parse of ``t`` and placing its
tensors at its own data start, instead of a JSON parse and every check (about a fifth of the
worker's own time per request for a small model).

Only descriptors whose meaning cannot change are kept: tensors in the client's own block, and
tensors in registered regions as long as the region table is the one they were resolved against
(its generation changes with every registration and unregistration). Streams and traced requests
always take the full way.
"""
from __future__ import annotations

from typing import Any, cast

from shmserve.shm.segment import Segment

SEND_TIME = b',"t":'
LIMIT = 1024  # descriptors kept per worker; a client that never repeats itself only refills it
LARGEST = 8192  # bytes of a descriptor worth keeping (many tensors, long parameters: parsed each time)
_INPUT_KEYS = frozenset({"name", "datatype", "shape", "data", "size", "region", "offset"})
_OUTPUT_KEYS = frozenset({"name", "data", "size", "class", "region", "offset"})
_REQUEST_KEYS = frozenset({"model", "version", "inputs", "outputs", "id", "params", "corr", "flags",
                           "priority", "timeout", "t"})


def split_send_time(raw: bytes) -> tuple[bytes, int] | None:
    """(the bytes before ``t``, ``t``) of a descriptor whose last member is ``t``, else None.
    JSON strings escape their quotes, so the marker can only be a member name."""
    if len(raw) > LARGEST:
        return None
    cut = raw.rfind(SEND_TIME)
    if cut <= 0 or raw[-1:] != b"}":
        return None
    digits = raw[cut + len(SEND_TIME):-1]
    if not digits.isdigit() or len(digits) > 19:  # past 64 bits: the JSON parser's error
        return None
    return raw[:cut], int(digits)


class Plan:
    """What a checked descriptor asks for: tensors in the client's block by their offsets relative
    to the data start, tensors in regions as they were resolved (valid while the region table's
    generation is ``regions``; None: no region named)."""

    __slots__ = ("batch", "priority", "timeout_us", "fields", "inputs", "outputs", "low", "high", "regions")

    def __init__(self, batch: int, priority: int, timeout_us: int, doc: dict[str, Any], entry: dict[str, Any],
                 regions: int | None) -> None:
        self.batch = batch
        self.priority = priority
        self.timeout_us = timeout_us
        self.regions = regions
        self.fields = {"id": doc.get("id", ""), "params": doc.get("params"), "corr": doc.get("corr", 0),
                       "flags": doc.get("flags", 0)}
        # (name, offset from the data start or None, size, datatype, shape, resolved region tensor)
        self.inputs = [(t["name"], int(t["data"]) if "data" in t else None, int(t["size"]), t["datatype"], t["shape"],
                        None if "data" in t else placed) for t, placed in zip(doc["inputs"], entry["inputs"])]
        outputs = doc.get("outputs")
        self.outputs = [(o["name"], int(o["data"]) if "data" in o else None, int(o.get("size", 0)), o.get("class"),
                         placed if "region" in o else None)
                        for o, placed in zip(outputs, entry["outputs"])] if outputs else None
        spans = [(t[1], t[2]) for t in self.inputs if t[1] is not None]
        spans += [(o[1], o[2]) for o in self.outputs or () if o[1] is not None]
        self.low = min((rel for rel, _ in spans), default=0)
        self.high = max((rel + size for rel, size in spans), default=0)

    def place(self, entry: dict[str, Any], client_name: str, data_start: int) -> None:
        """Fill ``entry`` as the full way would for this request's data start."""
        entry.update(self.fields)
        if entry["params"]:
            entry["params"] = dict(entry["params"])  # each request's own: a backend may change it
        entry["inputs"] = [{"name": name, "seg": client_name, "off": data_start + cast(int, rel), "size": size,
                            "datatype": datatype, "shape": shape} if placed is None else dict(placed)
                           for name, rel, size, datatype, shape, placed in self.inputs]
        if self.outputs is None:
            entry["outputs"] = None
            return
        outputs = []
        for name, rel, size, cls, placed in self.outputs:
            out: dict[str, Any] = dict(placed) if placed is not None else {"name": name} if rel is None else \
                {"name": name, "seg": client_name, "off": data_start + rel, "size": size}
            if cls is not None:
                out["class"] = cls
            outputs.append(out)
        entry["outputs"] = outputs


def plan_of(doc: dict[str, Any], entry: dict[str, Any], batch: int, priority: int, timeout_us: int,
            regions: int | None) -> Plan | None:
    """A plan for a descriptor that passed every check (``entry``: what the check resolved, with
    region tensors resolved against the table of generation ``regions``; None: the table changed
    meanwhile), or None if it may not be kept."""
    if not _REQUEST_KEYS.issuperset(doc):
        return None  # streams, traces: the full way each time
    inputs = doc["inputs"]
    if not inputs or any(not _INPUT_KEYS.issuperset(t) or ("data" in t) == ("region" in t) for t in inputs):
        return None
    outputs = doc.get("outputs") or ()
    if any(not _OUTPUT_KEYS.issuperset(o) or ("data" in o or "region" in o) != ("size" in o)
           or ("data" in o and "region" in o) for o in outputs):
        return None
    named = any("region" in t for t in inputs) or any("region" in o for o in outputs)
    if named and regions is None:
        return None
    return Plan(batch, priority, timeout_us, doc, entry, regions if named else None)


class Kept:
    """A direct request's entry, kept by its client and slot, for a *rerun*: the HTTP frontend
    sends a keep-alive connection's next request in the slot and block of the last (when its
    worker answered that one whole), with the same descriptor but for its send time, and the same
    trailer (``Connection.rerun``). Such a request is recognised by its bytes, not trusted: the
    block's descriptor up to the send time and its trailer span are compared with what this
    worker saw there last. A match costs two short copies and compares instead of the plan's
    lookup and placing and the trailer's reading; a block whose bytes differ (another request
    in the slot, run here or by another instance) goes the usual way and drops the kept entry.

    A request is kept only once its answer went to the HTTP client whole (what a rerun needs):
    an answer that goes through the frontend (a batch's, for one) is never followed by a rerun."""

    __slots__ = ("client", "off", "length", "head", "tail", "digits_end", "entry", "batch", "priority",
                 "timeout_us", "viewed")

    def __init__(self, client: object, seg: Segment, off: int, length: int, prefix_len: int, doc_len: int,
                 tail_len: int, entry: dict[str, Any], batch: int, priority: int, timeout_us: int) -> None:
        """``prefix_len``: the document's bytes before its send time; ``doc_len``: all of them;
        ``tail_len``: the bytes of the trailer and what it points at."""
        self.client = client
        self.off = off
        self.length = length
        # the document's length and its bytes up to the send time's digits; the trailer's span
        self.head = seg.read(off, off + 4 + prefix_len + len(SEND_TIME))
        self.tail = seg.read(off + length - tail_len, off + length)
        self.digits_end = off + 4 + doc_len - 1  # where the document's closing brace is
        self.entry = dict(entry)  # as it was before the backend saw it
        if entry["params"]:
            self.entry["params"] = dict(entry["params"])
        self.batch = batch
        self.priority = priority
        self.timeout_us = timeout_us
        self.viewed = False  # whether arrays over its inputs were looked for (at its first rerun)

    def send_time(self, client: object, seg: Segment, off: int, length: int) -> int:
        """The send time of the request in this block of ``client``'s segment ``seg`` if it is the
        kept one again, else -1."""
        if client is not self.client or off != self.off or length != self.length:
            return -1
        head, tail = self.head, self.tail
        end = off + length
        if seg.read(end - len(tail), end) != tail:
            return -1
        text = seg.read(off, self.digits_end + 1)  # its length, document up to the digits, digits, "}"
        digits = text[len(head):-1]
        if not text.startswith(head) or not text.endswith(b"}") or not digits.isdigit():
            return -1
        return int(digits)

    def entry_for(self, sent_ns: int) -> dict[str, Any]:
        """The entry of this request: the kept one's, with its own send time and parameters."""
        entry = dict(self.entry)
        entry["t"] = sent_ns
        if entry["params"]:
            entry["params"] = dict(entry["params"])  # each request's own: a backend may change it
        return entry
