"""An inference request a client put on its request ring to the broker: checked against the
model's signature and resolved into the entry a worker reads, then handed to the version's
scheduler (or to the ensemble runner).

The entry names where every tensor lives (the client's arena, a registered system region or a
CUDA region) with bounds already checked, so a worker only maps and reads.
"""
from __future__ import annotations

import time

from shmserve.batching import Pending
from shmserve.shm.answer import refusal
from shmserve.shm.untrusted import Record, read_descriptor
from shmserve.signature import InvalidRequest, queue_options

from .catalog import Catalog
from .clients import Clients
from .ensemble import Ensembles
from .ensemble_plan import DecoupledOnly
from .models import Client, ModelVersion
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
        mv: ModelVersion | None = None
        slot, off = rec.slot, rec.off
        doc, data_start = read_descriptor(client.seg.seg.buf, rec)
        try:
            # Draining before a stop: what is in flight finishes, nothing new starts.
            if self.refusal and client.pid not in self.exempt_pids:
                raise ServerExiting(self.refusal)
            mv = self.catalog.find_version(doc["model"], doc.get("version"), inference=True)
            if mv.ensemble is not None and mv.ensemble.decoupled and "stream" not in doc:
                raise DecoupledOnly()  # before the inputs are looked at, as in Triton
            sig = mv.signature
            assert sig is not None
            inputs = doc["inputs"]
            batch = sig.check_inputs(inputs, doc.get("id", ""))
            outputs = doc.get("outputs")
            sig.check_outputs(outputs)
            priority, timeout_us, sent_ns = queue_options(doc)
            entry = {
                "client": client.name, "ticket": client.ticket, "slot": slot, "id": doc.get("id", ""),
                "params": doc.get("params"), "corr": doc.get("corr", 0), "flags": doc.get("flags", 0),
                "t": sent_ns,
                "inputs": [self._resolve(client, t, "input", data_start) for t in inputs],
                "outputs": [self._resolve_output(client, o, data_start) for o in outputs] if outputs else None,
            }
            named = {t["region"] for t in inputs if "region" in t} | {o["region"] for o in outputs or () if "region" in o}
            if named:  # held while the broker holds the request: an unregister waits for it
                entry["regions"] = sorted(named)
            if "stream" in doc:
                entry["stream"] = {"seg": client.name, "off": data_start + int(doc["stream"])}
                if not client.seg.arena_offset <= entry["stream"]["off"] <= client.seg.seg.size - 4096:
                    raise InvalidRequest("the response ring lies outside the client's arena")
            if "tr" in doc:  # a traced request: its QUEUE_START is now (the worker sends it back)
                entry["tr"] = time.monotonic_ns()
        except InvalidRequest as e:
            self._count_rejected(mv)
            self.clients.reply(client, slot, e.status, refusal(str(e)))
            return
        except (ValueError, KeyError, TypeError) as e:
            self._count_rejected(mv)
            self.clients.reply(client, slot, 400, refusal(f"malformed inference request: {e!r}"))
            return
        if mv.ensemble is not None:
            self.ensembles.start(mv, client, slot, entry)
            return
        now = time.monotonic()
        pend = Pending(client, slot, off, entry, batch, now, priority=priority, timeout_us=timeout_us)
        self.scheduler.enqueue(mv, pend)

    @staticmethod
    def _count_rejected(mv: ModelVersion | None) -> None:
        if mv is not None:
            mv.stats.fail("REJECTED", 1)

    def _locate(self, client: Client, t: dict, what: str, data_start: int) -> tuple[str, int, int]:
        """Where a tensor lives: (segment, offset, size), checked against the bounds it may use.

        ``region`` names a registered region; ``data`` is an offset into the request's own block
        in the client's arena (inputs the client wrote, or room it reserved for an output).
        """
        size = int(t["size"])
        if "region" in t:
            seg, off = self.regions.system.resolve(t["region"], int(t.get("offset", 0)), size)
            return seg, off, size
        off = data_start + int(t["data"])
        if size < 0 or off < client.seg.arena_offset or off + size > client.seg.seg.size:
            raise InvalidRequest(f"{what} '{t['name']}' lies outside the client's arena")
        return client.name, off, size

    def _place(self, client: Client, t: dict, what: str, data_start: int) -> dict:
        """Where the worker finds (or puts) a tensor's bytes: host shm, or a CUDA region."""
        if "region" in t:
            cuda = self.regions.cuda.resolve(t["region"], int(t.get("offset", 0)), int(t["size"]))
            if cuda is not None:
                return cuda
        seg, off, size = self._locate(client, t, what, data_start)
        place = {"seg": seg, "off": off, "size": size}
        if "region" in t:  # a registered region: read and written through its descriptor (shm/region_io.py)
            place["ino"] = self.regions.system.inode(t["region"])
            place["region"] = t["region"]
        return place

    def _resolve(self, client: Client, t: dict, what: str, data_start: int) -> dict:
        return {"name": t["name"], "datatype": t["datatype"], "shape": t["shape"],
                **self._place(client, t, what, data_start)}

    def _resolve_output(self, client: Client, o: dict, data_start: int) -> dict:
        out = {"name": o["name"]}
        if "region" in o or "data" in o:
            out.update(self._place(client, o, "output", data_start))
        if "class" in o:
            out["class"] = o["class"]  # classification: the worker answers the top classes
        return out
