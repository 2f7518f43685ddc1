"""Request descriptors a worker has checked before, kept by their bytes.

A client repeats itself: the requests of a closed loop carry the same descriptor but for the
send time ``t``, which clients write last. The worker keeps what it derived from a descriptor
(the inputs checked against the signature, the outputs, the queue options) under the bytes
before ``t``; a request with known bytes then costs a lookup, the parse of ``t`` and placing its
tensors at its own data start, instead of a JSON parse and every check (about a fifth of the
worker's own time per request for a small model).

Only descriptors whose meaning cannot change are kept: tensors in the client's own block. Names
of registered regions (the table changes), streams and traced requests always take the full way.
"""
from __future__ import annotations

from typing import Any

SEND_TIME = b',"t":'
LIMIT = 1024  # descriptors kept per worker; a client that never repeats itself only refills it
LARGEST = 8192  # bytes of a descriptor worth keeping (many tensors, long parameters: parsed each time)
_INPUT_KEYS = frozenset({"name", "datatype", "shape", "data", "size"})
_OUTPUT_KEYS = frozenset({"name", "data", "size", "class"})
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
    """What a checked descriptor asks for, with tensor offsets relative to the data start."""

    __slots__ = ("batch", "priority", "timeout_us", "fields", "inputs", "outputs", "low", "high")

    def __init__(self, batch: int, priority: int, timeout_us: int, doc: dict[str, Any]) -> None:
        self.batch = batch
        self.priority = priority
        self.timeout_us = timeout_us
        self.fields = {"id": doc.get("id", ""), "params": doc.get("params"), "corr": doc.get("corr", 0),
                       "flags": doc.get("flags", 0)}
        self.inputs = [(t["name"], int(t["data"]), int(t["size"]), t["datatype"], t["shape"]) for t in doc["inputs"]]
        outputs = doc.get("outputs")
        self.outputs = [(o["name"], int(o["data"]) if "data" in o else None, int(o.get("size", 0)), o.get("class"))
                        for o in outputs] if outputs else None
        spans = [(rel, size) for _, rel, size, _, _ in self.inputs]
        spans += [(rel, size) for _, rel, size, _ in self.outputs or () if rel is not None]
        self.low = min(rel for rel, _ in spans)
        self.high = max(rel + size for rel, size in spans)

    def place(self, entry: dict[str, Any], client_name: str, data_start: int) -> None:
        """Fill ``entry`` as the full way would for this request's data start."""
        entry.update(self.fields)
        if entry["params"]:
            entry["params"] = dict(entry["params"])  # each request's own: a backend may change it
        entry["inputs"] = [{"name": name, "seg": client_name, "off": data_start + rel, "size": size,
                            "datatype": datatype, "shape": shape}
                           for name, rel, size, datatype, shape in self.inputs]
        if self.outputs is None:
            entry["outputs"] = None
            return
        outputs = []
        for name, rel, size, cls in self.outputs:
            out: dict[str, Any] = {"name": name} if rel is None else \
                {"name": name, "seg": client_name, "off": data_start + rel, "size": size}
            if cls is not None:
                out["class"] = cls
            outputs.append(out)
        entry["outputs"] = outputs


def plan_of(doc: dict[str, Any], batch: int, priority: int, timeout_us: int) -> Plan | None:
    """A plan for a descriptor that passed every check, or None if it may not be kept."""
    if not _REQUEST_KEYS.issuperset(doc):
        return None  # streams, traces, regions' tables: the full way each time
    inputs = doc["inputs"]
    if not inputs or any(not _INPUT_KEYS.issuperset(t) or "data" not in t for t in inputs):
        return None
    if any(not _OUTPUT_KEYS.issuperset(o) or ("data" in o) != ("size" in o) for o in doc.get("outputs") or ()):
        return None
    return Plan(batch, priority, timeout_us, doc)
