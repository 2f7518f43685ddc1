"""Microbenchmark of the request descriptor on a typical add_sub request (2 inputs INT32[16], 2
outputs): the binary layout (shm/descriptor.py) against the JSON document it replaced, encoded and
decoded, and decoded *as a reader uses it* (the JSON reader also checked the types of the queue and
sequence fields, which the binary layout fixes). Interleaved, best of several rounds; CPU µs per
call (process time: the host may be busy).

    python -m shmserve.tools.bench_descriptor [--rounds 7] [--number 100000]
"""
from __future__ import annotations

import argparse
import time
import timeit
from typing import Any, Callable

import orjson

from shmserve.shm.descriptor import InferRequest, InputTensor, RequestedOutput, decode
from shmserve.shm.protocol import write_manifest


def json_doc() -> dict[str, Any]:
    return {"model": "add_sub", "version": "",
            "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": 0, "size": 64},
                       {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": 64, "size": 64}],
            "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}], "t": 123456789012345}


def request() -> InferRequest:
    return InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [16], 64, 0),
                                        InputTensor("INPUT1", "INT32", [16], 64, 64)],
                        [RequestedOutput("OUTPUT0"), RequestedOutput("OUTPUT1")], sent_ns=123456789012345)


def _json_fields(doc: dict[str, Any]) -> tuple:
    """What the broker and worker took out of a JSON descriptor, with the type checks it needed."""
    values = []
    for key in ("priority", "timeout", "t"):
        value = doc.get(key) or 0
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(key)
        values.append(value)
    corr, flags = doc.get("corr", 0), doc.get("flags", 0)
    if not isinstance(corr, str) and (not isinstance(corr, int) or isinstance(corr, bool) or not 0 <= corr < 1 << 64):
        raise ValueError("corr")
    if not isinstance(flags, int) or isinstance(flags, bool) or not 0 <= flags < 1 << 32:
        raise ValueError("flags")
    key = tuple([(t["name"], t["datatype"], tuple(t["shape"]), t["size"]) for t in doc["inputs"]])
    return (doc["model"], doc.get("version"), doc.get("id", ""), doc.get("params"), corr, flags, "stream" in doc,
            "tr" in doc, key, *values)


def _binary_fields(req: InferRequest) -> tuple:
    key = tuple([(t.name, t.datatype, tuple(t.shape), t.size) for t in req.inputs])
    return (req.model, req.version, req.id, req.parameters, req.sequence_id, req.sequence_flags,
            req.stream is not None, req.traced, key, req.priority, req.timeout_us, req.sent_ns)


def cases() -> dict[str, Callable[[], Any]]:
    doc, req = json_doc(), request()
    jbuf, bbuf = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    j, b = orjson.dumps(doc), req.encode()
    write_manifest(jbuf, 0, j)
    write_manifest(bbuf, 0, b)
    jn, bn = 4 + len(j), 4 + len(b)
    return {
        "json encode": lambda: orjson.dumps(doc),
        "binary encode": req.encode,
        "json decode": lambda: orjson.loads(jbuf[4:jn]),
        "binary decode": lambda: decode(bbuf, 4, bn),
        "json decode+read": lambda: _json_fields(orjson.loads(jbuf[4:jn])),
        "binary decode+read": lambda: _binary_fields(decode(bbuf, 4, bn)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=100_000)
    args = parser.parse_args()
    best: dict[str, float] = {}
    runs = cases()
    for _ in range(args.rounds):  # interleaved: a busy moment of the host hits every case alike
        for name, fn in runs.items():
            us = timeit.timeit(fn, timer=time.process_time, number=args.number) / args.number * 1e6
            best[name] = min(best.get(name, us), us)
    print(f"descriptor bytes: json {len(orjson.dumps(json_doc()))}, binary {len(request().encode())}")
    for name, us in best.items():
        print(f"{name:20s} {us:6.2f} us")


if __name__ == "__main__":
    main()
