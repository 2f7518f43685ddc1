"""Microbenchmark: an add_sub answer (two INT32[16] outputs) made, written into a block, read
back and every field looked at, as the JSON document it used to be (orjson) and as the binary
answer descriptor (shm/answer.py). Interleaved, best of many rounds, in microseconds of this
thread's CPU time (a shared host's waits left out).

    python tools/bench_answer.py
"""
from __future__ import annotations

import time
import timeit

import orjson

from shmserve.shm.answer import AnswerDescriptor, OutputTensor, answer_room, write_answer

BUF = memoryview(bytearray(1 << 16))
NAMES = ("OUTPUT0", "OUTPUT1")


def with_json() -> object:
    outs, pos = [], 0
    for name in NAMES:
        outs.append({"name": name, "datatype": "INT32", "shape": [16], "size": 64, "off": pos})
        pos += 64
    raw = orjson.dumps({"version": 1, "outputs": outs})
    BUF[0:4] = len(raw).to_bytes(4, "little")
    BUF[4:4 + len(raw)] = raw
    n = int.from_bytes(BUF[0:4], "little")
    doc = orjson.loads(BUF[4:4 + n])
    return ([(o["name"], o["datatype"], o["shape"], o["off"], o["size"], o.get("region")) for o in doc["outputs"]],
            doc.get("version"), doc.get("params"), doc.get("error"))


def with_descriptor() -> object:
    outs, pos = [], 0
    for name in NAMES:
        outs.append(OutputTensor(name, "INT32", (16,), pos, 64))
        pos += 64
    write_answer(BUF, 0, AnswerDescriptor(outs, 1).encode())
    answer, _ = AnswerDescriptor.decode(BUF, 0, len(BUF))
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
