"""Model lifecycle in the broker: loads that become visible only when ready, and retirement that
drains before it stops anything, so no request is lost while what is served changes; and the
server's own start (the initial loads) and readiness.

A load builds new versions (new workers) beside what serves. When every new version is READY the
swap is one step: the routing table moves to the new workers and the old versions retire. If any
new version fails, the new workers stop and the old ones go on serving; the reason is kept for
the repository index. A retiring version takes no new requests but finishes its queue, its
batches and its workers' lanes; then its workers get a graceful stop (bounded by
``--exit-timeout-secs``).

Workers report their own progress on their outboxes (ready, the auto-completed config, a failed
load, a batch done); ``on_worker_messages`` takes those reports.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shmserve.batching import DynamicBatcher, batches_on_worker
from shmserve.config_view import to_dict
from shmserve.shm.protocol import W_CONFIG, W_DONE, W_LOAD_FAILED, W_MORE, W_READY
from shmserve.shm.waker import Waker
from shmserve.signature import InvalidRequest
from shmserve.workers.backend import BUILT_IN, installed_backends
from shmserve.workers.classification import load_labels

from . import config as cfgmod
from . import instance_update
from .instance_update import STRAGGLER_GRACE_S, InstanceUpdates
from .canary import Canary
from .catalog import Catalog, LoadJob, Retiring
from .clients import Clients
from .ensemble_plan import EnsemblePlan
from .instances import Instances, StartFailed, take_message, take_payload
from .journal import Journal
from .models import Instance, ModelVersion, State
from .options import BrokerOptions
from .load_plan import LoadPlanner, NoVersion, Unpolled, instance_needs
from .load_stamp import load_stamp
from .model_table import model_rows, table
from .rate_limiter import RateLimiter
from .repository_scan import RepositoryScanner, folder_state
from .routes import Routes
from .sequencer import SequenceBatcher
from .watcher import RepositoryWatcher

if TYPE_CHECKING:  # imported only with a cloud repository (its packages are optional)
    from .cloud_sync import CloudSyncs

log = logging.getLogger("shmserve.broker")

RETIRING_CHECK_S = 0.05  # how often a draining version is looked at
UPLOAD_PREFIX = "shmserve-model-"  # private folders of models loaded from 'file:' parameters
# A load that a later request overtook: the last request wins, and the caller of the one it
# stopped hears why (409: what it asked for conflicts with what was asked after it).
CANCELLED_STATUS = 409
REPLACED = "a later load of the model replaced this one"
UNLOADED = "the model was unloaded before the load completed"


@dataclasses.dataclass(frozen=True)
class LoadRefused:
    """A load refused at once, in Triton's words, and the status its caller gets: Triton's
    INTERNAL (500, ``StatusCode.INTERNAL``) for a name no repository holds, else 400."""

    text: str
    status: int = 400


def idle(mv: ModelVersion) -> bool:
    """Nothing queued, nothing running, nothing left on any of its workers' lanes."""
    return not mv.in_flight() and all(inst.lanes_drained() for inst in mv.instances)


# Triton's reason for a model name that more than one repository holds (it loads from neither).
DUPLICATE_MODEL = "model appears in two or more repositories"


class Lifecycle:
    def __init__(self, opts: BrokerOptions, catalog: Catalog, instances: Instances, routes: Routes,
                 clients: Clients, journal: Journal, limiter: RateLimiter) -> None:
        self.opts = opts
        self.limiter = limiter  # --rate-limit: checks configs at load, holds resources per execution
        self.journal = journal  # explicit mode: what the API loaded and unloaded, for a restarted broker
        self.catalog = catalog
        self.instances = instances
        self.routes = routes
        self.clients = clients
        self.backends = set(installed_backends()) | set(BUILT_IN)
        self.planner = LoadPlanner(opts, self.backends, limiter, catalog)  # reads and checks what a load asks for
        self.watcher: RepositoryWatcher | None = None  # --model-control-mode=poll
        self.scanner: RepositoryScanner | None = None  # poll mode with --repository-poll-secs > 0
        self.cloud: CloudSyncs | None = None  # re-syncs of the cloud repositories' local copies
        self.changed_while_loading: set[str] = set()  # poll mode: look again once their load is over
        self.retry_failed_at: float | None = None  # poll mode with scans: when failed loads are tried again
        # Ensembles whose load failed for their steps -> those steps; poll mode loads one again once
        # a step of it loads (steps_loaded: those to load again when the loads in hand resolve).
        self.blocked: dict[str, set[str]] = {}
        self.steps_loaded: list[str] = []
        self.running = True  # False once a stop was asked for (or the start failed)
        self.startup_done = False
        self.refused_at_start = False  # an initial load refused at once (no repository holds it)
        self.ambiguous: set[str] = set()  # model names found in more than one repository
        self.startup_failed = False
        self.updates = InstanceUpdates(catalog, instances, routes, clients)  # live instance changes
        self.load_ids = itertools.count(1)  # one per version load: names its shared weights

    # -- the server -----------------------------------------------------------------------------
    def start(self, waker: Waker) -> None:
        """Load the models the control mode asks for; in poll mode, watch the repositories from
        before the initial loads read them, so no change made meanwhile goes unseen."""
        if self.opts.cloud_repositories:
            from .cloud_sync import CloudSyncs

            self.cloud = CloudSyncs(self.opts.cloud_repositories, waker)
        if self.opts.control_mode == "poll":
            scans = self.opts.repository_poll_s > 0
            self.watcher = RepositoryWatcher(self.opts.repositories, waker, keep_paths=scans)
            if scans:
                self.scanner = RepositoryScanner(self.opts.repositories, self.watcher, self.opts.repository_poll_s,
                                                 self.cloud)
                self.retry_failed_at = time.monotonic() + self.opts.repository_poll_s
        self.catalog.restoring = self.journal.restarted
        for name, override, model_dir in self._initial_models():
            if name in self.catalog.loading and override is None and model_dir is None:
                # An ensemble's step, loading since the ensemble's load asked for it: named at
                # start too, so unloading the ensemble's dependents leaves it.
                self.catalog.explicit.add(name)
                continue
            refused = self.load_model(name, override, model_dir=model_dir)
            if refused is not None:  # (a --load-model no repository holds, say): a model that
                self.refused_at_start = True  # did not load, which --exit-on-error stops for
            if model_dir is not None:  # a restored upload refused at once: its folder goes now
                self.discard_model_dir(str(model_dir))

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        if self.cloud is not None:
            self.cloud.stop()
        if self.scanner is not None:
            self.scanner.stop()
        if self.watcher is not None:
            self.watcher.stop()

    def check_startup(self) -> None:
        """Once the initial loads are over: the server is ready, or (--exit-on-error) it stops."""
        if self.catalog.loading:
            return
        states = [mv.state for mv in self.catalog.serving()]
        self.startup_done = True
        self.catalog.restoring = False
        if not self.running:  # (a stop began while the loads went on: readiness says no for that)
            return
        # After a broker restart a model that no longer loads must not stop a server that serves.
        failed = self.catalog.load_errors or self.refused_at_start
        rows = model_rows(self.catalog)
        for line in table(rows).splitlines() if rows else []:  # (a record a line, as log readers take them)
            log.info("%s", line)
        if failed and self.opts.exit_on_error and not self.journal.restarted:
            log.error("failed to load all models; exiting (use --exit-on-error=false to serve the rest)")
            self.startup_failed = True
            self.running = False
            return
        serving = sum(1 for s in states if s == State.READY)
        if self.server_ready():
            log.info("server is ready: %d model version(s) serving", serving)
        else:
            unavailable = sorted(name for name in self.catalog.load_errors if name not in self.catalog.models)
            if unavailable:
                log.warning("server is not ready (--strict-readiness): %d model version(s) serving, %d model(s) "
                            "failed to load (%s); readiness says so until they load or are unloaded", serving,
                            len(unavailable), ", ".join(unavailable))
            else:
                log.warning("server is not ready: %d model version(s) serving, not each with a live instance yet "
                            "(an instance restarting)", serving)

    def server_ready(self) -> bool:
        if not self.startup_done or not self.running:
            return False
        if not self.opts.strict_readiness:
            return True
        if any(name not in self.catalog.models for name in self.catalog.load_errors):
            return False  # a model that should serve does not (a failed reload keeps the old one serving)
        if any(name not in self.catalog.models for name in self.catalog.loading):
            return False  # a model's first load in progress: as Triton's, whose versions are LOADING
        return all(mv.state == State.READY and mv.live() for mv in self.catalog.serving())

    def next_timer(self) -> float | None:
        """Seconds until a draining version or a repository change needs a look (None: nothing)."""
        timeout = RETIRING_CHECK_S if self.catalog.retiring or self.updates.busy() else None
        if self.watcher is not None:
            due = self.watcher.next_due()
            if due is not None:
                timeout = due if timeout is None else min(timeout, due)
        if self.retry_failed_at is not None and self.catalog.load_errors:
            due = max(0.0, self.retry_failed_at - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        return timeout

    # -- the repository -------------------------------------------------------------------------
    def rescan_repositories(self) -> None:
        """The repositories' model folders as they are now (a repository index lists what is
        there, as Triton's polls them for it)."""
        self.catalog.model_dirs = self._scan_repositories()

    def _scan_repositories(self) -> dict[str, Path]:
        """Each model folder of the repositories; a name in two of them is in ``ambiguous`` (it
        does not load, as in Triton: which folder is meant cannot be told)."""
        found: dict[str, Path] = {}
        ambiguous: set[str] = set()
        for repo in self.opts.repositories:
            for entry in sorted(os.scandir(repo), key=lambda e: e.name):
                if entry.is_dir() and not entry.name.startswith("."):
                    if entry.name in found:
                        ambiguous.add(entry.name)
                        continue
                    found[entry.name] = Path(entry.path)
        self.ambiguous = ambiguous
        return found

    def _no_folder_hint(self, name: str) -> str:
        """For the log (the answer keeps Triton's words alone): where the name was looked for,
        and the folder names it is closest to, for a typo."""
        near = difflib.get_close_matches(name, self.catalog.model_dirs, n=3)
        where = ", ".join(str(r) for r in self.opts.repositories)
        return f": no model folder '{name}' in {where}" + \
            (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else "")

    def _initial_models(self) -> list[tuple[str, str | None, Path | None]]:
        """(name, override config, uploaded folder) of each model to load at start: in explicit
        mode the --load-model ones, changed by what the API loaded and unloaded before a broker
        restart (the journal); else every model in the repositories."""
        self.catalog.model_dirs = self._scan_repositories()
        if self.opts.control_mode != "explicit":
            return [(name, None, None) for name in self.catalog.model_dirs]
        wanted = self.opts.load_models
        if "*" in wanted and len(set(wanted)) > 1:  # Triton loads nothing then (and stops on --exit-on-error)
            log.error("Invalid argument: Wildcard model name '*' must be the ONLY startup model if specified at all.")
            self.refused_at_start = True
            wanted = []
        names = list(self.catalog.model_dirs) if "*" in wanted else list(dict.fromkeys(wanted))
        loads: dict[str, tuple[str | None, Path | None]] = {name: (None, None) for name in names}
        for name, entry in self.journal.get("models", {}).items():
            if entry is None:
                loads.pop(name, None)
            else:
                loads[name] = (entry.get("config"), Path(entry["dir"]) if entry.get("dir") else None)
        return [(name, override, model_dir) for name, (override, model_dir) in loads.items()]

    def _record(self, name: str, model_dir: str | None, override: str | None = None) -> None:
        """Explicit mode: journal that ``name`` now serves from ``model_dir`` with the config
        ``override`` (``model_dir`` None: unloaded)."""
        if self.opts.control_mode != "explicit":
            return
        entry = None
        if model_dir is not None:
            uploaded = Path(model_dir).parent.name.startswith(UPLOAD_PREFIX)
            entry = {"config": override, "dir": model_dir if uploaded else None}
        self.journal.set("models", {**self.journal.get("models", {}), name: entry})

    def apply_repository_changes(self) -> None:
        """Poll mode: reload models whose folders changed, load new ones, unload removed ones.

        A load reads the folder when it starts, so a change that arrives while the model loads
        waits for that load to end (ready or failed) and then starts another."""
        assert self.watcher is not None
        loading = self.catalog.loading
        names = [n for n in self.changed_while_loading if n not in loading] + self.watcher.due()
        retries = self._failed_to_retry(names)
        names += retries
        if not names:
            return
        self.catalog.model_dirs = self._scan_repositories()
        for name in dict.fromkeys(names):
            if name in loading:
                self.changed_while_loading.add(name)
                continue
            self.changed_while_loading.discard(name)
            if name in self.catalog.model_dirs:
                if name not in retries:  # (a retry said so itself)
                    log.info("repository change: (re)loading '%s'", name)
                self.load_model(name)
            elif name in self.catalog.models or name in self.catalog.load_errors:
                log.info("repository change: '%s' was removed; unloading it", name)
                self.unload_model(name)
                self.catalog.load_errors.pop(name, None)  # (gone: not to be loaded again at the next poll)

    def _failed_to_retry(self, changed: list[str]) -> list[str]:
        """Poll mode with scans: at each scan's interval, the models whose last load failed, to load
        again whether or not their folders changed. Triton's poll does so (a failed load puts its
        timestamp back, so every poll finds the model modified): a failure that passes (a file
        or service the model needed, memory) heals at the next poll rather than never."""
        if self.retry_failed_at is None or time.monotonic() < self.retry_failed_at:
            return []
        self.retry_failed_at = time.monotonic() + self.opts.repository_poll_s
        again = [n for n in self.catalog.load_errors if n in self.catalog.model_dirs
                 and n not in changed and n not in self.catalog.loading and n not in self.changed_while_loading]
        for name in again:
            log.info("repository poll: loading '%s' again, as its last load failed", name)
        return again

    # -- loading --------------------------------------------------------------------------------
    def load_model(self, name: str, override_json: str | None = None, waiter: tuple[Any, int] | None = None,
                   model_dir: Path | None = None, explicit: bool = True, keep_unchanged: bool = False
                   ) -> LoadRefused | None:
        """Start loading every version of ``name`` the policy selects beside what serves now;
        returns an error at once, or None (the swap happens when all are ready). ``explicit``: it
        was asked for by name (not only as an ensemble's step: ``Catalog.explicit``).

        A load of ``name`` already in progress that asked for the same folder and config is
        joined; one that asked for something else is cancelled, so the last request wins. A
        request refused at once (no folder, an invalid config) leaves a load in progress alone."""
        catalog = self.catalog
        if explicit:
            catalog.explicit.add(name)
        model_dir = model_dir or catalog.model_dirs.get(name)
        if model_dir is None:
            catalog.model_dirs = self._scan_repositories()
            model_dir = catalog.model_dirs.get(name)
        if model_dir is None:
            # A name no repository holds (a typo, a model not there yet): Triton's text, but no
            # trace. Recorded, it would enter the index, turn strict readiness off for the whole
            # server and give the failure metric a label per name a client makes up.
            reason = f"failed to load '{name}', failed to poll from model repository"
            log.error("%s%s", reason, self._no_folder_hint(name))
            return LoadRefused(reason, 500)
        if name in self.ambiguous and model_dir == catalog.model_dirs.get(name):  # (an upload is its own)
            return self._load_failed(name, f"failed to load '{name}', {DUPLICATE_MODEL}", unpolled=True)
        serving = catalog.models.get(name)
        if keep_unchanged and override_json is None and serving and name not in catalog.loading \
                and name not in self.updates.waiters and instance_update.unchanged_since_load(serving, model_dir):
            log.info("load of '%s': no file of its folder changed since it loaded; it serves on as it was loaded", name)
            catalog.load_errors.pop(name, None)  # what serves is what was asked for
            canary = catalog.canaries.get(name)
            if canary is not None and canary.rejected & set(serving):  # asked for by name: a fresh chance
                for v in serving:
                    canary.forget_version(v)
                self.routes.publish()
            if waiter is not None:
                self.clients.reply(waiter[0], waiter[1], 200, {})
            return None
        folder = folder_state(str(model_dir))  # (before the plan reads it: a change meanwhile shows next time)
        stamp = load_stamp(str(model_dir), override_json is not None)
        try:
            plan = self.planner.plan(name, model_dir, override_json)
        except cfgmod.ConfigError as e:
            return self._load_failed(name, f"failed to load '{name}', {e}", tried=[] if isinstance(e, NoVersion) else None,
                                     unpolled=isinstance(e, Unpolled))
        config, versions = plan.config, plan.versions
        if serving and name not in catalog.loading and instance_update.updatable(serving, model_dir, config, versions):
            added = sum(len(instance_update.instance_changes(mv, config)[0]) for mv in serving.values())
            with self.instances.counted(added) as shortfall:
                if shortfall:  # what serves goes on serving as it is
                    log.error("failed to load '%s', %s", name, shortfall)
                    return LoadRefused(f"failed to load '{name}', {shortfall}")
                self.updates.apply(serving, config, waiter, folder, stamp)
            catalog.load_errors.pop(name, None)  # this load supersedes one that failed before
            self._record(name, str(model_dir), override_json)
            return None
        pending = catalog.loading.get(name)
        if pending is not None and pending.same_request(model_dir, config):
            log.info("load of '%s' asked for again: joining the load in progress", name)
            if waiter is not None:
                pending.waiters.append(waiter)
            return None
        per_version = 0 if config.platform == "ensemble" else len(instance_update.planned_instances(config))
        with self.instances.counted(len(versions) * per_version) as shortfall:
            if shortfall:
                return self._load_failed(name, f"failed to load '{name}', {shortfall}")
            self.cancel_load(name, REPLACED)
            job = catalog.loading[name] = LoadJob(name, {}, [waiter] if waiter is not None else [],
                                                  plan.canary_policy, str(model_dir), config, override_json)
            for v in versions:
                mv = ModelVersion(name=name, version=v, model_dir=str(model_dir), config=config,
                                  config_dict=to_dict(config), backend=cfgmod.backend_of(config))
                mv.set_config(mv.config_dict)
                mv.exec_timeout_s = plan.exec_timeout_s
                mv.requested_config, mv.files = config, instance_update.folder_fingerprint(str(model_dir))
                mv.folder_state, mv.load_stamp = folder, stamp
                mv.weights_key = f"{name}.{v}.{next(self.load_ids)}"
                job.versions[v] = mv
                if config.platform == "ensemble":
                    self._load_ensemble(mv)
                else:
                    self._start_instances(mv)
        for mv in job.versions.values():  # (outside the lock: a step's load reads its repository)
            if mv.ensemble is not None:
                self._load_steps(mv)
        self.resolve_loads()
        return None

    def _load_ensemble(self, mv: ModelVersion) -> None:
        """An ensemble has no workers: it is ready at once, and its step models load with it."""
        try:
            # Triton labels an ensemble's outputs with the ensemble's own label files
            labels = load_labels(mv.config_dict, Path(mv.model_dir))
        except ValueError:  # gone since the load was planned (load_plan.py refuses an unreadable one)
            labels = {}
        mv.ensemble = EnsemblePlan(mv.config, labels)
        mv.state = State.READY
        log.info("successfully loaded '%s' version %d (ensemble of %s)", mv.name, mv.version,
                 ", ".join(mv.ensemble.dependencies()))

    def _load_steps(self, mv: ModelVersion) -> None:
        """Load the step models of ensemble ``mv`` that are neither loaded nor loading."""
        assert mv.ensemble is not None
        catalog = self.catalog
        for dep in mv.ensemble.dependencies():  # as Triton: an ensemble brings its steps
            if dep not in catalog.models and dep not in catalog.load_errors and dep not in catalog.loading:
                self.load_model(dep, explicit=False)

    def _start_instances(self, mv: ModelVersion) -> None:
        """Give ``mv`` its scheduler and start a worker per instance its config asks for."""
        config = mv.config
        if config.HasField("sequence_batching"):
            mv.sequencer = SequenceBatcher(config)
            mv.pipeline_depth = 1
        elif config.HasField("dynamic_batching"):
            mv.batcher = DynamicBatcher(mv.config_dict)
            mv.pipeline_depth = 1  # let requests gather while the instance is busy
        mv.planned_instances = cfgmod.instance_count(config)
        mv.worker_batching = batches_on_worker(mv.config_dict, mv.planned_instances)
        if self.limiter.applies_to(config):
            mv.rate_limited = True
            mv.pipeline_depth = 1  # resources are held per execution: one batch at a time per instance
            self.limiter.register(mv, instance_needs(config))
        for plan in instance_update.planned_instances(config):
            try:
                self.instances.spawn(mv, plan.name, len(mv.instances), plan.kind, plan.device)
            except StartFailed as e:  # the load fails (resolve_loads answers it), never the broker
                self.fail_version(mv, f"failed to load '{mv.name}' version {mv.version}: {e}")
                return
        log.info("loading '%s' version %d: %d instance(s), backend %s", mv.name, mv.version, len(mv.instances),
                 mv.backend)

    def resolve_loads(self) -> None:
        """Swap in every load whose versions are all READY; abandon those where one failed. An
        ensemble's load ends once its steps' loads have (as Triton loads the composing models
        first): its caller then finds it ready. Passes repeat while one ends, for nested ensembles."""
        while self._resolve_pass():
            pass
        while self.steps_loaded:  # (outside the passes: a load resolves loads itself)
            ensemble = self.steps_loaded.pop()
            if ensemble in self.catalog.load_errors and ensemble not in self.catalog.loading:
                log.info("repository change: a step of '%s' loaded; loading it again", ensemble)
                self.load_model(ensemble, explicit=False)

    def _waits_for_steps(self, job: LoadJob) -> bool:
        loading = self.catalog.loading
        return any(mv.ensemble is not None and any(dep in loading for dep in mv.ensemble.dependencies())
                   for mv in job.versions.values())

    def _resolve_pass(self) -> bool:
        """One pass of ``resolve_loads``; True if a load ended."""
        catalog = self.catalog
        ended = False
        for name, job in list(catalog.loading.items()):
            if catalog.loading.get(name) is not job:
                continue  # ended (or replaced) earlier in this pass
            bad = job.failed()
            if bad is not None:
                ended = True
                del catalog.loading[name]
                if job.retries < self.opts.load_retries:
                    self._retry(job, bad.reason)
                    continue
                # Triton lets go of the versions that loaded: "unloaded", the failed one its reason.
                self._fail_job(job, bad.reason, {
                    v: (mv.reason or bad.reason) if mv.state == State.UNAVAILABLE else "unloaded"
                    for v, mv in sorted(job.versions.items())})
                continue
            if not job.ready() or self._waits_for_steps(job):
                continue
            ended = True
            unserved = self._unserved_step(job)
            if unserved is not None:  # as Triton: an ensemble whose steps did not load does not load
                del catalog.loading[name]
                log.error("failed to load '%s', %s", name, unserved)
                self._fail_job(job, f"failed to load '{name}', {unserved}", {})
                self.blocked[name] = {dep for mv in job.versions.values() if mv.ensemble is not None
                                      for dep in mv.ensemble.dependencies()}
                continue
            del catalog.loading[name]
            catalog.load_errors.pop(name, None)
            catalog.failed_versions.pop(name, None)
            self.blocked.pop(name, None)
            old = catalog.models.get(name, {})
            # Versions a new policy no longer serves stay listed, UNAVAILABLE "unloaded", as in Triton.
            dropped = sorted((set(catalog.unloaded.pop(name, [])) | set(old)) - set(job.versions))
            if dropped:
                catalog.unloaded[name] = dropped
            catalog.models[name] = dict(job.versions)
            canary = catalog.canaries.setdefault(name, Canary(name))
            canary.configured = job.canary_policy
            for v in job.versions:
                canary.forget_version(v)
            for v, mv in old.items():
                self._retire(mv)
            self.updates.abandon(name, CANCELLED_STATUS, REPLACED)
            self.routes.publish()
            self._record(name, job.model_dir, job.override)
            for client, slot in job.waiters:
                self.clients.reply(client, slot, 200, {})
            if self.opts.control_mode == "poll":  # as Triton's repository polling: its dependents load again
                self.steps_loaded.extend(e for e, steps in self.blocked.items() if name in steps)
        return ended

    def _fail_job(self, job: LoadJob, reason: str, versions: dict[int, str]) -> None:
        """A load that ended without serving: its callers hear ``reason``, which the index keeps
        (with its ``versions`` as UNAVAILABLE, each with its own reason) until a load or unload
        replaces it."""
        catalog = self.catalog
        self._abandon(job, 400, reason)
        catalog.load_errors[job.name] = reason
        catalog.failed_versions[job.name] = versions
        if job.name not in catalog.models:  # (what serves on keeps the versions unloaded before, as in Triton)
            catalog.unloaded.pop(job.name, None)
        catalog.load_failures[job.name] += 1

    def _unserved_step(self, job: LoadJob) -> str | None:
        """Why an ensemble's load cannot serve once its steps' loads ended, in Triton's words: a
        step no repository holds, or one whose load failed (None: every step has its version)."""
        catalog = self.catalog
        for mv in job.versions.values():
            if mv.ensemble is None:
                continue
            missing = [dep for dep in mv.ensemble.dependencies()
                       if dep not in catalog.models and dep not in catalog.model_dirs and dep not in catalog.load_errors]
            if missing:
                return f"ensemble {job.name} contains models that are not available or ambiguous: {', '.join(missing)}"
            for step in mv.ensemble.steps:
                try:
                    catalog.find_version(step.model, step.version)
                except InvalidRequest:
                    if step.version:
                        return (f"ensemble '{job.name}' depends on '{step.model}' whose required version "
                                f"{step.version} is not loaded")
                    why = catalog.load_errors.get(step.model)
                    return (f"ensemble '{job.name}' depends on '{step.model}' which has no loaded version"
                            + (f". Model '{step.model}' loading failed with error: {why}" if why else ""))
        return None

    def _retry(self, job: LoadJob, reason: str) -> None:
        """Start a failed load again (Triton's --model-load-retry-count), with the same folder,
        config and callers; they are answered once it serves or its last try fails."""
        waiters, job.waiters = job.waiters, []
        self._abandon(job, 400, reason)  # its workers stop; nobody is answered yet
        log.warning("%s; trying again (retry %d of %d)", reason, job.retries + 1, self.opts.load_retries)
        refused = self.load_model(job.name, job.override, model_dir=Path(job.model_dir), explicit=False)
        again = self.catalog.loading.get(job.name)
        if again is not None:
            again.retries = job.retries + 1
            again.waiters.extend(waiters)
        else:
            for client, slot in waiters:
                if refused is None:
                    self.clients.reply(client, slot, 200, {})
                else:
                    self.clients.reply(client, slot, refused.status, {"error": refused.text})

    def cancel_load(self, name: str, why: str) -> None:
        """Stop the load of ``name`` in progress, if any, because a later request overtook it;
        what serves is untouched."""
        job = self.catalog.loading.pop(name, None)
        if job is not None:
            log.info("load of '%s' cancelled: %s", name, why)
            self._abandon(job, CANCELLED_STATUS, f"failed to load '{name}', {why}")

    def _abandon(self, job: LoadJob, status: int, error: str) -> None:
        """Kill the workers of a load that will not serve and answer its callers with ``error``."""
        for mv in job.versions.values():
            for inst in mv.instances:
                self.instances.stop(inst, graceful=False)
            mv.state = State.UNLOADING  # its workers are reaped, never restarted
            self.catalog.retiring.append(Retiring(mv, stopping=True, killed=True, abandoned=True))
        for client, slot in job.waiters:
            self.clients.reply(client, slot, status, {"error": error})

    def _serving_on(self, name: str, besides: ModelVersion | None = None) -> str:
        """What of ``name`` serves on after a failed load, for its log line ("" when nothing)."""
        serving = sorted(v for v, mv in self.catalog.models.get(name, {}).items()
                         if mv is not besides and mv.state == State.READY)
        return f" (version {', '.join(map(str, serving))} of '{name}' serves on)" if serving else ""

    def _load_failed(self, name: str, reason: str, tried: list[int] | None = None,
                     unpolled: bool = False) -> LoadRefused:
        """A load refused before any version started. ``tried``: the versions it selected ([]: none,
        so a version asked for "is not found"; None: unknown); ``unpolled``: refused where
        Triton's repository poll refuses it, which never registers the model."""
        catalog = self.catalog
        log.error("%s%s", reason, self._serving_on(name))
        catalog.load_failures[name] += 1
        catalog.load_errors[name] = reason
        if tried is None:
            catalog.failed_versions.pop(name, None)
        else:
            catalog.failed_versions[name] = dict.fromkeys(tried, reason)
        catalog.unpolled.discard(name)
        if name not in catalog.models:  # (what serves on keeps the versions unloaded before, as in Triton)
            catalog.unloaded.pop(name, None)
            if unpolled:
                catalog.unpolled.add(name)
        return LoadRefused(reason)

    def fail_version(self, mv: ModelVersion, reason: str) -> None:
        """A version that cannot serve: its workers stop and what waits for it fails."""
        if mv.state in (State.UNAVAILABLE, State.UNLOADING):
            return  # already failed, or retired (a cancelled load's late report changes nothing)
        log.error("%s%s", reason, self._serving_on(mv.name, mv))
        mv.state = State.UNAVAILABLE
        mv.reason = reason
        self.catalog.load_errors[mv.name] = reason
        self.routes.publish()
        for inst in mv.instances:
            self.instances.stop(inst, graceful=False)
        self.clients.fail_pending(mv.queued(), 400, f"Request for unknown model: '{mv.name}' is not ready")
        mv.queue.clear()
        if mv.batcher is not None:
            mv.batcher = DynamicBatcher(mv.config_dict)
        if mv.sequencer is not None:
            mv.sequencer = SequenceBatcher(mv.config)

    # -- what workers report --------------------------------------------------------------------
    def on_worker_messages(self, mv: ModelVersion, inst: Instance) -> None:
        """Take what a worker put on its outbox: batches done, ready, its config, a failed load."""
        for kind, status, off, length, batch_id in inst.seg.outbox.drain():
            if kind == W_DONE:
                inst.outstanding.pop(batch_id, None)  # the instance may take the next batch
                self.limiter.release(inst, batch_id)  # and what it held may let another go
            elif kind == W_READY:
                self._instance_ready(mv, inst)
            elif kind == W_MORE:
                inst.message_parts.append(take_payload(inst, off, length))
            elif kind == W_CONFIG:
                self._on_completed_config(mv, take_message(inst, off, length))
            elif kind == W_LOAD_FAILED:
                reason = take_message(inst, off, length).decode(errors="replace")
                if inst.added:  # a live instance change: the version serves on without it
                    self.updates.failed(mv, inst, f"failed to load '{mv.name}' version {mv.version}: {reason}")
                elif mv.state == State.READY:  # a restart failed: tried again with back-off (supervisor.py)
                    inst.death_note = f"failed to restart: {reason}"
                else:
                    self.fail_version(mv, f"failed to load '{mv.name}' version {mv.version}: {reason}")
        self.settle_loads()

    def settle_loads(self) -> None:
        """End the loads that can end now (a version became ready or failed: their callers are
        answered), and the start once its loads are over. After what a worker said, and after a
        worker that died while loading said nothing (killed, out of memory, a crash in native
        code): without it, that load and every later load of the model waited forever."""
        if self.catalog.loading:
            self.resolve_loads()
        if not self.startup_done:
            self.check_startup()

    def _instance_ready(self, mv: ModelVersion, inst: Instance) -> None:
        if inst.removed:
            return  # removed (or failed) while it loaded: it stops without serving
        inst.ready = True
        if inst.restarts and mv.state == State.READY:  # (one that died and was restarted: say it is back)
            log.info("model '%s' version %d instance '%s' is serving again (restart %d)", mv.name, mv.version,
                     inst.name, inst.restarts)
        if mv.state == State.LOADING and all(i.ready for i in mv.instances):
            mv.state = State.READY
            mv.load_seconds = time.monotonic() - mv.created
            self.catalog.load_times.observe(mv.name, mv.version, mv.load_seconds)
            log.info("successfully loaded '%s' version %d (%.2f s)", mv.name, mv.version, mv.load_seconds)
        self.routes.publish()
        if inst.added:
            self.updates.ready(mv, inst)

    def _on_completed_config(self, mv: ModelVersion, data: bytes) -> None:
        """The config as the backend completed it (e.g. a model.py's auto_complete_config)."""
        if mv.config_confirmed:
            return
        mv.config_confirmed = True
        try:
            completed = cfgmod.from_dict(orjson.loads(data))
            cfgmod.complete_defaults(completed)
            cfgmod.validate(completed, Path(mv.model_dir), self.backends, [mv.version])
        except (cfgmod.ConfigError, ValueError) as e:
            self.fail_version(mv, f"failed to load '{mv.name}', auto-completed config is invalid: {e}")
            return
        mv.config = completed
        mv.set_config(to_dict(completed))
        if completed.HasField("dynamic_batching") and mv.sequencer is None and (
                mv.batcher is None or mv.batcher.max_batch_size != completed.max_batch_size):
            # The backend asked for the dynamic batcher (model.py's set_dynamic_batching, or an ONNX
            # graph that batches), or set max_batch_size; nothing is queued before the version is READY.
            mv.batcher = DynamicBatcher(mv.config_dict)
            mv.pipeline_depth = 1
        mv.worker_batching = batches_on_worker(mv.config_dict, mv.planned_instances)

    # -- unloading and retirement ---------------------------------------------------------------
    def unload_model(self, name: str, waiter: tuple[Any, int] | None = None, dependents: bool = False) -> None:
        """Retire what serves of ``name`` and cancel its load in progress, so the model ends
        unloaded; answered once its workers are gone."""
        catalog = self.catalog
        job = catalog.loading.get(name)
        cancelled = job is not None
        catalog.explicit.discard(name)
        self.blocked.pop(name, None)
        self.cancel_load(name, UNLOADED)
        versions = catalog.models.pop(name, {})
        # Triton finishes a load before it unloads: the versions of a cancelled load are listed
        # too ("unloaded", "no available versions"), a first load's as much as a reload's.
        gone = set(versions) | (set(job.versions) if job is not None else set())
        catalog.canaries.pop(name, None)
        if gone or not catalog.failed_versions.get(name):
            # A failed load of versions stays as Triton keeps it (UNAVAILABLE with its reason, "no
            # available versions") when nothing serves; a config that failed is forgotten.
            catalog.load_errors.pop(name, None)
            catalog.failed_versions.pop(name, None)
        if gone:  # kept as Triton keeps them: UNAVAILABLE, "unloaded" (with those a reload dropped before)
            catalog.unloaded[name] = sorted(set(catalog.unloaded.get(name, ())) | gone)
        for mv in versions.values():
            if dependents and mv.ensemble is not None:
                # As Triton: a step goes with it unless it was loaded by name or another ensemble
                # still uses it; a nested ensemble's steps likewise.
                for dep in mv.ensemble.dependencies():
                    if dep in catalog.models and dep not in catalog.explicit and not self._used_by_ensembles(dep):
                        self.unload_model(dep, dependents=True)
            self._retire(mv)
        if versions or cancelled:  # the newest entry: a serving version, which drains last
            catalog.retiring[-1].waiters.extend([waiter] if waiter is not None else [])
        elif waiter is not None:
            self.clients.reply(waiter[0], waiter[1], 200, {})
        self.updates.abandon(name, CANCELLED_STATUS, UNLOADED)
        self.routes.publish()
        self._record(name, None)

    def _used_by_ensembles(self, name: str) -> bool:
        """Whether a loaded ensemble has ``name`` as a step."""
        return any(mv.ensemble is not None and name in mv.ensemble.dependencies()
                   for versions in self.catalog.models.values() for mv in versions.values())

    def _retire(self, mv: ModelVersion) -> None:
        mv.state = State.UNLOADING
        self.catalog.retiring.append(Retiring(mv))
        log.info("unloading '%s' version %d: draining", mv.name, mv.version)

    def progress_retirement(self) -> None:
        """Stop retired versions' workers once drained (or the exit timeout ran out), kill those
        still there the exit timeout after they were asked (a ``finalize`` that never returns, a
        stopped process); forget them once their workers are gone."""
        now = time.monotonic()
        for entry in list(self.catalog.retiring):
            mv = entry.version
            if not entry.stopping:
                overdue = now - entry.since > self.opts.exit_timeout_s
                if overdue or (now - entry.since >= STRAGGLER_GRACE_S and idle(mv)):
                    if overdue and mv.in_flight():
                        self.clients.fail_pending(mv.queued(), 503, f"model '{mv.name}' version {mv.version} "
                                                                    f"was unloaded before the request ran")
                    entry.stopping, entry.stop_asked = True, now
                    for inst in mv.instances:
                        self.instances.stop(inst, graceful=not overdue)
            live = [inst for inst in mv.instances if self.instances.live(inst)]
            if entry.stopping and live and not entry.killed and now - entry.stop_asked > self.opts.exit_timeout_s:
                entry.killed = True
                running = [inst for inst in live if inst.proc.poll() is None]
                if running:
                    log.warning("'%s' version %d: %d instance(s) did not stop within %g s of being asked "
                                "(--exit-timeout-secs; a finalize that does not return?): killed", mv.name,
                                mv.version, len(running), self.opts.exit_timeout_s)
                for inst in running:
                    inst.death_note = (f"did not stop within {self.opts.exit_timeout_s:g} s of its version's unload "
                                       f"(--exit-timeout-secs) and was killed")
                    self.instances.stop(inst, graceful=False)
            if entry.stopping and not live:
                self.catalog.retiring.remove(entry)
                self.limiter.unregister(mv)
                if entry.abandoned:  # not "unloaded": what serves, if anything, is another version
                    log.info("stopped the instances of the load of '%s' version %d that did not complete",
                             mv.name, mv.version)
                else:
                    log.info("unloaded '%s' version %d", mv.name, mv.version)
                self.instances.forget_weights(mv)
                self.discard_model_dir(mv.model_dir)
                for client, slot in entry.waiters:
                    if client.name in self.clients.by_name:
                        self.clients.reply(client, slot, 200, {})

    def discard_model_dir(self, model_dir: str) -> None:
        """Remove the private folder of a model loaded from 'file:' parameters once no version
        loaded, loading or draining uses it (repository folders are never touched)."""
        folder = Path(model_dir).parent
        if not folder.name.startswith(UPLOAD_PREFIX) or folder.parent != Path(tempfile.gettempdir()):
            return
        if not any(Path(mv.model_dir).parent == folder for mv in self.catalog.in_use()):
            shutil.rmtree(folder, ignore_errors=True)
