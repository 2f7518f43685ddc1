"""A hostile local client for test_untrusted_clients.py's fuzz test: ``python hostile_client.py
SERVER_ID MODE SEED SECONDS``. It sends add_sub requests for SECONDS while a thread of its own
corrupts, with random and boundary values from ``random.Random(SEED)``, what MODE names of the
shared memory it may write, concurrently with the server reading it (a field valid when checked may
change before use). When the server disconnects it, it connects again. It prints ``SEGMENT name``
for each segment it made and, at the end, ``OUTCOMES {json}``: how its requests ended ("HANG":
none within 5 s, after which it stops).

Modes: ``header`` (its segment header), ``ring`` (its request ring's counters and records),
``slots`` (its completion slots: state, target, cancelled, taken, bound block), ``block`` (the
block of its request in flight: descriptor and tensor bytes), ``lanes`` (records and counters
on its lane of the worker), ``truncate`` (its segment, shrunk and grown again: it may die of
SIGBUS itself), ``descriptor`` (well-formed descriptors whose counts, shapes, sizes, offsets,
regions and options are boundary values).
"""
from __future__ import annotations

import json
import os
import random
import struct
import sys
import threading
import time

import numpy as np

from shmserve.shm.channel import SLOT_BYTES
from shmserve.shm.client import Client
from shmserve.shm.descriptor import DATATYPES, InferRequest, InputTensor, RequestedOutput
from shmserve.shm.protocol import manifest_room

SERVER, MODE, SEED, SECONDS = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
rng = random.Random(SEED)
EDGE32 = [0, 1, 2, 3, 4, 7, 63, 64, 255, 4095, 4096, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFD, 0xFFFFFFFE, 0xFFFFFFFF]
EDGE64 = EDGE32 + [1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
A = np.arange(16, dtype=np.int32)
outcomes: dict[str, int] = {}
stop = threading.Event()
blocks: list[tuple[int, int]] = []  # (offset, length) of the requests it sent last


def edge32() -> int:
    return rng.choice(EDGE32) if rng.random() < 0.7 else rng.getrandbits(32)


def edge64() -> int:
    return rng.choice(EDGE64) if rng.random() < 0.7 else rng.getrandbits(64)


def note(what: str) -> None:
    outcomes[what] = outcomes.get(what, 0) + 1


def connect() -> Client:
    client = Client(SERVER)
    conn = client._conn  # noqa: SLF001 - the attack writes the raw layouts
    print("SEGMENT " + conn.name, flush=True)
    alloc = conn._alloc  # noqa: SLF001

    def remembered(total: int) -> int:
        off = alloc(total)
        blocks[:] = blocks[-3:] + [(off, total)]
        return off

    conn._alloc = remembered  # noqa: SLF001
    return client


client = connect()


def scribble(lo: int, hi: int) -> None:
    buf = client._conn.seg.seg.buf  # noqa: SLF001
    at = lo + rng.randrange(0, max(1, (hi - lo) // 4)) * 4
    if rng.random() < 0.3:
        struct.pack_into("<Q", buf, at & ~7, edge64())
    else:
        struct.pack_into("<I", buf, at, edge32())


def corrupt_header() -> None:
    scribble(0, 128)


def corrupt_ring() -> None:
    seg = client._conn.seg  # noqa: SLF001
    lo = seg.requests._off  # noqa: SLF001
    scribble(lo, lo + 64 + 32 * 64)


def corrupt_slots() -> None:
    so = client._conn.seg.slots_offset  # noqa: SLF001
    scribble(so, so + 32 * SLOT_BYTES)


def corrupt_block() -> None:
    if not blocks:
        return
    off, total = blocks[-1]
    buf = client._conn.seg.seg.buf  # noqa: SLF001
    n = struct.unpack_from("<I", buf, off)[0]
    data = off + manifest_room(n) if n < total else off
    if rng.random() < 0.95 and data < off + total - 4:  # mostly the tensor bytes: the descriptor's disconnects
        scribble(data, off + total - 4)
    else:
        scribble(off, off + min(total, 256) - 4)


def corrupt_lanes() -> None:
    conn = client._conn  # noqa: SLF001
    num, worker = conn._router.pick(InferRequest("add_sub"))  # noqa: SLF001
    seg, lane = conn.seg, worker.lanes[conn.lane]
    r = rng.random()
    if r < 0.1:
        lane._ctr[1] = edge64()  # noqa: SLF001 - the lane's producer counter is the client's
    elif r < 0.2:
        lane._ctr[0] = edge64()  # noqa: SLF001 - and the worker's, in an object the client may write
    else:
        slot = rng.choice([0, 1, seg.nslots - 1, seg.nslots, edge32()])
        off = rng.choice([seg.arena_offset, seg.arena_offset + 64, seg.seg.size - 4, seg.seg.size, edge64()])
        length = rng.choice([0, 4, 256, seg.seg.size, edge64()])
        if slot < seg.nslots and rng.random() < 0.5:  # bound as the library binds a real request
            seg.bind(slot, off, length)
            seg.set_target(slot, num + 1)
            seg.set_slot_state(slot, 1)
        lane.put(rng.choice([1, 2, 3, 4, 0x101, edge32()]), slot, off, length, rng.choice([conn._cookie, edge64()]))  # noqa: SLF001
    worker.ring_bell(conn.lane)
    worker.waker.notify()


def truncate() -> None:
    seg = client._conn.seg  # noqa: SLF001
    fd = os.open("/dev/shm" + seg.name, os.O_RDWR)
    try:
        os.ftruncate(fd, rng.choice([0, 4096, seg.slots_offset, seg.arena_offset, seg.arena_offset + 8192]))
        time.sleep(rng.random() * 0.003)
        os.ftruncate(fd, seg.seg.size)
    finally:
        os.close(fd)


CORRUPT = {"header": corrupt_header, "ring": corrupt_ring, "slots": corrupt_slots, "block": corrupt_block,
           "lanes": corrupt_lanes, "truncate": truncate}


def corrupting() -> None:
    while not stop.is_set():
        try:
            CORRUPT[MODE]()
        except Exception:  # noqa: BLE001 - (its connection went meanwhile: the next one is corrupted)
            pass
        time.sleep(rng.random() * 0.002)


def edge_int() -> int:
    return rng.choice([0, 1, -1, 2, 16, 64, 4096, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, -(1 << 63)])


def odd_request() -> tuple[InferRequest, bytes]:
    """A descriptor the library would write, with values no caller of it passes."""
    data = bytes(rng.randint(0, 256))
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        shape = rng.choice([[16], [edge_int()], [edge_int(), edge_int()], [], [1] * 40])
        where = rng.choice([0, 64, edge_int() & ((1 << 64) - 1)])
        inputs.append(InputTensor(rng.choice([name, name, "", "Z"]), rng.choice(["INT32", "BYTES", rng.choice(DATATYPES)]),
                                  shape, rng.choice([64, len(data), 0, edge_int() & ((1 << 64) - 1)]), where,
                                  rng.choice(["", "", "nosuch", "x" * 300]), where))
    outputs = None
    if rng.random() < 0.4:
        outputs = [RequestedOutput(rng.choice(["OUTPUT0", "nope"]), rng.choice([0, 1, 1 << 31]), "", 0,
                                   rng.choice([0, 64, 1 << 40]), rng.choice([None, 0, 64, (1 << 64) - 1]))]
    request = InferRequest("add_sub", rng.choice(["", "1", "x"]), inputs, outputs, id=rng.choice(["", "x" * 5000]),
                           priority=rng.choice([0, (1 << 64) - 1]), timeout_us=rng.choice([0, 1, (1 << 64) - 1]),
                           sequence_id=rng.choice([0, "s", (1 << 64) - 1]), sequence_flags=rng.choice([0, 3, 0xFFFFFFFF]),
                           parameters=rng.choice([None, {"a": [1, None]}]))
    return request, data


def one_request() -> None:
    global client
    done = threading.Event()
    try:
        if MODE == "descriptor":
            request, data = odd_request()
            client._conn.infer(request, [data], lambda c: (c.release(), done.set()))  # noqa: SLF001
            outcome = "answered"
        else:
            future = client.infer_async("add_sub", {"INPUT0": A, "INPUT1": A})
            future.result(5)
            outcome = "ok"
            done.set()
        note(outcome if done.wait(5) else "HANG")
    except TimeoutError:
        note("HANG")
    except Exception as e:  # noqa: BLE001 - counted
        note(type(e).__name__)
        if type(e).__name__ in ("ServerUnavailable", "ConnectionClosed", "InferenceServerError", "Backpressure"):
            try:
                client.close()
                client = connect()
            except Exception as e:  # noqa: BLE001 - (the server is gone: the test says so)
                note(f"connect: {type(e).__name__}")
                time.sleep(0.1)


if MODE in CORRUPT:
    threading.Thread(target=corrupting, daemon=True).start()
end = time.monotonic() + SECONDS
while time.monotonic() < end and not outcomes.get("HANG"):
    one_request()
stop.set()
print("OUTCOMES " + json.dumps(outcomes), flush=True)
os._exit(0)  # (its threads may be touching a segment it truncated)
