"""The connected clients (frontend processes and local programs): the connect ring, their lanes,
and answers from the broker's own arena.

A client announces itself on the broker segment's connect ring with the name of the client
segment it created; the broker attaches it and, while one is free, gives it a lane: its own
ring on every worker, so that it may send requests of default-scheduled models to a worker
directly (see routes.py for which). Answers the broker makes itself (control replies, early
errors, ensembles) are written into the broker's arena and completed in the client's slot.
"""
from __future__ import annotations

import logging
from typing import Any

import orjson
import posix_ipc

from shmserve.batching import Pending
from shmserve.shm.channel import LANES, NO_LANE, BrokerSegment, ClientSegment
from shmserve.shm.protocol import ROLE_BROKER, SLOT_PENDING, manifest_room, write_manifest

from .models import Client

log = logging.getLogger("shmserve.broker")


class Clients:
    def __init__(self, seg: BrokerSegment) -> None:
        self.seg = seg
        assert seg.arena is not None  # the broker's segment, which it created
        self.arena = seg.arena
        self.by_name: dict[str, Client] = {}
        self.lanes: list[str | None] = [None] * LANES  # lane -> the client holding it
        self.next_cookie = 0

    def on_connects(self) -> None:
        """Attach every client that announced itself on the connect ring."""
        for pid, raw in self.seg.connect.drain():
            name = raw.rstrip(b"\0").decode()
            try:
                seg = ClientSegment.attach(name)
            except (posix_ipc.ExistentialError, ConnectionError) as e:
                log.warning("client %d could not be attached: %s", pid, e)
                continue
            client = Client(name=name, pid=pid, seg=seg)
            self.by_name[name] = client
            self._give_lane(client)
            log.debug("client %s connected (lane %s)", name, client.lane)

    def _give_lane(self, client: Client) -> None:
        """A lane lets the client reach workers of default-scheduled models without our hop."""
        try:
            lane = self.lanes.index(None)
        except ValueError:
            client.seg.lane = NO_LANE  # all taken: this client goes through the broker only
            return
        self.lanes[lane] = client.name
        self.next_cookie += 1
        self.seg.set_lane_client(lane, client.name, self.next_cookie)
        client.lane = lane
        client.seg.cookie = self.next_cookie
        client.seg.lane = lane  # last: the client waits for this

    def remove(self, client: Client, died: bool) -> None:
        """Free the client's lane and its segment (unlinked here when the client ``died``)."""
        self.by_name.pop(client.name, None)
        if client.lane is not None and self.lanes[client.lane] == client.name:
            self.lanes[client.lane] = None
            self.seg.set_lane_client(client.lane, "", 0)
        client.seg.close()
        if died:
            client.seg.unlink()
        self.seg.departures[0] += 1  # workers unmap departed clients' segments when this moves
        log.debug("client %s disconnected", client.name)

    def reply(self, client: Client, slot: int, status: int, doc: Any) -> None:
        """Answer a client from the broker's own arena (control replies and early errors)."""
        data = orjson.dumps(doc)
        room = manifest_room(len(data))
        off = self.arena.alloc(room, client.pid)
        if off < 0:  # answered without a block: the client reads shm.protocol.NO_ROOM (a 503)
            log.error("broker arena is full; client %s gets a 503 for slot %d", client.name, slot)
            client.seg.complete(slot, 503, ROLE_BROKER, 0, 0, 0)
        else:
            write_manifest(self.seg.seg.buf, off, data)
            client.seg.complete(slot, status, ROLE_BROKER, 0, off, room)
        client.seg.waker.notify()

    def fail_pending(self, batch: list[Pending], status: int, message: str) -> None:
        """Answer with an error every request of ``batch`` whose client still waits for it."""
        for p in batch:
            if p.client.name in self.by_name and int(p.client.seg.slot_states[p.slot]) == SLOT_PENDING:
                self.reply(p.client, p.slot, status, {"error": message})
