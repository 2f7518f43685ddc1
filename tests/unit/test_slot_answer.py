"""A producer answers a slot of a client's segment by writing the answer's fields, then DONE: the
slot's state and target words, which other processes poll (the client for DONE, the broker for
a dead worker's slots), never pass through 0 on the way (``struct.pack_into`` zeroes what it
writes first, and the whole slot used to be packed)."""
from __future__ import annotations

import os
import time

from shmserve.shm.channel import NOTIFY_BROKER, ClientSegment
from shmserve.shm.protocol import SLOT_DONE, SLOT_PENDING


def test_completing_a_slot_never_shows_a_passing_state_or_target():
    name = f"/shmserve.unit{os.getpid()}_answer.client.1-0"
    client = ClientSegment.create(name, 4096, ticket=1, slots=4, notify=NOTIFY_BROKER)
    producer = ClientSegment.attach(name)
    try:
        client.set_target(0, 7)  # the request went to worker 6 directly
        client.set_slot_state(0, SLOT_PENDING)
        base = client.slots_offset
        state = client.seg.buf[base:base + 4].cast("I")
        target = client.seg.buf[base + 32:base + 40].cast("Q")
        child = os.fork()
        if child == 0:  # the worker, over its own mapping
            try:
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    for n in range(1000):
                        producer.complete(0, 200, 1, 6, 4096, n)
                        producer.set_slot_state(0, SLOT_PENDING)  # (as the slot's next request)
            finally:
                os._exit(0)
        states: set[int] = set()
        targets: set[int] = set()
        try:
            while not os.waitpid(child, os.WNOHANG)[0]:
                for _ in range(1000):
                    states.add(state[0])
                    targets.add(target[0])
        finally:
            state.release()
            target.release()
        assert states <= {SLOT_PENDING, SLOT_DONE} and SLOT_DONE in states, states
        assert targets == {7}, targets
        assert client.read_slot(0)[1:6] == (200, 1, 6, 4096, 999)
    finally:
        producer.close()
        client.close()
        client.unlink()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve.unit{os.getpid()}_")]
