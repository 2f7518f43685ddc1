"""The connected clients (frontend processes and local programs): the connect ring, their lanes,
and answers from the broker's own arena.

A client announces itself on its user's connect ring with the name of the client segment it
created; the broker attaches it and, while one is free, gives it a lane: its own
ring on every worker, so that it may send requests of default-scheduled models to a worker
directly (see routes.py for which). Answers the broker makes itself (control replies, early
errors, ensembles) are written into the broker's arena and completed in the client's slot.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Any

import posix_ipc

from shmserve.batching import Pending
from shmserve.shm.answer import NO_VERSION, AnswerDescriptor, answer_room, write_answer
from shmserve.shm.arena import no_room_text
from shmserve.shm.extents import GrowthRefused, OutputArenas
from shmserve.shm.access import server_readers
from shmserve.shm.channel import LANE_REFUSED, LANES, NO_LANE, BrokerSegment, ClientSegment, lane_range, pid_namespace
from shmserve.shm.liveness import Tickets
from shmserve.shm.protocol import NO_BLOCK_SHM_FULL, ROLE_BROKER, SLOT_PENDING, role_word
from shmserve.shm.ring import Ring, RingCorrupt
from shmserve.shm.untrusted import Fault, Garbage, check_connect, client_name_pattern

from .models import Client

log = logging.getLogger("shmserve.broker")

_QUARANTINED = "<refused>"  # the lane of a refused client, until its process is gone

# What the clients of one user other than the server's (--local-client-users) may hold at once:
# each costs the broker descriptors (its truncation guard's, a FIFO's) and address space for its
# segment, which it makes as large as it likes (sparse), so without a bound one user could take
# all of either from everyone else.
MAX_CLIENTS_PER_USER = 1024
MAX_SEGMENT_BYTES_PER_USER = 1 << 40


class Clients:
    """``tickets``: the broker's view of the clients' liveness tickets (shm/liveness.py): a
    client may live in another PID namespace (another container of the pod), so its pid means
    nothing here; whether it lives is whether its ticket is held."""

    def __init__(self, seg: BrokerSegment, server_id: str, tickets: Tickets, answers: OutputArenas) -> None:
        self.seg = seg
        self.tickets = tickets
        self._pid_namespace = pid_namespace()
        self.answers = answers  # the broker's output arena, which grows (shm/extents.py)
        self.by_name: dict[str, Client] = {}
        self.lanes: list[str | None] = [None] * LANES  # lane -> the client holding it
        self.next_cookie = 0
        self._names = client_name_pattern(server_id)
        self.quarantined: dict[int, int] = {}  # lane -> the ticket of the refused client that held it
        self._readers = server_readers()  # the other users whose clients may connect: their lanes
        self._held: collections.Counter[int] = collections.Counter()  # uid -> its clients' count
        self._held_bytes: collections.Counter[int] = collections.Counter()  # uid -> their segments' bytes
        self._said_full: set[int] = set()  # users told of (once while at the bound)

    def on_connects(self) -> None:
        """Attach every client that announced itself on a connect ring: the server's user's
        (``connect.0``) or its own user's. A record that names no client segment of its own
        ticket, or whose ticket no live process holds, or (on another user's ring) a segment not
        of that user, is refused, with a warning, and so is a ring whose counters were scribbled
        on (its records are skipped)."""
        for uid, ring in self.seg.connect_rings.items():
            self._on_connects(ring, uid)

    def _on_connects(self, ring: Ring, uid: int) -> None:
        try:
            records = ring.drain()
        except RingCorrupt as e:
            skipped = ring.resync()
            log.warning("refused %d connect record(s): the connect ring of uid %d's %s", skipped, uid, e)
            return
        for ticket, raw in records:
            try:
                name = check_connect(self._names, ticket, raw)
                if name in self.by_name:
                    raise Garbage(Fault.CONNECT, f"ticket {ticket}: {name} is connected already")
                if not self.tickets.held(ticket):
                    raise Garbage(Fault.CONNECT, f"ticket {ticket} is held by no live process")
                seg = ClientSegment.attach(name)
                if seg.ticket != ticket:
                    seg.close()
                    raise Garbage(Fault.HEADER, f"{name} was made under ticket {seg.ticket}, not {ticket}")
                if uid != os.geteuid() and seg.seg.uid != uid:
                    seg.close()
                    raise Garbage(Fault.CONNECT, f"{name} is uid {seg.seg.uid}'s, announced on uid {uid}'s ring")
            except (posix_ipc.Error, ConnectionError, OSError, ValueError) as e:
                log.warning("client %d could not be attached: %s", ticket, e)
                continue
            if self._over_bound(name, seg):
                seg.lane = LANE_REFUSED  # (its library says the server refused it)
                seg.close()
                continue
            self._held[seg.seg.uid] += 1
            self._held_bytes[seg.seg.uid] += seg.seg.size
            self._said_full.discard(seg.seg.uid)
            pid, namespace = seg.process()
            client = Client(name=name, ticket=ticket, seg=seg, pid=pid if namespace == self._pid_namespace else 0)
            self.by_name[name] = client
            self._give_lane(client)
            log.debug("client %s connected (lane %s)", name, client.lane)

    def _over_bound(self, name: str, seg: ClientSegment) -> bool:
        """Whether a client of another user than the server's would take that user past its
        bound (said once while the user stays at it). The server's own user is not bound: it
        could stop the server anyway."""
        uid = seg.seg.uid
        if uid == os.geteuid():
            return False
        if self._held[uid] < MAX_CLIENTS_PER_USER and self._held_bytes[uid] + seg.seg.size <= MAX_SEGMENT_BYTES_PER_USER:
            return False
        if uid not in self._said_full:
            self._said_full.add(uid)
            log.warning("refused client %s (a segment of %d GiB): the clients of uid %d hold %d connections and "
                        "%d GiB of segments, and a user may hold at most %d and %d GiB", name, seg.seg.size >> 30,
                        uid, self._held[uid], self._held_bytes[uid] >> 30, MAX_CLIENTS_PER_USER,
                        MAX_SEGMENT_BYTES_PER_USER >> 30)
        return True

    def _give_lane(self, client: Client) -> None:
        """A lane lets the client reach workers of default-scheduled models without our hop. Its
        user's lanes (``lane_range``: an equal share for each user of --local-client-users, the
        server's counted) lie in an object only that user may write: one user's clients, however
        many, leave lanes to the frontends and every other user, and never write theirs. A client
        finding none free has no lane and sends everything through the broker (a hop more,
        nothing refused)."""
        self._release_quarantined()
        lane = next((i for i in lane_range(client.uid, self._readers) if self.lanes[i] is None), None)
        if lane is None:
            client.seg.lane = NO_LANE  # none for it: this client goes through the broker only
            return
        self.lanes[lane] = client.name
        self.next_cookie += 1
        self.seg.set_lane_client(lane, client.name, self.next_cookie)
        client.lane = lane
        client.seg.cookie = self.next_cookie
        client.seg.lane = lane  # last: the client waits for this

    def remove(self, client: Client) -> None:
        """Free the client's lane and its segment, whose names are unlinked here too: a client
        that died left them, and one that said goodbye unlinked them before, unless it wrote
        what the library never would and dies later (nothing would remove them then)."""
        if self.by_name.pop(client.name, None) is not None:
            self._held[client.uid] -= 1
            self._held_bytes[client.uid] -= client.seg.seg.size
            self._said_full.discard(client.uid)
        if client.lane is not None and self.lanes[client.lane] == client.name:
            self.lanes[client.lane] = None
            self.seg.set_lane_client(client.lane, "", 0)
        client.seg.close()
        client.seg.unlink()
        self.seg.departures[0] += 1  # workers unmap departed clients' segments when this moves
        log.debug("client %s disconnected", client.name)

    def refuse(self, client: Client) -> None:
        """A client that wrote garbage (it is about to be removed, ``remove``): every
        request it has pending is cancelled, so workers drop what they have not run and a running
        model sees ``is_cancelled()``; its header says it was refused (its library then fails what
        is in flight); and its lane is given to nobody while the process lives, so that whatever it
        still writes there never lands in another client's requests."""
        client.seg.cancel_pending()
        client.seg.lane = LANE_REFUSED
        if client.lane is not None and self.lanes[client.lane] == client.name:
            self.lanes[client.lane] = _QUARANTINED
            self.quarantined[client.lane] = client.ticket
            self.seg.set_lane_client(client.lane, "", 0)

    def _release_quarantined(self) -> None:
        for lane, ticket in list(self.quarantined.items()):
            if not self.tickets.held(ticket):
                del self.quarantined[lane]
                self.lanes[lane] = None

    def reply(self, client: Client, slot: int, status: int, answer: AnswerDescriptor | Any) -> None:
        """Answer a client from the broker's own arena: an answer (early errors and refusals), or
        a control request's JSON document (``AnswerDescriptor.of_document``). A client that is
        gone (reclaimed while a load it asked for ran, say: its segment is closed) gets nothing."""
        if self.by_name.get(client.name) is not client:
            log.debug("client %s left before its answer to slot %d (status %d)", client.name, slot, status)
            return
        if not isinstance(answer, AnswerDescriptor):
            answer = AnswerDescriptor.of_document(answer)
        data = answer.encode()
        room = answer_room(len(data))
        try:
            extent, off = self.answers.alloc(room, client.ticket, client.uid)
            refused, shm_full = "", False
        except GrowthRefused as e:
            extent, off, refused, shm_full = 0, -1, str(e), e.shm_full
        if off < 0:  # answered without a block: the client reads shm.protocol.no_block_text (a 503)
            log.error("%s: client %s gets a 503 for slot %d",
                      refused or no_room_text(self.answers.first, "the broker's arena is full"), client.name, slot)
            client.seg.complete(slot, 503, ROLE_BROKER, 0, 0,
                                NO_BLOCK_SHM_FULL if shm_full or self.answers.first.starved else 0)
        else:
            write_answer(self.answers.buf(extent), off, data)
            client.seg.complete(slot, status, role_word(ROLE_BROKER, extent), 0, off, room)
        client.seg.waker.notify()

    def fail_pending(self, batch: list[Pending], status: int, message: str, version: int = NO_VERSION) -> None:
        """Answer with an error every request of ``batch`` whose client still waits for it
        (``version``: the version they were queued for, which their traces name)."""
        for p in batch:
            if p.client.name in self.by_name and int(p.client.seg.slot_states[p.slot]) == SLOT_PENDING:
                self.reply(p.client, p.slot, status, AnswerDescriptor(error=message, version=version))
