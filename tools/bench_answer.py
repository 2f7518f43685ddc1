"""Microbenchmark: an add_sub answer (two INT32[16] outputs) made, written into a block, read
back and every field looked at, as the JSON document it used to be (orjson, in the manifest
framing requests still use) and as the binary
answer descriptor (shm/answer.py). Interleaved, best of many rounds, in microseconds of this
thread's CPU time (a shared host's waits left out).

    python tools/bench_answer.py
"""
from __future__ import annotations

import time
import timeit

import orjson

from shmserve.shm.answer import OutputTensor, answer_room, decode_answer, encode_outputs, write_answer
from shmserve.shm.protocol import read_manifest_with_data, write_manifest

BUF = memoryview(bytearray(1 << 16))
NAMES = ("OUTPUT0", "OUTPUT1")


def with_json() -> object:
    outs, pos = [], 0
    for name in NAMES:
        outs.append({"name": name, "datatype": "INT32", "shape": [16], "size": 64, "off": pos})
        pos += 64
    write_manifest(BUF, 0, orjson.dumps({"version": 1, "outputs": outs}))
    doc, _ = read_manifest_with_data(BUF, 0)
    return ([(o["name"], o["datatype"], o["shape"], o["off"], o["size"], o.get("region")) for o in doc["outputs"]],
            doc.get("version"), doc.get("params"), doc.get("error"))


def with_descriptor() -> object:
    outs, pos = [], 0
    for name in NAMES:
        outs.append(OutputTensor(name, "INT32", (16,), pos, 64))
        pos += 64
    write_answer(BUF, 0, encode_outputs(outs, 1))  # as a worker writes a model's answer
    answer, _ = decode_answer(BUF, 0, len(BUF))
    return ([(o.name, o.datatype, o.shape, o.offset, o.size, o.in_region) for o in answer.outputs],
            answer.version, answer.params, answer.error)


def main(rounds: int = 15, number: int = 20000) -> None:
    assert answer_room(1) == 64
    best = {"json (orjson)": float("inf"), "answer descriptor": float("inf")}
    for _ in range(rounds):
        for name, fn in (("json (orjson)", with_json), ("answer descriptor", with_descriptor)):
            best[name] = min(best[name], timeit.timeit(fn, number=number, timer=time.thread_time) / number * 1e6)
    for name, us in best.items():
        print(f"{name:20s} {us:6.2f} us")
    print(f"ratio {best['answer descriptor'] / best['json (orjson)']:.2f}")


if __name__ == "__main__":
    main()
