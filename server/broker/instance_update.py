"""Live instance changes: a new config of a serving model that differs from the one it serves only
in ``instance_group`` (count, kind, devices), with its files unchanged, adds and removes instances
of the versions that serve instead of loading the model again, as Triton's model update does.

Instances are named as at load (``<group>_<k>``, ``<group>_<k>_gpu<d>``); an instance whose name,
kind and device the new config still asks for keeps running. An added instance serves once it is
ready. A removed one leaves the routes at once, finishes what it holds (its batches, its lanes,
stragglers that read the old routes within ``STRAGGLER_GRACE_S``) and then gets a graceful stop;
no request fails. Sequence batching (a sequence is bound to its instance), ensembles and instance
groups with a ``rate_limiter`` (the limiter sizes its pools at load) load anew.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from shmserve.batching import batches_on_worker
from shmserve.config_view import to_dict

from . import config as cfgmod
from .catalog import Catalog
from .clients import Clients
from .instances import Instances, StartFailed
from .models import Instance, ModelVersion, State
from .load_stamp import written_since
from .repository_scan import folder_state
from .routes import Routes

log = logging.getLogger("shmserve.broker")
Fingerprint = dict[str, tuple[int, int]]
Waiter = tuple[Any, int]  # (client, slot) of a load request to answer
STRAGGLER_GRACE_S = 0.2  # a client that read the old routes just before they changed lands within this


@dataclasses.dataclass(frozen=True)
class PlannedInstance:
    """An instance a config asks for: its name, kind ("CPU" or "GPU") and device."""

    name: str
    kind: str
    device: int


def planned_instances(config: Any) -> list[PlannedInstance]:
    """Every instance of ``config``'s instance groups, in load order."""
    out = []
    for group in config.instance_group:
        kind = "GPU" if group.kind == cfgmod.mc.ModelInstanceGroup.KIND_GPU else "CPU"
        for device in cfgmod.instance_devices(group):
            for k in range(group.count):
                name = f"{group.name}_{k}" if kind == "CPU" else f"{group.name}_{k}_gpu{device}"
                out.append(PlannedInstance(name, kind, device))
    return out


def folder_fingerprint(model_dir: str) -> Fingerprint:
    """Size and modification time of every file of the model but its config: what tells an
    instance change from a new model. Bytecode is left out: the Python backend writes it when it
    imports a version, which changes no model."""
    prints: Fingerprint = {}
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".pyc"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, model_dir)
            if rel == "config.pbtxt":
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            prints[rel] = (st.st_size, st.st_mtime_ns)
    return prints


def without_instances(config: Any) -> Any:
    copy = type(config)()
    copy.CopyFrom(config)
    copy.ClearField("instance_group")
    return copy


def unchanged_since_load(serving: dict[int, ModelVersion], model_dir: Path) -> bool:
    """Whether every version of a non-ensemble model that serves is ready, was loaded from
    ``model_dir``, nothing in that folder was written after its load's stamp (Triton's rule:
    load_stamp.py), and the folder is as it was then (``repository_scan.folder_state``: a file
    replaced by one of the same time, which Triton misses, counts too): a load without a config
    then reloads nothing and the model serves on as it was loaded (with a config override, say)."""
    now = None
    for mv in serving.values():
        if mv.state != State.READY or mv.model_dir != str(model_dir) or mv.ensemble is not None \
                or mv.folder_state is None or written_since(mv.model_dir, mv.load_stamp):
            return False
        now = folder_state(mv.model_dir) if now is None else now
        if mv.folder_state != now:
            return False
    return bool(serving)


def updatable(serving: dict[int, ModelVersion], model_dir: Path, config: Any, versions: list[int]) -> bool:
    """Whether loading ``config`` from ``model_dir`` only changes the instances of what serves."""
    if sorted(serving) != sorted(versions) or config.platform == "ensemble" or config.HasField("sequence_batching") \
            or _rate_limited(config):
        return False
    for mv in serving.values():
        if mv.state != State.READY or mv.model_dir != str(model_dir) or mv.requested_config is None \
                or _rate_limited(mv.requested_config):
            return False
        if without_instances(mv.requested_config) != without_instances(config):
            return False
        if folder_fingerprint(str(model_dir)) != mv.files:
            return False
    return True


def _rate_limited(config: Any) -> bool:
    """Instances with rate_limiter resources load anew: the limiter sizes its pools at load."""
    return any(group.HasField("rate_limiter") for group in config.instance_group)


def instance_changes(mv: ModelVersion, config: Any) -> tuple[list[PlannedInstance], list[Instance]]:
    """(instances to add, instances to remove) for ``mv`` to serve with ``config``'s groups."""
    wanted = planned_instances(config)
    current = {PlannedInstance(i.name, i.kind, i.device_id): i for i in mv.instances if not i.removed}
    add = [p for p in wanted if p not in current]
    keep = set(wanted)
    remove = [inst for plan, inst in current.items() if plan not in keep]
    return add, remove


def with_groups(completed: Any, config: Any) -> Any:
    """The serving (auto-completed) config with ``config``'s instance groups."""
    merged = type(completed)()
    merged.CopyFrom(completed)
    merged.ClearField("instance_group")
    merged.instance_group.extend(config.instance_group)
    return merged


class InstanceUpdates:
    """The live instance changes in progress: added instances loading, removed ones draining, and
    the load requests that wait for them."""

    def __init__(self, catalog: Catalog, instances: Instances, routes: Routes, clients: Clients) -> None:
        self.catalog = catalog
        self.instances = instances
        self.routes = routes
        self.clients = clients
        self.waiters: dict[str, list[Waiter]] = {}
        self.errors: dict[str, str] = {}  # model -> why an added instance failed
        self.folders: dict[str, frozenset | None] = {}  # model -> the folder state its change was read from

    def apply(self, serving: dict[int, ModelVersion], config: Any, waiter: Waiter | None,
              folder: frozenset | None = None, stamp: int | None = None) -> None:
        """Give every serving version ``config``'s instance groups; ``folder``: the state of the
        model's folder the change was read from, theirs once every added instance serves;
        ``stamp``: the load's (load_stamp.py)."""
        now = time.monotonic()
        name = config.name
        for mv in serving.values():
            add, remove = instance_changes(mv, config)
            mv.config = with_groups(mv.config, config)
            mv.set_config(to_dict(mv.config))
            mv.requested_config = config
            mv.load_stamp = stamp
            mv.folder_state = None  # (what it serves matches the folder again only once the change is done)
            mv.planned_instances = cfgmod.instance_count(config)
            # The one instance batches its own lanes only if it was started as the only one.
            mv.worker_batching = mv.worker_batching and batches_on_worker(mv.config_dict, mv.planned_instances)
            for plan in add:
                try:
                    self.instances.spawn(mv, plan.name, len(mv.instances), plan.kind, plan.device).added = True
                except StartFailed as e:  # the others serve on; the load request hears why
                    log.error("model '%s' version %d: %s", name, mv.version, e)
                    self.errors[name] = str(e)
            for inst in remove:
                inst.ready = False  # out of the routes and the scheduler's choice from now on
                inst.removed_since = now
            log.info("model '%s' version %d: instances changed in place (%d added, %d removed)", name, mv.version,
                     len(add), len(remove))
        self.routes.publish()
        if waiter is not None:
            self.waiters.setdefault(name, []).append(waiter)
        self.folders[name] = folder
        self.check(name)

    def busy(self) -> bool:
        """Whether a removed instance still waits for its stop (the broker's timer looks again)."""
        return any(inst.removed for _, inst in self.instances.workers.values())

    def progress(self) -> None:
        """Stop each removed instance once it finished what it holds."""
        now = time.monotonic()
        for _, inst in list(self.instances.workers.values()):
            if inst.removed and now - inst.removed_since >= STRAGGLER_GRACE_S and not inst.outstanding \
                    and inst.lanes_drained() and not inst.death_note:
                inst.death_note = "was removed by a change of the model's instance groups"
                self.instances.stop(inst)

    def ready(self, mv: ModelVersion, inst: Instance) -> None:
        inst.added = False
        self.check(mv.name)

    def failed(self, mv: ModelVersion, inst: Instance, reason: str) -> None:
        """An added instance did not load: the others serve on; the load request hears why."""
        log.error("model '%s' version %d: added instance '%s' failed: %s", mv.name, mv.version, inst.name, reason)
        self.errors[mv.name] = reason
        inst.added = False
        inst.removed_since = time.monotonic()
        self.instances.stop(inst, graceful=False)
        self.check(mv.name)

    def gone(self, mv: ModelVersion, inst: Instance, code: int) -> None:
        """A removed (or failed added) instance exited: it is no longer part of its version."""
        if inst.added:
            self.failed(mv, inst, f"instance '{inst.name}' exited with code {code} while loading")
        if inst in mv.instances:
            mv.instances.remove(inst)
        log.info("model '%s' version %d: instance '%s' removed", mv.name, mv.version, inst.name)
        self.routes.publish()

    def check(self, name: str) -> None:
        """Answer the load requests of ``name`` once no added instance is still loading."""
        versions = self.catalog.models.get(name, {}).values()
        if any(inst.added for mv in versions for inst in mv.instances):
            return
        error = self.errors.pop(name, None)
        folder = self.folders.pop(name, None)
        if folder is not None and not error:  # (a failed change leaves it unknown: a load tries again)
            for mv in versions:
                mv.folder_state = folder
        for client, slot in self.waiters.pop(name, []):
            self.clients.reply(client, slot, 400 if error else 200, {"error": error} if error else {})

    def abandon(self, name: str, status: int, why: str) -> None:
        """The versions being changed stopped serving (an unload, a new load): say so."""
        self.errors.pop(name, None)
        self.folders.pop(name, None)
        for client, slot in self.waiters.pop(name, []):
            self.clients.reply(client, slot, status, {"error": why})
