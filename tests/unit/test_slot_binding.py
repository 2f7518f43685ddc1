"""A direct request's binding in its slot (shm/channel.py ``bind``/``take_bound``): a worker takes
a lane record only for a pending slot bound to that block and sent to it, once; a slot whose
request went through the broker (``unbind``) takes no lane record, not even one an earlier use
of the slot left on a lane, written again by another user's client."""
from __future__ import annotations

import os

from shmserve.shm.channel import NOTIFY_BROKER, ClientSegment
from shmserve.shm.protocol import SLOT_DONE, SLOT_PENDING


def test_a_lane_record_is_taken_once_and_only_for_the_block_its_slot_binds():
    name = f"/shmserve.unit{os.getpid()}_binding.client.1-0"
    client = ClientSegment.create(name, 4096, ticket=1, slots=4, notify=NOTIFY_BROKER)
    worker = ClientSegment.attach(name)  # (the worker's mapping)
    try:
        client.bind(1, 512, 64)
        client.set_target(1, 3 + 1)  # sent to worker 3
        client.set_slot_state(1, SLOT_PENDING)
        assert not worker.take_bound(1, 576, 64, 3)  # another block
        assert not worker.take_bound(1, 512, 128, 3)  # another length
        assert not worker.take_bound(1, 512, 64, 2)  # another worker
        assert not worker.take_bound(2, 512, 64, 3)  # another slot (free)
        assert worker.take_bound(1, 512, 64, 3)
        assert client.taken(1) and client.bound(1) == (512, 64)
        assert not worker.take_bound(1, 512, 64, 3), "taken once"
        worker.complete(1, 200, 1, 3, 4096, 8)
        assert client.read_slot(1)[0] == SLOT_DONE
        assert not worker.take_bound(1, 512, 64, 3), "answered"
        # The slot's next request goes through the broker, which has a worker (3, say) name
        # itself in the slot: the record of its earlier use, written again, takes nothing.
        client.unbind(1)
        client.set_target(1, 0)
        client.set_slot_state(1, SLOT_PENDING)
        client.set_target(1, 3 + 1)
        assert not worker.take_bound(1, 512, 64, 3)
        assert not worker.take_bound(1, 0, 0, 3)
    finally:
        worker.close()
        client.close()
        client.unlink()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve.unit{os.getpid()}_")]
