"""Who still uses a region that was unregistered: what the broker's ``Regions.settle`` needs to
know before it forgets one (see ``shm/region_table.py`` for the whole scheme).

Requests that pass the broker carry the names of their regions in their entry (``regions``,
set by ``Intake``) for as long as the broker holds them: queued, sent to an instance until it
reports the batch done, or run as an ensemble. Requests on workers' lanes are summed up by each
worker in its segment (``workers/region_holds.py``).
"""
from __future__ import annotations

from typing import Iterable

from shmserve.shm.waker import fence
from shmserve.shm.region_table import read_holds

from .ensemble import Ensembles
from .instances import Instances
from .models import ModelVersion


def regions_in_use(versions: Iterable[ModelVersion], ensembles: Ensembles) -> set[str]:
    """The regions named by the requests the broker holds."""
    names: set[str] = set()
    for mv in versions:
        for p in mv.queued():
            names.update(p.entry.get("regions", ()))
        for inst in mv.instances:
            for batch in inst.outstanding.values():
                for p in batch:
                    names.update(p.entry.get("regions", ()))
    for run in ensembles.live_runs():
        names.update(run.entry.get("regions", ()))
    return names


def lane_holds(instances: Instances) -> list[dict[str, int]]:
    """What each worker published: region name -> the oldest table generation its unfinished
    lane requests naming it started under. The fence orders the caller's earlier publication
    of the table before these reads (a worker publishes its holds, fences, then reads the table)."""
    fence()
    return [read_holds(inst.seg.region_holds) for _, inst in instances.workers.values()]
