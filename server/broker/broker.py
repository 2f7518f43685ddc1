"""The broker: the single owner of server state, running one loop on one doorbell semaphore.

Everything that must change state arrives as a record on a ring in shared memory (client requests,
worker messages, connects) followed by a post on the doorbell; the loop drains the rings, acts,
and sleeps again until the next post or its nearest timer. No threads touch state, no asyncio.
"""
from __future__ import annotations

import collections
import random
import shutil
import tempfile
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import posix_ipc

from shmserve.shm.arena import free_block
from shmserve.shm.stats import BUSY_SINCE, VersionTotals
from shmserve.shm.channel import LANES, NO_LANE, NOTIFY_BROKER, BrokerSegment, ClientSegment, WorkerSegment
from shmserve.shm.names import object_name, pid_alive
from shmserve.shm.segment import SegmentCache, StaleRegion
from shmserve.shm.protocol import (NO_ROOM, REQ_BYE, REQ_CONTROL, REQ_INFER, ROLE_BROKER, SLOT_DONE, SLOT_FREE, SLOT_PENDING, W_BATCH, W_CONFIG,
                          W_DONE, W_LOAD_FAILED, W_READY, W_STOP, manifest_room, read_manifest, read_manifest_with_data,
                          write_manifest)
from shmserve.workers.backend import BUILT_IN, installed_backends

from . import config as cfgmod
from .batcher import DynamicBatcher, QueueFull, batches_on_worker
from .canary import SNAPSHOT_EVERY_S, Canary, CanaryPolicy, Split
from .config import execution_timeout
from .sequencer import SequenceBatcher
from .watcher import RepositoryWatcher
from .control import UPLOAD_PREFIX, ControlHandler
from .ensemble import EnsemblePlan, EnsembleRun, Step
from .lifecycle import STRAGGLER_GRACE_S, LoadJob, Retiring, idle
from .metrics import MetricsOptions, serve_metrics
from .models import Client, Instance, ModelVersion, Pending, State
from .options import STARTUP_FAILED, BrokerOptions
from shmserve.workers.signature import InvalidRequest, UnknownModel, VersionNotReady, queue_options

log = logging.getLogger("shmserve.broker")

HOUSEKEEPING_S = 1.0  # client liveness, restart back-off; a worker's death wakes us at once (SIGCHLD)
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
GONE_MEMORY_S = 60.0  # how long requests that land on an exited worker's lane are still answered
HUNG_CHECK_S = 0.1  # how often executions are checked against execution_timeout_s
# OpenMP threads of a model (torch, numpy's BLAS) sleep when idle instead of spinning: a worker
# shares the cores with the frontends, the broker and other workers, and a spinning pool burns
# the CPU they need between small batches. An environment that sets it wins.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


class Broker:
    def __init__(self, opts: BrokerOptions) -> None:
        self.opts = opts
        self.sid = opts.server_id
        self.seg = BrokerSegment.create(self.sid, opts.broker_arena_bytes)
        self.arena = self.seg.arena
        assert self.arena is not None
        self.clients: dict[str, Client] = {}
        self.models: dict[str, dict[int, ModelVersion]] = {}  # what serves
        self.loading: dict[str, LoadJob] = {}  # new versions getting ready beside what serves
        self.retiring: list[Retiring] = []  # old versions draining before their workers stop
        self.load_errors: dict[str, str] = {}
        # The versions a failed load tried (unknown when its config failed first): the index
        # lists them, as Triton does, and a version outside them is "not found".
        self.failed_versions: dict[str, list[int]] = {}
        self.model_dirs: dict[str, Path] = {}
        self.workers: dict[int, tuple[ModelVersion, Instance]] = {}
        self.next_worker = 0
        self.next_batch = 1
        self.running = True
        self.startup_done = False
        self.startup_failed = False
        self.backends = set(installed_backends()) | set(BUILT_IN)
        self.control = ControlHandler(self)
        self._last_housekeeping = 0.0
        self._last_watch = 0.0  # canaries and execution timeouts were last looked at
        self.child_exited = False
        self.restarts: list[tuple[float, ModelVersion, Instance]] = []
        self.watcher: RepositoryWatcher | None = None
        self.lanes: list[str | None] = [None] * LANES
        self.next_cookie = 0
        self.routes_doc = b""
        self.load_failures: dict[str, int] = collections.defaultdict(int)  # model -> failed loads
        self.canaries: dict[str, Canary] = {}
        self.gone: dict[int, tuple[float, ModelVersion, int, str]] = {}  # exited worker -> when, version, answer
        self.metrics = serve_metrics(
            MetricsOptions(port=opts.metrics_port, interval_ms=opts.metrics_interval_ms,
                           summary_latencies=opts.metrics_config.get("summary_latencies") == "true",
                           cpu=opts.cpu_metrics, gpu=opts.gpu_metrics),
            self._stats_rows, self._metric_extras, self._custom_metric_docs)
        # The broker's own client segment: ensemble steps are requests it makes to step models.
        own = object_name(self.sid, "client", "broker")
        self.own = Client(name=own, pid=os.getpid(),
                          seg=ClientSegment.create(own, 1 << 20, slots=4096, notify=NOTIFY_BROKER))
        self.clients[own] = self.own
        self.own_free = collections.deque(range(4096))
        self.own_inflight: dict[int, tuple[EnsembleRun, Step]] = {}
        self.segments = SegmentCache()

    # -- repository -----------------------------------------------------------------------------
    def scan_repositories(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for repo in self.opts.repositories:
            for entry in sorted(os.scandir(repo), key=lambda e: e.name):
                if entry.is_dir() and not entry.name.startswith("."):
                    if entry.name in found:
                        log.error("model '%s' appears in more than one repository; using %s",
                                  entry.name, found[entry.name])
                        continue
                    found[entry.name] = Path(entry.path)
        return found

    def initial_models(self) -> list[str]:
        self.model_dirs = self.scan_repositories()
        if self.opts.control_mode == "explicit":
            wanted = self.opts.load_models
            if "*" in wanted:
                return list(self.model_dirs)
            return list(dict.fromkeys(wanted))
        return list(self.model_dirs)

    def load_model(self, name: str, override_json: str | None = None, waiter: tuple[Any, int] | None = None,
                   model_dir: Path | None = None) -> str | None:
        """Start loading every version of ``name`` the policy selects beside what serves now;
        returns an error at once, or None (the swap happens when all are ready)."""
        if name in self.loading:  # a load in progress: answer with it
            if waiter is not None:
                self.loading[name].waiters.append(waiter)
            return None
        model_dir = model_dir or self.model_dirs.get(name)
        if model_dir is None:
            self.model_dirs = self.scan_repositories()
            model_dir = self.model_dirs.get(name)
        if model_dir is None:
            # A name no repository holds (a typo, a model not there yet): Triton's text, but no
            # trace. Recorded, it would enter the index, turn strict readiness off for the whole
            # server and give the failure metric a label per name a client makes up.
            reason = f"failed to load '{name}', failed to poll from model repository"
            log.error("%s", reason)
            return reason
        try:
            config = cfgmod.load_config(model_dir, self.opts.strict_config, override_json)
            available = cfgmod.version_dirs(model_dir)
            versions = cfgmod.select_versions(config, available)
            if not versions:
                raise cfgmod.ConfigError(f"model '{name}': no version folder to load (found {available})")
            cfgmod.validate(config, model_dir, self.backends, versions)
            try:
                parameters = cfgmod.string_parameters(config)
                canary_policy = CanaryPolicy.from_parameters(parameters)
                exec_timeout_s = execution_timeout(parameters)
            except ValueError as e:
                raise cfgmod.ConfigError(f"model '{name}': parameters: {e}") from None
        except cfgmod.ConfigError as e:
            return self._load_failed(name, f"failed to load '{name}', {e}")
        job = self.loading[name] = LoadJob(name, {}, [waiter] if waiter is not None else [], canary_policy)
        versions_state = job.versions
        for v in versions:
            mv = ModelVersion(name=name, version=v, model_dir=str(model_dir), config=config,
                              config_dict=cfgmod.to_dict(config), backend=cfgmod.backend_of(config))
            mv.set_config(mv.config_dict)
            mv.exec_timeout_s = exec_timeout_s
            if config.platform == "ensemble":
                mv.ensemble = EnsemblePlan(config)
                mv.state = State.READY
                log.info("successfully loaded '%s' version %d (ensemble of %s)", name, v,
                         ", ".join(mv.ensemble.dependencies()))
                versions_state[v] = mv
                for dep in mv.ensemble.dependencies():  # as Triton: an ensemble brings its steps
                    if dep not in self.models and dep not in self.load_errors and dep not in self.loading:
                        self.load_model(dep)
                continue
            if config.HasField("sequence_batching"):
                mv.sequencer = SequenceBatcher(config)
                mv.pipeline_depth = 1
            elif config.HasField("dynamic_batching"):
                mv.batcher = DynamicBatcher(mv.config_dict)
                mv.pipeline_depth = 1  # let requests gather while the instance is busy
            mv.planned_instances = cfgmod.instance_count(config)
            mv.worker_batching = batches_on_worker(mv.config_dict, mv.planned_instances)
            versions_state[v] = mv
            for group in config.instance_group:
                kind = "GPU" if group.kind == cfgmod.mc.ModelInstanceGroup.KIND_GPU else "CPU"
                for device in cfgmod.instance_devices(group):
                    for k in range(group.count):
                        name_k = f"{group.name}_{k}" if kind == "CPU" else f"{group.name}_{k}_gpu{device}"
                        self._spawn(mv, name_k, len(mv.instances), kind, device)
            log.info("loading '%s' version %d: %d instance(s), backend %s", name, v, len(mv.instances),
                     mv.backend)
        self._resolve_loads()
        return None

    def _resolve_loads(self) -> None:
        """Swap in every load whose versions are all READY; abandon those where one failed."""
        for name, job in list(self.loading.items()):
            bad = job.failed()
            if bad is not None:
                del self.loading[name]
                for mv in job.versions.values():
                    for inst in mv.instances:
                        self._stop_instance(inst, graceful=False)
                    mv.state = State.UNLOADING  # its workers are reaped, never restarted
                    self.retiring.append(Retiring(mv, stopping=True))
                self.load_errors[name] = bad.reason
                self.failed_versions[name] = sorted(job.versions)
                self.load_failures[name] += 1
                for client, slot in job.waiters:
                    self.reply(client, slot, 400, {"error": bad.reason})
                continue
            if not job.ready():
                continue
            del self.loading[name]
            self.load_errors.pop(name, None)
            self.failed_versions.pop(name, None)
            old = self.models.get(name, {})
            self.models[name] = dict(job.versions)
            canary = self.canaries.setdefault(name, Canary(name))
            canary.configured = job.canary_policy
            for v in job.versions:
                canary.forget_version(v)
            for v, mv in old.items():
                self._retire(mv)
            self.publish_routes()
            for client, slot in job.waiters:
                self.reply(client, slot, 200, {})

    def _retire(self, mv: ModelVersion, waiter: tuple[Any, int] | None = None) -> None:
        mv.state = State.UNLOADING
        entry = Retiring(mv)
        if waiter is not None:
            entry.waiters.append(waiter)
        self.retiring.append(entry)
        log.info("unloading '%s' version %d: draining", mv.name, mv.version)

    def unload_model(self, name: str, waiter: tuple[Any, int] | None = None, dependents: bool = False) -> None:
        versions = self.models.pop(name, {})
        self.canaries.pop(name, None)
        self.load_errors.pop(name, None)
        self.failed_versions.pop(name, None)
        for mv in versions.values():
            if dependents and mv.ensemble is not None:
                for dep in mv.ensemble.dependencies():
                    if dep in self.models:
                        self.unload_model(dep)
            self._retire(mv)
        if versions:
            self.retiring[-1].waiters.extend([waiter] if waiter is not None else [])
        elif waiter is not None:
            self.reply(waiter[0], waiter[1], 200, {})
        self.publish_routes()

    def _apply_repository_changes(self) -> None:
        """Poll mode: reload models whose folders changed, load new ones, unload removed ones."""
        assert self.watcher is not None
        names = self.watcher.due()
        if not names:
            return
        self.model_dirs = self.scan_repositories()
        for name in names:
            if name in self.model_dirs:
                log.info("repository change: (re)loading '%s'", name)
                self.load_model(name)
            elif name in self.models or name in self.load_errors:
                log.info("repository change: '%s' was removed; unloading it", name)
                self.unload_model(name)

    def _progress_retirement(self) -> None:
        """Stop retired versions' workers once drained (or the exit timeout ran out); forget them
        once their workers are gone."""
        now = time.monotonic()
        for entry in list(self.retiring):
            mv = entry.version
            if not entry.stopping:
                overdue = now - entry.since > self.opts.exit_timeout_s
                if overdue or (now - entry.since >= STRAGGLER_GRACE_S and idle(mv)):
                    if overdue and mv.in_flight():
                        self._fail_pending(mv.queued(), 503, f"model '{mv.name}' version {mv.version} was "
                                                             f"unloaded before the request ran")
                    entry.stopping = True
                    for inst in mv.instances:
                        self._stop_instance(inst, graceful=not overdue)
            if entry.stopping and all(inst.num not in self.workers for inst in mv.instances):
                self.retiring.remove(entry)
                log.info("unloaded '%s' version %d", mv.name, mv.version)
                self._discard_model_dir(mv.model_dir)
                for client, slot in entry.waiters:
                    if client.name in self.clients:
                        self.reply(client, slot, 200, {})

    def _discard_model_dir(self, model_dir: str) -> None:
        """Remove the private folder of a model loaded from 'file:' parameters once no version
        loaded, loading or draining uses it (repository folders are never touched)."""
        folder = Path(model_dir).parent
        if not folder.name.startswith(UPLOAD_PREFIX) or folder.parent != Path(tempfile.gettempdir()):
            return
        users = [mv for vs in self.models.values() for mv in vs.values()]
        users += [mv for job in self.loading.values() for mv in job.versions.values()]
        users += [r.version for r in self.retiring]
        if not any(Path(mv.model_dir).parent == folder for mv in users):
            shutil.rmtree(folder, ignore_errors=True)

    def _load_failed(self, name: str, reason: str) -> str:
        log.error("%s", reason)
        self.load_failures[name] += 1
        self.load_errors[name] = reason
        self.failed_versions.pop(name, None)
        return reason

    # -- workers --------------------------------------------------------------------------------
    def _spawn(self, mv: ModelVersion, name: str, index: int, kind: str, device: int,
               replace: Instance | None = None) -> Instance:
        num = self.next_worker
        self.next_worker += 1
        seg = WorkerSegment.create(object_name(self.sid, "worker", num), self.opts.worker_arena_bytes)
        spec = {
            "server_id": self.sid, "num": num, "model": mv.name, "version": mv.version,
            "instance_name": name, "instance_index": index, "kind": kind, "device_id": device,
            "model_dir": mv.model_dir, "config": mv.config_dict, "backend": mv.backend,
            "strict": self.opts.strict_config, "broker_pid": os.getpid(), "log": self.control.log_settings,
            "instances": mv.planned_instances, "poll_us": self.opts.poll_us,
        }
        proc = subprocess.Popen([sys.executable, "-m", "shmserve.workers", orjson.dumps(spec).decode()],
                                stdin=subprocess.DEVNULL, env=WORKER_ENV)
        inst = Instance(num=num, name=name, index=index, kind=kind, device_id=device, seg=seg, proc=proc)
        if replace is not None:
            inst.restarts = replace.restarts + 1
            mv.instances[mv.instances.index(replace)] = inst
        else:
            mv.instances.append(inst)
        self.workers[num] = (mv, inst)
        return inst

    def _stop_instance(self, inst: Instance, graceful: bool = True) -> None:
        if inst.proc.poll() is None:
            if graceful and inst.seg.inbox.put(W_STOP, 0, 0, 0, 0):
                inst.seg.waker.post()
            else:
                inst.proc.kill()

    def _reap_instance(self, inst: Instance, mv: ModelVersion | None = None) -> None:
        if mv is not None:
            mv.stats.add_area(inst.seg.stats)  # a dead worker's counts stay in the totals
        self.workers.pop(inst.num, None)
        inst.seg.close()
        inst.seg.unlink()

    def _on_worker_messages(self, mv: ModelVersion, inst: Instance) -> None:
        for kind, status, off, length, batch_id in inst.seg.outbox.drain():
            if kind == W_DONE:
                inst.outstanding.pop(batch_id, None)
            elif kind == W_READY:
                inst.ready = True
                if mv.state == State.LOADING and all(i.ready for i in mv.instances):
                    mv.state = State.READY
                    mv.load_seconds = time.monotonic() - mv.created
                    log.info("successfully loaded '%s' version %d (%.2f s)", mv.name, mv.version, mv.load_seconds)
                self.publish_routes()
            elif kind == W_CONFIG:
                self._on_completed_config(mv, self._take_payload(inst, off, length))
            elif kind == W_LOAD_FAILED:
                reason = self._take_payload(inst, off, length).decode(errors="replace")
                self._fail_version(mv, f"failed to load '{mv.name}' version {mv.version}: {reason}")
        if self.loading:
            self._resolve_loads()
        if not self.startup_done:
            self._check_startup()

    @staticmethod
    def _take_payload(inst: Instance, off: int, length: int) -> bytes:
        """Copy a worker's message out of its arena and free the block (a held block stalls the arena)."""
        data = bytes(inst.seg.seg.buf[off:off + length])
        if length:
            free_block(inst.seg.seg.buf, off)
        return data

    def _on_completed_config(self, mv: ModelVersion, data: bytes) -> None:
        if mv.config_confirmed:
            return
        mv.config_confirmed = True
        try:
            completed = cfgmod.from_dict(orjson.loads(data))
            cfgmod.complete_defaults(completed)
            cfgmod.validate(completed, Path(mv.model_dir), self.backends, [mv.version])
        except (cfgmod.ConfigError, ValueError) as e:
            self._fail_version(mv, f"failed to load '{mv.name}', auto-completed config is invalid: {e}")
            return
        mv.config = completed
        mv.set_config(cfgmod.to_dict(completed))
        if completed.HasField("dynamic_batching") and mv.batcher is None and mv.sequencer is None:
            # model.py's auto_complete_config asked for the dynamic batcher (set_dynamic_batching)
            mv.batcher = DynamicBatcher(mv.config_dict)
            mv.pipeline_depth = 1
        mv.worker_batching = batches_on_worker(mv.config_dict, mv.planned_instances)

    def _fail_version(self, mv: ModelVersion, reason: str) -> None:
        if mv.state == State.UNAVAILABLE:
            return
        log.error("%s", reason)
        mv.state = State.UNAVAILABLE
        mv.reason = reason
        self.load_errors[mv.name] = reason
        self.publish_routes()
        for inst in mv.instances:
            self._stop_instance(inst, graceful=False)
        self._fail_pending(mv.queued(), 400, f"Request for unknown model: '{mv.name}' is not ready")
        mv.queue.clear()
        if mv.batcher is not None:
            mv.batcher = DynamicBatcher(mv.config_dict)
        if mv.sequencer is not None:
            mv.sequencer = SequenceBatcher(mv.config)

    # -- clients --------------------------------------------------------------------------------
    def _on_connects(self) -> None:
        for pid, raw in self.seg.connect.drain():
            name = raw.rstrip(b"\0").decode()
            try:
                seg = ClientSegment.attach(name)
            except (posix_ipc.ExistentialError, ConnectionError) as e:
                log.warning("client %d could not be attached: %s", pid, e)
                continue
            client = Client(name=name, pid=pid, seg=seg)
            self.clients[name] = client
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

    def _drop_client(self, client: Client, died: bool) -> None:
        """Forget a client that said goodbye, or that ``died`` (then its objects are unlinked here)."""
        self.clients.pop(client.name, None)
        if client.lane is not None and self.lanes[client.lane] == client.name:
            self.lanes[client.lane] = None
            self.seg.set_lane_client(client.lane, "", 0)
        for versions in self.models.values():
            for mv in versions.values():
                if mv.queue:
                    mv.queue = type(mv.queue)(p for p in mv.queue if p.client is not client)
                for sched in (mv.batcher, mv.sequencer):
                    if sched is not None:
                        sched.drop_client(client)
        self.control.forget_client(client, died)
        client.seg.close()
        if died:
            client.seg.unlink()
        self.seg.departures[0] += 1
        for _, inst in self.workers.values():  # let them unmap the client's segment now
            inst.seg.waker.notify()
        log.debug("client %s disconnected", client.name)

    def _on_client_requests(self, client: Client) -> None:
        for kind, slot, off, length, _ in client.seg.requests.drain():
            if kind == REQ_INFER:
                self._infer(client, slot, off)
            elif kind == REQ_CONTROL:
                self._control(client, slot, off)
            elif kind == REQ_BYE:
                self._drop_client(client, died=False)
                return

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

    def _control(self, client: Client, slot: int, off: int) -> None:
        try:
            doc = read_manifest(client.seg.seg.buf, off)
            status, answer = self.control.handle(client, slot, doc)
        except InvalidRequest as e:
            status, answer = e.status, {"error": str(e)}
        except (ValueError, KeyError, TypeError) as e:
            status, answer = 400, {"error": f"malformed control request: {e}"}
        except Exception as e:  # noqa: BLE001 - a bug in one control operation must not take the broker down
            log.exception("control request failed")
            status, answer = 500, {"error": f"internal error in the control request: {e!r}"}
        if status:  # 0: the handler answers later (e.g. a load in progress)
            self.reply(client, slot, status, answer)

    # -- inference ------------------------------------------------------------------------------
    def find_version(self, model: str, version: str | int | None) -> ModelVersion:
        versions = self.models.get(model)
        latest = version in (None, "", -1, "-1")
        v = 0
        if not latest:
            try:
                v = int(version)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise UnknownModel(f"Request for unknown model: '{model}' version '{version}' is not a "
                                   f"valid version") from None
        # Triton's texts and statuses: a model whose load failed has "no available versions"
        # (404), and a version that exists but does not serve "is not at ready state" (503).
        if not versions:
            if model not in self.load_errors:
                raise UnknownModel(f"Request for unknown model: '{model}' is not found")
            if latest:
                raise UnknownModel(f"Request for unknown model: '{model}' has no available versions")
            if model in self.failed_versions and v not in self.failed_versions[model]:
                raise UnknownModel(f"Request for unknown model: '{model}' version {v} is not found")
            raise VersionNotReady(f"Request for unknown model: '{model}' version {v} is not at ready state")
        if not latest:
            mv = versions.get(v)
            if mv is None:
                raise UnknownModel(f"Request for unknown model: '{model}' version {v} is not found")
            if mv.state != State.READY:
                raise VersionNotReady(f"Request for unknown model: '{model}' version {v} is not at ready state")
            return mv
        split = self.split(model)
        if split is None:
            raise UnknownModel(f"Request for unknown model: '{model}' has no available versions")
        if split.canary is not None and random.random() < split.fraction:
            return versions[split.canary]
        return versions[split.stable]

    def split(self, model: str) -> Split | None:
        """Where unversioned requests for ``model`` go: the newest ready version, or a canary split."""
        versions = self.models.get(model, {})
        ready = [v for v, mv in versions.items() if mv.state == State.READY]
        canary = self.canaries.get(model)
        if canary is None:
            return Split(stable=max(ready)) if ready else None
        return canary.split(ready)

    def _infer(self, client: Client, slot: int, off: int) -> None:
        mv: ModelVersion | None = None
        try:
            doc, data_start = read_manifest_with_data(client.seg.seg.buf, off)
            mv = self.find_version(doc["model"], doc.get("version"))
            sig = mv.signature
            assert sig is not None
            inputs = doc["inputs"]
            batch = sig.check_inputs(inputs, doc.get("id", ""))
            outputs = doc.get("outputs")
            sig.check_outputs(outputs)
            priority, timeout_us, sent_ns = queue_options(doc)
            entry = {
                "client": client.name, "pid": client.pid, "slot": slot, "id": doc.get("id", ""),
                "params": doc.get("params"), "corr": doc.get("corr", 0), "flags": doc.get("flags", 0),
                "t": sent_ns,
                "inputs": [self._resolve(client, t, "input", data_start) for t in inputs],
                "outputs": [self._resolve_output(client, o, data_start) for o in outputs] if outputs else None,
            }
            if "stream" in doc:
                entry["stream"] = {"seg": client.name, "off": data_start + int(doc["stream"])}
            if "tr" in doc:  # a traced request: its QUEUE_START is now (the worker sends it back)
                entry["tr"] = time.monotonic_ns()
        except InvalidRequest as e:
            self._count_rejected(mv)
            self.reply(client, slot, e.status, {"error": str(e)})
            return
        except (ValueError, KeyError, TypeError) as e:
            self._count_rejected(mv)
            self.reply(client, slot, 400, {"error": f"malformed inference request: {e!r}"})
            return
        if mv.ensemble is not None:
            self._start_ensemble(mv, client, slot, entry)
            return
        now = time.monotonic()
        pend = Pending(client, slot, off, entry, batch, now, priority=priority, timeout_us=timeout_us)
        self._enqueue(mv, pend)

    def _enqueue(self, mv: ModelVersion, pend: Pending) -> None:
        """Queue a request for its version's scheduler, or answer why it cannot be queued."""
        client, slot, now = pend.client, pend.slot, pend.arrived
        if mv.sequencer is not None:
            try:
                mv.sequencer.enqueue(pend, mv.instances, now)
            except InvalidRequest as e:
                mv.stats.fail("REJECTED", 1)
                self.reply(client, slot, e.status, {"error": str(e)})
                return
        elif mv.batcher is not None:
            try:
                mv.batcher.enqueue(pend, now)
            except QueueFull as e:
                mv.stats.fail("REJECTED", 1)
                self.reply(client, slot, e.status, {"error": str(e)})
                return
        else:
            mv.queue.append(pend)
        self._dispatch(mv)

    @staticmethod
    def _count_rejected(mv: ModelVersion | None) -> None:
        if mv is not None:
            mv.stats.fail("REJECTED", 1)

    def _stats_rows(self) -> list[tuple[str, int, VersionTotals]]:
        """Per version: what the broker counted itself plus every live worker's statistics."""
        rows = []
        for name, versions in list(self.models.items()):
            for v, mv in list(versions.items()):
                total = self._version_totals(mv)
                # Requests clients put on direct lanes and the worker has not finished (waiting on
                # a lane or executing), as in_flight() counts the broker's own.
                lanes = sum(max(0, int(i.seg.lane_tails.sum()) - i.seg.stats.get("direct_done"))
                            for i in list(mv.instances) if i.num in self.workers)
                total.pending = mv.in_flight() + lanes
                rows.append((name, v, total))
        return rows

    def _version_totals(self, mv: ModelVersion) -> VersionTotals:
        """What the broker counted itself for ``mv`` plus every live worker's statistics."""
        total = mv.stats.copy()
        for inst in list(mv.instances):
            if inst.num in self.workers:
                total.add_area(inst.seg.stats)
        return total

    def _metric_extras(self) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """shmserve's own gauges and counters beside the per-version statistics."""
        arenas: list[tuple[dict[str, str], float]] = [({"owner": "broker"}, self.arena.bytes_in_use)]
        loads, regions = [], self.control.regions.regions
        for name, versions in list(self.models.items()):
            for v, mv in list(versions.items()):
                labels = {"model": name, "version": str(v)}
                loads.append((labels, mv.load_seconds))
                used = sum(int(i.seg.stats.get("arena_bytes")) for i in mv.instances if i.num in self.workers)
                arenas.append(({"owner": "worker", **labels}, used))
        return [
            ("shmserve_arena_bytes_in_use", "Bytes allocated in shared-memory arenas (broker; workers' output "
             "arenas per version)", "gauge", arenas),
            ("shmserve_registered_regions", "System shared-memory regions registered by clients", "gauge",
             [({}, len(regions))]),
            ("shmserve_registered_region_bytes", "Bytes of the registered system shared-memory regions", "gauge",
             [({}, sum(r.byte_size for r in list(regions.values())))]),
            ("shmserve_model_load_duration_seconds", "Seconds from the start of a version's load until it was "
             "ready", "gauge", loads),
            ("shmserve_model_load_failures", "Loads of a model that failed", "counter",
             [({"model": m}, n) for m, n in list(self.load_failures.items())]),
            ("shmserve_canary_decisions", "Canary promotions and rollbacks, by trigger (manual, error_rate, "
             "p99_latency)", "counter",
             [({"model": c.model, "version": str(v), "action": action, "trigger": trigger}, n)
              for c in list(self.canaries.values()) for (v, action, trigger), n in list(c.counts.items())]),
            ("shmserve_canary_traffic_fraction", "Share of a model's unversioned requests each version is sent",
             "gauge", self._split_samples()),
        ]

    def _custom_metric_docs(self) -> list[bytes]:
        """Every live worker's published custom metrics (scrape thread: a worker may go meanwhile)."""
        docs = []
        for _, inst in list(self.workers.values()):
            try:
                docs.append(inst.seg.custom_metrics.read(attempts=1000)[1])
            except (ValueError, TypeError):  # its segment was closed under us
                continue
        return docs

    def _split_samples(self) -> list[tuple[dict[str, str], float]]:
        out = []
        for name in list(self.models):
            split = self.split(name)
            if split is None:
                continue
            if split.canary is None:
                out.append(({"model": name, "version": str(split.stable)}, 1.0))
            else:
                out.append(({"model": name, "version": str(split.stable)}, 1.0 - split.fraction))
                out.append(({"model": name, "version": str(split.canary)}, split.fraction))
        return out

    def _locate(self, client: Client, t: dict, what: str, data_start: int) -> tuple[str, int, int]:
        """Where a tensor lives: (segment, offset, size), checked against the bounds it may use.

        ``region`` names a registered region; ``data`` is an offset into the request's own block
        in the client's arena (inputs the client wrote, or room it reserved for an output).
        """
        size = int(t["size"])
        if "region" in t:
            seg, off = self.control.regions.resolve(t["region"], int(t.get("offset", 0)), size, what, t["name"])
            return seg, off, size
        off = data_start + int(t["data"])
        if size < 0 or off < client.seg.arena_offset or off + size > client.seg.seg.size:
            raise InvalidRequest(f"{what} '{t['name']}' lies outside the client's arena")
        return client.name, off, size

    def _place(self, client: Client, t: dict, what: str, data_start: int) -> dict:
        """Where the worker finds (or puts) a tensor's bytes: host shm, or a CUDA region."""
        if "region" in t:
            cuda = self.control.cuda_regions.resolve(t["region"], int(t.get("offset", 0)), int(t["size"]),
                                                     what, t["name"])
            if cuda is not None:
                return cuda
        seg, off, size = self._locate(client, t, what, data_start)
        place = {"seg": seg, "off": off, "size": size}
        if "region" in t:
            place["ino"] = self.control.regions.inode(t["region"])
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

    def _dispatch(self, mv: ModelVersion) -> None:
        if mv.sequencer is not None:
            self._dispatch_sequences(mv)
            return
        if mv.batcher is not None:
            self._dispatch_batches(mv)
            return
        while mv.queue:
            inst = mv.pick_instance()
            if inst is None:
                # Ask the busy instances to ring us when they finish; has_work() re-reads their
                # outboxes after the fence in sleep(), so a finish that raced this is not missed.
                self._want_wakeup(mv)
                return
            pend = mv.queue.popleft()
            self._send_batch(mv, inst, [pend])

    def _dispatch_batches(self, mv: ModelVersion) -> None:
        batcher = mv.batcher
        now = time.monotonic()
        expired = batcher.expire(now)
        if expired:
            mv.stats.fail("OTHER", len(expired))
            self._fail_pending(expired, 503, "Request timeout expired")
        while len(batcher):
            inst = mv.pick_instance()
            if inst is None:
                self._want_wakeup(mv)
                return
            batch = batcher.next_batch(now)
            if batch is None:
                return  # the loop's timer brings us back when the delay ends
            self._send_batch(mv, inst, batch)

    def _dispatch_sequences(self, mv: ModelVersion) -> None:
        seq = mv.sequencer
        seq.expire(time.monotonic())
        waiting = False
        for inst in mv.instances:
            if not inst.ready:
                continue
            if len(inst.outstanding) >= mv.pipeline_depth:
                waiting = True
                continue
            batch = seq.next_batch(inst, mv.instances)
            releases = seq.take_releases(inst)
            if batch or releases:
                self._send_batch(mv, inst, batch or [], {"release": releases} if releases else None)
        if waiting and len(seq):
            self._want_wakeup(mv)

    def _want_wakeup(self, mv: ModelVersion) -> None:
        """Ask mv's live instances to ring when they finish (a dead one's segment is unmapped)."""
        for i in mv.instances:
            if i.num in self.workers:
                i.seg.want_wakeup = True

    def _next_timer(self) -> float:
        """How long the loop may sleep: until housekeeping, a restart, or a batcher's delay or timeout."""
        timeout = HOUSEKEEPING_S if not self.retiring else 0.05
        if any(c.policy.fraction > 0 for c in self.canaries.values()):
            timeout = min(timeout, SNAPSHOT_EVERY_S)
        if any(mv.exec_timeout_s for mv, _ in self.workers.values()):
            timeout = min(timeout, HUNG_CHECK_S)
        now = time.monotonic()
        for when, _, _ in self.restarts:
            timeout = min(timeout, max(0.0, when - now))
        if self.watcher is not None:
            due = self.watcher.next_due()
            if due is not None:
                timeout = min(timeout, due)
        for versions in self.models.values():
            for mv in versions.values():
                for sched in (mv.batcher, mv.sequencer):
                    if sched is not None:
                        t = sched.next_timer(now)
                        if t is not None:
                            timeout = min(timeout, t)
        return timeout

    def _send_batch(self, mv: ModelVersion, inst: Instance, batch: list[Pending], extra: dict | None = None) -> None:
        doc = {"requests": [p.entry for p in batch]}
        if extra:
            doc.update(extra)
        data = orjson.dumps(doc)
        off = self.arena.alloc(manifest_room(len(data)), inst.proc.pid)
        if off < 0:
            self._fail_pending(batch, 503, "the broker's arena is full; retry later")
            return
        write_manifest(self.seg.seg.buf, off, data)
        batch_id = self.next_batch
        self.next_batch += 1
        inst.outstanding[batch_id] = batch
        if not inst.seg.inbox.put(W_BATCH, len(batch), off, len(data), batch_id):
            inst.outstanding.pop(batch_id)
            self.arena.free(off)
            self._fail_pending(batch, 503, f"instance '{inst.name}' inbox is full; retry later")
            return
        inst.seg.waker.notify()

    def _fail_pending(self, batch: list[Pending], status: int, message: str) -> None:
        for p in batch:
            if p.client.name in self.clients and int(p.client.seg.slot_states[p.slot]) == SLOT_PENDING:
                self.reply(p.client, p.slot, status, {"error": message})

    def publish_routes(self) -> None:
        """Tell clients which versions are ready and which workers they may call directly.

        A version is direct when its scheduler is the default one (no dynamic or sequence
        batching): then any ready instance may take any request, and the broker adds nothing. A
        dynamically batched version with one instance is direct too: its worker batches what
        arrives on its lanes (``batches_on_worker``).
        """
        models: dict[str, Any] = {}
        splits: dict[str, Any] = {}
        for name, versions in self.models.items():
            entry = models[name] = {}
            for v, mv in versions.items():
                cfg = mv.config
                direct = mv.worker_batching or (not cfg.HasField("dynamic_batching")
                                                and not cfg.HasField("sequence_batching"))
                entry[str(v)] = {"ready": mv.state == State.READY, "direct": direct,
                                 "workers": [i.num for i in mv.instances if i.ready and i.num in self.workers]}
            split = self.split(name)
            if split is not None:
                splits[name] = split.doc()  # where unversioned requests go: see canary.py
        doc = orjson.dumps({"models": models, "splits": splits})
        if doc != self.routes_doc:
            self.routes_doc = doc
            self.seg.routes.publish(doc)

    @staticmethod
    def _death_message(mv: ModelVersion, inst: Instance, code: int) -> str:
        if inst.death_note:
            why = inst.death_note
        elif code < 0:
            try:
                why = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                why = f"was killed by signal {-code}"
        else:
            why = f"exited unexpectedly (exit code {code})"
        return f"model '{mv.name}' version {mv.version} instance '{inst.name}' {why}; the request was not completed"

    def _kill_hung_instances(self) -> None:
        """Kill instances whose running execution passed their model's execution_timeout_s; the
        death path fails their requests (with this reason) and restarts them."""
        now = time.monotonic_ns()
        for num, (mv, inst) in list(self.workers.items()):
            if not mv.exec_timeout_s or inst.death_note:
                continue
            since = int(inst.seg.stats.scalars[BUSY_SINCE])
            if since and now - since > mv.exec_timeout_s * 1e9 and inst.proc.poll() is None:
                inst.death_note = (f"exceeded its execution timeout of {mv.exec_timeout_s:g} s "
                                   f"(parameter execution_timeout_s) and was restarted")
                log.error("model '%s' version %d instance '%s' %s", mv.name, mv.version, inst.name,
                          inst.death_note)
                inst.proc.kill()
                self.child_exited = True

    def _fail_direct(self, inst: Instance, mv: ModelVersion, code: int) -> None:
        """Fail the direct requests clients had put on a worker that exited.

        A client that read the routes just before they changed may still put a request on the
        gone worker's lane after this sweep; worker numbers are never reused, so the broker
        remembers gone workers for a while and sweeps again at every housekeeping.
        """
        if mv.state == State.UNLOADING and code == 0:
            answer = (503, f"model '{mv.name}' version {mv.version} was unloaded before the request ran; retry")
        else:
            answer = (500, self._death_message(mv, inst, code))
        self.gone[inst.num] = (time.monotonic(), mv, *answer)
        self._sweep_gone()

    def _sweep_gone(self) -> None:
        now = time.monotonic()
        for num in [n for n, (at, *_) in self.gone.items() if now - at > GONE_MEMORY_S]:
            del self.gone[num]
        if not self.gone:
            return
        for client in list(self.clients.values()):
            for slot in np.flatnonzero(client.seg.slot_states == SLOT_PENDING).tolist():
                gone = self.gone.get(client.seg.target(slot) - 1)
                if gone is not None:
                    _, mv, status, msg = gone
                    self.reply(client, slot, status, {"error": msg})
                    mv.stats.fail("BACKEND" if status == 500 else "OTHER", 1)

    # -- ensembles ------------------------------------------------------------------------------
    def _start_ensemble(self, mv: ModelVersion, client: Client, slot: int, entry: dict) -> None:
        run = EnsembleRun(mv.ensemble, client, slot, entry)
        run.version = mv  # type: ignore[attr-defined]
        self._advance(run)

    def _advance(self, run: EnsembleRun) -> None:
        """Submit every step whose inputs exist; answer the client when the outputs are all made."""
        for step in run.ready_steps():
            run.started.add(step.index)
            try:
                mv = self.find_version(step.model, step.version)
                request = run.step_request(step)
                assert mv.signature is not None
                batch = mv.signature.check_inputs(request["inputs"], request.get("id", ""))
            except InvalidRequest as e:
                self._fail_run(run, step, e.status, str(e))
                return
            if not self.own_free:
                self._fail_run(run, step, 503, "too many ensemble steps in flight; retry later")
                return
            slot = self.own_free.popleft()
            request.update(client=self.own.name, pid=os.getpid(), slot=slot)
            self.own.seg.set_slot_state(slot, SLOT_PENDING)
            self.own_inflight[slot] = (run, step)
            run.running += 1
            self._enqueue(mv, Pending(self.own, slot, 0, request, batch, time.monotonic()))
        if not run.failed and run.complete():
            self._finish_run(run)

    def _on_own_completions(self) -> None:
        states = self.own.seg.slot_states
        for slot in [s for s in self.own_inflight if states[s] == SLOT_DONE]:
            _, status, role, num, off, _, _ = self.own.seg.read_slot(slot)
            self.own.seg.set_slot_state(slot, SLOT_FREE)
            run, step = self.own_inflight.pop(slot)
            self.own_free.append(slot)
            run.running -= 1
            owner = self.seg.seg if role == ROLE_BROKER else (self.workers[num][1].seg.seg if num in self.workers
                                                                  else None)
            if owner is None:
                self._fail_run(run, step, 500, "the instance that ran this step is gone")
                continue
            if not off:  # answered without a block: its producer had no room even for an error
                self._fail_run(run, step, status, NO_ROOM)
                continue
            doc, data_start = read_manifest_with_data(owner.buf, off)
            run.blocks.append((owner.buf, off))
            if status != 200:
                self._fail_run(run, step, status, doc.get("error", "failed"))
                continue
            if run.failed:
                self._release_run(run)
                continue
            for o in doc.get("outputs", ()):
                name = step.output_map.get(o["name"])
                if name:
                    run.tensors[name] = {"name": name, "datatype": o["datatype"], "shape": o["shape"],
                                         "seg": owner.name, "off": data_start + o["off"], "size": o["size"]}
            self._advance(run)

    def _fail_run(self, run: EnsembleRun, step: Step, status: int, message: str) -> None:
        if not run.failed:
            run.failed = True
            run.version.stats.fail("BACKEND", 1)  # type: ignore[attr-defined]
            self.reply(run.client, run.slot, status,
                       {"error": f"in ensemble '{run.plan.name}', step '{step.model}' failed: {message}"})
        self._release_run(run)

    def _release_run(self, run: EnsembleRun) -> None:
        """Free the step outputs once no step of the run is still running."""
        if run.running:
            return
        for buf, off in run.blocks:
            free_block(buf, off)
        run.blocks.clear()

    def _finish_run(self, run: EnsembleRun) -> None:
        """Copy the ensemble's outputs into one answer (or the client's regions) and free the steps'."""
        placed = {o["name"]: o for o in run.entry.get("outputs") or () if "seg" in o}
        outs, chunks, pos = [], [], 0
        for name in run.wanted():
            t = run.tensors[name]
            data = self.segments.get(t["seg"]).buf[t["off"]:t["off"] + t["size"]]
            desc = {"name": name, "datatype": t["datatype"], "shape": t["shape"], "size": t["size"]}
            target = placed.get(name)
            if target is not None:
                if t["size"] > target["size"]:
                    self._fail_run(run, run.plan.steps[-1], 400, f"shared memory region for output '{name}' is "
                                   f"too small ({target['size']} bytes, {t['size']} needed)")
                    return
                try:
                    region = self.segments.get(target["seg"], target.get("ino", 0), target["off"] + t["size"])
                except (StaleRegion, OSError, posix_ipc.Error) as e:
                    self._fail_run(run, run.plan.steps[-1], 400, str(e))
                    return
                region.buf[target["off"]:target["off"] + t["size"]] = data
                desc["region"] = True
            else:
                desc["off"] = pos
                chunks.append(data)
                pos += t["size"]
            outs.append(desc)
        body = orjson.dumps({"version": run.version.version, "outputs": outs})  # type: ignore[attr-defined]
        room = manifest_room(len(body))
        off = self.arena.alloc(room + pos, run.client.pid)
        if off < 0:
            self._fail_run(run, run.plan.steps[-1], 503, "the broker's arena is full; retry later")
            return
        at = write_manifest(self.seg.seg.buf, off, body)
        for chunk in chunks:
            self.seg.seg.buf[at:at + len(chunk)] = chunk
            at += len(chunk)
        arrived, now = run.entry.get("t") or 0, time.monotonic_ns()
        run.version.stats.succeed(now - arrived if 0 < arrived <= now else 0)  # type: ignore[attr-defined]
        run.client.seg.complete(run.slot, 200, ROLE_BROKER, 0, off, room + pos)
        run.client.seg.waker.notify()
        self._release_run(run)

    # -- housekeeping ---------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        for num, (mv, inst) in list(self.workers.items()):
            code = inst.proc.poll()
            if code is None:
                continue
            self._on_worker_messages(mv, inst)  # it may have said why before it went
            self._reap_instance(inst, mv)
            # Routes first, answers second: a client that gets its failure and sends again at
            # once must already see the routes without this worker.
            self.publish_routes()
            self._fail_direct(inst, mv, code)
            if mv.state == State.UNLOADING or not self.running:
                continue
            if not inst.ready:
                self._fail_version(mv, f"failed to load '{mv.name}' version {mv.version}: instance "
                                       f"'{inst.name}' exited with code {code} while loading")
                continue
            lost = [p for batch in inst.outstanding.values() for p in batch]
            if mv.sequencer is not None:  # its sequences and their state died with it
                lost += mv.sequencer.forget_instance(inst)
            msg = self._death_message(mv, inst, code)
            log.error("%s; %d request(s) failed; restarting it", msg, len(lost))
            self._fail_pending(lost, 500, msg)
            mv.stats.fail("BACKEND", len(lost))
            mv.stats.worker_restarts += 1
            inst.ready = False
            inst.outstanding.clear()
            # Back-off: an instance that keeps dying is restarted less and less often.
            delay = 0.0 if time.monotonic() - inst.started > 60 else \
                RESTART_BACKOFF_S[min(inst.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts.append((time.monotonic() + delay, mv, inst))
        for when, mv, old in list(self.restarts):
            if when <= time.monotonic():
                self.restarts.remove((when, mv, old))
                # A retiring version still gets its instance back while requests wait for it
                # (they were queued while it restarted): draining must serve them, not time out.
                wanted = mv.state != State.UNLOADING or mv.in_flight()
                if wanted and self.running and old in mv.instances:
                    self._spawn(mv, old.name, old.index, old.kind, old.device_id, replace=old)
        self._sweep_gone()
        for client in list(self.clients.values()):
            if not pid_alive(client.pid):
                log.info("client %s (pid %d) died; reclaiming its channel", client.name, client.pid)
                self._drop_client(client, died=True)
        if not self.startup_done:
            self._check_startup()

    def _check_startup(self) -> None:
        if self.loading:
            return
        states = [mv.state for vs in self.models.values() for mv in vs.values()]
        self.startup_done = True
        if self.load_errors and self.opts.exit_on_error:
            log.error("failed to load all models; exiting (use --exit-on-error=false to serve the rest)")
            self.startup_failed = True
            self.running = False
        else:
            log.info("server is ready: %d model version(s) serving",
                     sum(1 for s in states if s == State.READY))

    def server_ready(self) -> bool:
        if not self.startup_done or not self.running:
            return False
        if not self.opts.strict_readiness:
            return True
        if any(name not in self.models for name in self.load_errors):
            return False  # a model that should serve does not (a failed reload keeps the old one serving)
        return all(mv.state == State.READY and mv.live() for vs in self.models.values() for mv in vs.values())

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        for name in self.initial_models():
            self.load_model(name)
        if self.opts.control_mode == "poll":
            self.watcher = RepositoryWatcher(self.opts.repositories, self.seg.waker.post)
        waker = self.seg.waker
        while self.running:
            waker.sleep(self._next_timer(), self._has_work)
            self._pump()
            now = time.monotonic()
            if self.child_exited or now - self._last_housekeeping >= HOUSEKEEPING_S:
                self.child_exited = False
                self._last_housekeeping = now
                self._housekeeping()
        return self.shutdown()

    def _serving_and_retiring(self) -> list[ModelVersion]:
        out = [mv for versions in self.models.values() for mv in versions.values()]
        return out + [r.version for r in self.retiring]

    def _has_work(self) -> bool:
        if self.seg.connect.pending():
            return True
        states = self.own.seg.slot_states
        for slot in self.own_inflight:
            if states[slot] == SLOT_DONE:
                return True
        for client in self.clients.values():
            if client.seg.requests.pending():
                return True
        for _, inst in self.workers.values():
            if inst.seg.outbox.pending():
                return True
        return False

    def _pump(self) -> None:
        if self.seg.connect.pending():
            self._on_connects()
        if self.own_inflight:
            self._on_own_completions()
        for num, (mv, inst) in list(self.workers.items()):
            if inst.seg.outbox.pending():
                self._on_worker_messages(mv, inst)
        for client in list(self.clients.values()):
            if client.seg.requests.pending():
                self._on_client_requests(client)
        for mv in self._serving_and_retiring():
            if mv.queue or (mv.batcher is not None and len(mv.batcher)) or mv.sequencer is not None:
                self._dispatch(mv)
        if self.retiring:
            self._progress_retirement()
        if self.watcher is not None:
            self._apply_repository_changes()
        now = time.monotonic()
        if now - self._last_watch >= HUNG_CHECK_S:  # periodic checks, not per request
            self._last_watch = now
            self._judge_canaries(now)
            self._kill_hung_instances()

    def _judge_canaries(self, now: float) -> None:
        for name, canary in list(self.canaries.items()):
            if canary.policy.fraction <= 0:
                continue
            split = self.split(name)
            if split is None or split.canary is None:
                continue
            versions = self.models[name]
            totals = {}
            for v in (split.stable, split.canary):
                totals[v] = (id(versions[v]), self._version_totals(versions[v]))
            if canary.observe(now, split, totals) is not None:
                self.publish_routes()

    def request_stop(self) -> None:
        self.running = False

    def shutdown(self) -> int:
        """Finish in-flight work within the exit timeout, stop workers, remove our objects."""
        deadline = time.monotonic() + self.opts.exit_timeout_s
        while time.monotonic() < deadline and any(
                mv.in_flight() for vs in self.models.values() for mv in vs.values()):
            self.seg.waker.sleep(0.01, self._has_work)
            self._pump()
        if self.watcher is not None:
            self.watcher.stop()
        for mv, inst in list(self.workers.values()):
            self._stop_instance(inst)
        stop_deadline = time.monotonic() + 5.0
        for mv, inst in list(self.workers.values()):
            try:
                inst.proc.wait(max(0.0, stop_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                inst.proc.kill()
                inst.proc.wait()
            self._reap_instance(inst, mv)
        for client in list(self.clients.values()):
            client.seg.close()
        self.control.trace.close()  # closes the trace files' JSON arrays
        for mv in [mv for vs in list(self.models.values()) for mv in vs.values()]:
            self.models.clear()
            self._discard_model_dir(mv.model_dir)
        self.seg.close()
        self.seg.unlink()
        return STARTUP_FAILED if self.startup_failed else 0


def main(opts: BrokerOptions) -> int:
    broker = Broker(opts)
    signal.signal(signal.SIGTERM, lambda *_: broker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: broker.request_stop())
    # A dying worker interrupts the doorbell wait, so its requests fail and it restarts at once.
    signal.signal(signal.SIGCHLD, lambda *_: setattr(broker, "child_exited", True))
    return broker.run()
