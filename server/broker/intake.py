"""An inference request a client put on its request ring to the broker: checked against the
model's signature and resolved into the entry a worker reads, then handed to the version's
scheduler (or to the ensemble runner).

The entry names where every tensor lives (the client's arena, a registered system region or a
CUDA region) with bounds already checked, so a worker only maps and reads.
"""
from __future__ import annotations

import time

from shmserve.batching import Pending
from shmserve.shm.batch_entry import BatchEntry, LocatedTensor
from shmserve.shm.answer import refusal
from shmserve.shm.descriptor import InputTensor, RequestedOutput
from shmserve.shm.untrusted import Record, read_request
from shmserve.signature import InvalidRequest

from .catalog import Catalog
from .clients import Clients
from .ensemble import Ensembles
from .ensemble_plan import DecoupledOnly
from .models import Client
from .regions import Regions
from .scheduler import Scheduler

EXITING = "Server is exiting: it finishes the requests in flight and takes no new ones; retry on another replica"


class ServerExiting(InvalidRequest):
    """A request that arrived while the server drains before it stops (Triton's UNAVAILABLE)."""

    status = 503


class Intake:
    def __init__(self, catalog: Catalog, regions: Regions, clients: Clients, scheduler: Scheduler,
                 ensembles: Ensembles) -> None:
        self.catalog = catalog
        self.regions = regions
        self.clients = clients
        self.scheduler = scheduler
        self.ensembles = ensembles
        self.refusal = ""  # set when the server stops: every new request is refused with it (503)...
        self.exempt_pids: set[int] = set()  # ... but those of our workers (BLS: part of a request in flight)

    def infer(self, client: Client, rec: Record) -> None:
        """Take the request of a checked record (its descriptor in the client's arena). Raises
        Garbage for a descriptor no client writes (the broker then disconnects the client)."""
        slot, off = rec.slot, rec.off
        req, data_start = read_request(client.seg.seg.buf, rec)
        # A request refused here, before it is queued, is counted nowhere: Triton counts a request
        # only once its scheduler queued it (a refusal of the scheduler's is counted nowhere either,
        # a queue timeout REJECTED: scheduler.py).
        try:
            # Draining before a stop: what is in flight finishes, nothing new starts.
            if self.refusal and client.pid not in self.exempt_pids:
                raise ServerExiting(self.refusal)
            mv = self.catalog.find_version(req.model, req.version, inference=True)
            if mv.ensemble is not None and mv.ensemble.decoupled and req.stream is None:
                raise DecoupledOnly()  # before the inputs are looked at, as in Triton
            sig = mv.signature
            assert sig is not None
            batch = sig.check_inputs(req.inputs, req.id)
            outputs = req.outputs
            sig.check_outputs(outputs)
            entry: BatchEntry = {
                "client": client.name, "ticket": client.ticket, "slot": slot, "id": req.id,
                "parameters": req.parameters, "sequence_id": req.sequence_id, "sequence_flags": req.sequence_flags,
                "sent_ns": req.sent_ns,
                "inputs": [self._resolve(client, t, data_start) for t in req.inputs],
                "outputs": [self._resolve_output(client, o, data_start) for o in outputs] if outputs else None,
            }
            if req.timeout_us:
                entry["timeout_us"] = req.timeout_us  # (pb_utils' request.timeout())
            named = req.regions()
            if named:  # held while the broker holds the request: an unregister waits for it
                entry["regions"] = sorted(named)
            if req.stream is not None:
                entry["stream"] = {"seg": client.name, "off": data_start + req.stream}
                if not client.seg.arena_offset <= entry["stream"]["off"] <= client.seg.seg.size - 4096:
                    raise InvalidRequest("the response ring lies outside the client's arena")
            if req.traced:  # its QUEUE_START is now (the worker sends it back)
                entry["trace_queued_ns"] = time.monotonic_ns()
        except InvalidRequest as e:
            self.clients.reply(client, slot, e.status, refusal(str(e)))
            return
        except (ValueError, KeyError, TypeError) as e:
            self.clients.reply(client, slot, 400, refusal(f"malformed inference request: {e!r}"))
            return
        if mv.ensemble is not None:
            self.ensembles.start(mv, client, slot, entry, req.priority)
            return
        now = time.monotonic()
        pend = Pending(client, slot, off, entry, batch, now, priority=req.priority, timeout_us=req.timeout_us)
        self.scheduler.enqueue(mv, pend)

    def _place(self, client: Client, name: str, region: str, offset: int, size: int, what: str,
               data: int, data_start: int) -> LocatedTensor:
        """Where the worker finds (or puts) a tensor's bytes, checked against the bounds it may
        use: a registered region (host shm or CUDA) at ``offset``, or the request's own block in
        the client's arena at ``data`` (inputs the client wrote, or room it reserved for an output)."""
        if region:
            cuda = self.regions.cuda.resolve(region, offset, size)
            if cuda is not None:
                return cuda
            seg, off = self.regions.system.resolve(region, offset, size)
            # read and written by copies (shm/region_io.py)
            return {"seg": seg, "off": off, "size": size, "ino": self.regions.system.inode(region), "region": region}
        off = data_start + data
        if off < client.seg.arena_offset or off + size > client.seg.seg.size:
            raise InvalidRequest(f"{what} '{name}' lies outside the client's arena")
        return {"seg": client.name, "off": off, "size": size}

    def _resolve(self, client: Client, t: InputTensor, data_start: int) -> LocatedTensor:
        return {"name": t.name, "datatype": t.datatype, "shape": t.shape,
                **self._place(client, t.name, t.region, t.offset, t.size, "input", t.data, data_start)}

    def _resolve_output(self, client: Client, o: RequestedOutput, data_start: int) -> LocatedTensor:
        out: LocatedTensor = {"name": o.name}
        if o.region or o.data is not None:
            out.update(self._place(client, o.name, o.region, o.offset, o.size, "output", o.data or 0, data_start))
        if o.classes:
            out["class"] = o.classes  # classification: the worker answers the top classes
        return out
