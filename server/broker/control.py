"""Control requests (everything that is not an inference): health, metadata, config, repository
index, statistics, canaries, shared-memory registration, logging and trace settings. They travel
as typed messages (shm/control_messages.py) on the same channel as inference, so the frontend
holds no state of its own. Each operation asks the broker part whose job it is, and returns (status, answer) for the
broker to reply with (status 0: the part answers later, e.g. when a load is done).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from shmserve.config_view import as_triton_shows
from shmserve.shm import logs
from shmserve.shm.channel import BrokerSegment
from shmserve.shm.control_messages import (
    CLIENT_SHM_DISABLED, CanaryStatus, ControlMessage, CudaRegionStatus, EdgeReport, LoadModel, LogSettings,
    ModelConfig, ModelMetadata, ModelReady, ModelStatistics, NetworkCaller, PromoteCanary, RegisterCudaRegion,
    RegisterSystemRegion, RepositoryIndex, RollBackCanary, ServerReady, SetCanary, SystemRegionStatus, TraceSettings,
    UnloadModel, UnregisterCudaRegion, UnregisterSystemRegion)
from shmserve.shm.regions import created_key_prefix
from shmserve.signature import InvalidRequest, UnknownModel

from . import edge_reports
from .canary import Canary
from .catalog import Catalog
from .journal import Journal
from .lifecycle import CANCELLED_STATUS, DUPLICATE_MODEL, UNLOADED, UPLOAD_PREFIX, Lifecycle
from .metrics import version_stats_json
from .models import Client, ModelVersion, State
from .options import BrokerOptions
from .readiness import blocked_step, version_ready
from .region_access import Caller, ClientShmDisabled, caller_of
from .regions import Regions
from .routes import Routes
from .statistics import Statistics
from .tracing import TraceOwner

Answer = tuple[int, Any]


class ControlHandler:
    def __init__(self, opts: BrokerOptions, seg: BrokerSegment, catalog: Catalog, lifecycle: Lifecycle,
                 routes: Routes, statistics: Statistics, regions: Regions, journal: Journal) -> None:
        self.opts = opts
        self.journal = journal  # log and trace settings changed through the API outlive a broker restart
        self.seg = seg
        self.catalog = catalog
        self.lifecycle = lifecycle
        self.routes = routes
        self.statistics = statistics
        self.regions = regions
        self.ops: dict[type[ControlMessage], Callable[[Client, int, Any], Answer]] = {
            ServerReady: self._server_ready,
            ModelReady: self._model_ready,
            ModelMetadata: self._model_metadata,
            ModelConfig: self._model_config,
            RepositoryIndex: self._repository_index,
            RegisterSystemRegion: self._shm_register,
            UnregisterSystemRegion: self._shm_unregister,
            SystemRegionStatus: self._shm_status,
            LoadModel: self._load,
            UnloadModel: self._unload,
            RegisterCudaRegion: self._cuda_register,
            UnregisterCudaRegion: self._cuda_unregister,
            CudaRegionStatus: self._cuda_status,
            LogSettings: self._log_settings,
            TraceSettings: self._trace_settings,
            ModelStatistics: self._model_stats,
            CanaryStatus: self._canary_status,
            SetCanary: self._canary_set,
            PromoteCanary: self._canary_decide,
            RollBackCanary: self._canary_decide,
            EdgeReport: self._edge_report,
        }
        # The broker owns the log settings (its own, set from the command line and changed here,
        # or as a broker before this one had them); every other process follows what it publishes.
        if journal.get("log"):
            logs.configure(journal.get("log"))
        logs.publish(seg.settings, logs.current())
        self.trace = TraceOwner(opts.server_id, opts.trace, opts.trace_file_shown)  # trace extension (server/broker/tracing.py)
        if journal.get("trace"):
            self.trace.restore(journal.get("trace"))

    def handle(self, client: Client, slot: int, msg: ControlMessage) -> Answer:
        if not client.server_user:
            # A local client of another user: what only the frontends may say (the network
            # caller of a region, a key that allows uploads) is not its to say. It registers
            # regions as itself, and uploads model code only where network callers may.
            if isinstance(msg, LoadModel):
                msg = dataclasses.replace(msg, from_network="open")
            elif getattr(msg, "caller", None) is not None:
                msg = dataclasses.replace(msg, caller=None)  # type: ignore[call-arg]
        return self.ops[type(msg)](client, slot, msg)

    def _edge_report(self, client: Client, slot: int, msg: EdgeReport) -> Answer:
        """A frontend's counts for the metrics: the server's own user's word only."""
        if not client.server_user:
            return 403, {"error": "edge reports come from the server's own frontends only"}
        problem = edge_reports.problem(msg)
        if problem is not None:
            return 400, {"error": problem}
        self.statistics.edges.take(client.ticket, msg)
        return 200, {}

    # -- health and metadata --------------------------------------------------------------------
    def _server_ready(self, client: Client, slot: int, msg: ServerReady) -> Answer:
        # "started": the initial loads are over (a frontend on a shared port listens then: server/edge/shared_port.py)
        return 200, {"ready": self.lifecycle.server_ready(), "started": self.lifecycle.startup_done}

    def _version(self, model: str, version: str = "") -> ModelVersion:
        return self.catalog.find_version(model, version)

    def _model_ready(self, client: Client, slot: int, msg: ModelReady) -> Answer:
        if not self.lifecycle.running:
            return 200, {"ready": False}  # draining before a stop: the model takes no new requests
        try:
            # not while every instance is restarting, nor for an ensemble while a step is not ready
            return 200, {"ready": version_ready(self._version(msg.model, msg.version), self.catalog)}
        except InvalidRequest:
            return 200, {"ready": False}

    def _model_metadata(self, client: Client, slot: int, msg: ModelMetadata) -> Answer:
        mv = self._version(msg.model, msg.version)
        sig = mv.signature
        assert sig is not None
        # One version's metadata names that version only, as Triton's does
        versions = [str(mv.version)] if msg.version else \
            [str(v) for v, m in sorted(self.catalog.models[mv.name].items()) if m.state == State.READY]

        def tensors(specs: dict) -> list[dict]:
            return [{"name": s.name, "datatype": s.datatype, "shape": sig.full_shape(s)} for s in specs.values()]

        cfg = mv.config_dict
        return 200, {"name": mv.name, "versions": versions,
                     "platform": cfg.get("platform") or cfg.get("backend", ""),
                     "inputs": tensors(sig.inputs), "outputs": tensors(sig.outputs)}

    def _model_config(self, client: Client, slot: int, msg: ModelConfig) -> Answer:
        return 200, as_triton_shows(self._version(msg.model, msg.version).config_dict)

    def _repository_index(self, client: Client, slot: int, msg: RepositoryIndex) -> Answer:
        if not self.lifecycle.running:
            raise ServerNotReady()  # draining before a stop, as Triton refuses the index while it exits
        self.lifecycle.rescan_repositories()  # folders added or removed since count, as in Triton
        b = self.catalog
        out = []
        # Only what the repositories hold, as Triton lists them: a model that serves from uploaded
        # files, or whose folder was removed, is not listed (it still serves and answers readiness).
        for name in sorted(b.model_dirs):
            if name in self.lifecycle.ambiguous:
                out.append({"name": name, **_state(State.UNAVAILABLE.value, DUPLICATE_MODEL)})
                continue
            versions = b.models.get(name, {})  # those serving
            if versions or (name in b.loading and b.loading[name].versions):
                stale = b.failed_reload(name)  # the old versions serve on after a later load failed
                entries = [{"name": name, "version": str(v), **index_state(mv, stale, b)}
                           for v, mv in versions.items()]
                # Versions loading (beside them, or a first load), whose load failed, or that a reload's policy dropped
                draining = {r.version.version for r in b.retiring if r.version.name == name}
                entries += [{"name": name, "version": str(v),
                             **(_state(State.UNLOADING.value, "") if v in draining and st["reason"] == "unloaded"
                                else _state(st["state"], st["reason"]))}
                            for v, st in b.pending_versions(name).items()]
                out += sorted(entries, key=lambda e: int(e["version"]))
            elif name in b.load_errors:
                tried = b.failed_versions.get(name)
                out += [{"name": name, "version": str(v), **_state(State.UNAVAILABLE.value, why)}
                        for v, why in tried.items()] if tried else \
                    [{"name": name, **_state(State.UNAVAILABLE.value, b.load_errors[name])}]
            elif name in b.unloaded:
                out += unloaded_entries(name, b)
            else:
                out.append({"name": name})
        if msg.ready:
            out = [e for e in out if e.get("state") == State.READY.value]
        return 200, out

    def _model_stats(self, client: Client, slot: int, msg: ModelStatistics) -> Answer:
        """The statistics extension: every loaded version, one model's, or one version's."""
        model, version = msg.model, msg.version
        rows = sorted(self.statistics.rows(), key=lambda r: (r[0], r[1]))  # by name and version, as Triton lists them
        if model:
            # Triton's statistics texts, not its inference ones.
            if model not in self.catalog.models:
                raise InvalidRequest(f"requested model '{model}' is not available")
            rows = [r for r in rows if r[0] == model]
            if version:
                if not version.isdigit() or int(version) not in self.catalog.models[model]:
                    raise InvalidRequest(f"requested model version is not available for model '{model}'")
                rows = [r for r in rows if r[1] == int(version)]
        return 200, {"model_stats": [version_stats_json(m, v, st) for m, v, st in rows]}

    # -- repository API -------------------------------------------------------------------------
    def _canary(self, model: str) -> tuple[Any, Any]:
        b = self.catalog
        if model not in b.models:
            raise UnknownModel(f"Request for unknown model: '{model}' is not found")
        return b.canaries.setdefault(model, Canary(model)), b.split(model)

    def _canary_status(self, client: Client, slot: int, msg: CanaryStatus) -> Answer:
        canary, split = self._canary(msg.model)
        return 200, canary.status(split)

    def _canary_set(self, client: Client, slot: int, msg: SetCanary) -> Answer:
        """Change the canary policy at run time (it wins over config.pbtxt until a restart)."""
        canary, _ = self._canary(msg.model)
        changes = msg.settings
        try:
            canary.policy.updated(changes)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        canary.override.update(changes)
        self.routes.publish()
        return 200, canary.status(self.catalog.split(canary.model))

    def _canary_decide(self, client: Client, slot: int, msg: PromoteCanary | RollBackCanary) -> Answer:
        """Manual promote or rollback of the canary in progress."""
        canary, split = self._canary(msg.model)
        if split is None or split.canary is None:
            raise InvalidRequest(f"model '{canary.model}' has no canary in progress")
        action = "promote" if isinstance(msg, PromoteCanary) else "rollback"
        canary.decide(action, split, "manual", msg.reason or f"{action} requested through the API")
        self.routes.publish()
        return 200, canary.status(self.catalog.split(canary.model))

    def _explicit_only(self) -> None:
        mode = self.opts.control_mode
        if mode != "explicit":
            # Triton's status (UNAVAILABLE) and text in both modes (clients match on it); in 'none'
            # mode "polling" would mislead, so the mode is named in a hint after it.
            hint = "" if mode == "poll" else (f" (the model control mode is '{mode}': start the server with "
                                               f"--model-control-mode=explicit)")
            e = InvalidRequest("explicit model load / unload is not allowed if polling is enabled" + hint)
            e.status = 503
            raise e

    def _load(self, client: Client, slot: int, msg: LoadModel) -> Answer:
        """Load (or reload) a model; answered when it serves, or why it does not."""
        self._explicit_only()
        name = msg.model
        params = msg.parameters
        unknown = [key for key in params if key != "config" and not key.startswith("file:")]
        if unknown:  # Triton's text (its gRPC refusal; over HTTP it says nothing useful)
            raise InvalidRequest(f"unrecognized load parameter '{unknown[0]}'.")
        config = params.get("config")
        if "config" in params and not isinstance(config, str):  # (null too: Triton refuses it, 500)
            raise InvalidRequest(f"failed to load '{name}', the 'config' parameter must be a JSON string")
        files = {k[len("file:"):]: v for k, v in params.items() if k.startswith("file:")}
        model_dir = None
        # (a local client of the server's user, or a model, already runs as the server's user)
        network = msg.from_network
        if files and network is not None and network != "key" and not self.opts.allow_file_uploads:
            raise UploadsRefused(f"failed to load '{name}', loading a model from 'file:' contents runs the code "
                                 f"sent as the server's user and is not enabled: start the server with "
                                 f"--allow-model-file-uploads, or restrict the model-repository API "
                                 f"(--http-restricted-api, --grpc-restricted-protocol) and send its key")
        if files:
            if config is None:
                raise InvalidRequest(f"failed to load '{name}', model files given with 'file:' need a 'config' "
                                     f"parameter too")
            model_dir = write_model_files(name, files)
        elif self.lifecycle.cloud is not None:  # its folder in the bucket may have changed: sync it first
            self.lifecycle.cloud.request(name, config, (client, slot))
            return 0, None  # answered by start_synced_loads, or when the load it starts is over
        # (a load by name reloads nothing where the folder is as it was: keep_unchanged)
        refused = self.lifecycle.load_model(name, config, waiter=(client, slot), model_dir=model_dir,
                                            keep_unchanged=True)
        if model_dir is not None:  # gone at once unless the load uses it (then: when it retires)
            self.lifecycle.discard_model_dir(str(model_dir))
        if refused is not None:
            return refused.status, {"error": refused.text}
        return 0, None

    def start_synced_loads(self) -> None:
        """Explicit mode with cloud repositories: start the loads whose model folders are synced
        (a client gone meanwhile is not answered, but its load still happens)."""
        assert self.lifecycle.cloud is not None
        clients = self.lifecycle.clients
        for load in self.lifecycle.cloud.take_synced():
            client, slot = load.waiter
            waiter = load.waiter if clients.by_name.get(client.name) is client else None
            status, error = 400, load.error
            if load.cancelled:
                status, error = CANCELLED_STATUS, f"failed to load '{load.name}', {UNLOADED}"
            elif error is None:
                refused = self.lifecycle.load_model(load.name, load.config, waiter=waiter)
                if refused is not None:
                    status, error = refused.status, refused.text
            if error and waiter is not None:
                clients.reply(client, slot, status, {"error": error})

    def _unload(self, client: Client, slot: int, msg: UnloadModel) -> Answer:
        self._explicit_only()
        if self.lifecycle.cloud is not None:
            self.lifecycle.cloud.cancel(msg.model)
        self.lifecycle.unload_model(msg.model, waiter=(client, slot),
                                    dependents=msg.parameters.get("unload_dependents") is True)
        return 0, None

    # -- shared memory --------------------------------------------------------------------------
    def _client_shm(self, named: NetworkCaller | None, client: Client) -> Caller:
        """The caller of a register or unregister (region_access.py), unless --allow-client-shm
        is false: then Triton's refusal."""
        if not self.opts.allow_client_shm:
            raise ClientShmDisabled(CLIENT_SHM_DISABLED)
        return caller_of(named, client)

    def _shm_register(self, client: Client, slot: int, msg: RegisterSystemRegion) -> Answer:
        caller = self._client_shm(msg.caller, client)  # a local client's region is its connection's
        # Only an object named as Client.create_region names it in the client's own process.
        reclaim = caller.owner.connection is not None and msg.created and \
            msg.key.startswith(created_key_prefix(client.ticket))
        self.regions.system.register(msg.name, msg.key, msg.offset, msg.byte_size, caller, reclaim)
        self.regions.publish()
        return 200, {}

    def _shm_unregister(self, client: Client, slot: int, msg: UnregisterSystemRegion) -> Answer:
        """Marks the region leaving; the broker forgets it once no request uses it (before it
        handles the next request if none does), which needs no second call."""
        self.regions.unregister(self.regions.system, msg.name, self._client_shm(msg.caller, client))
        return 200, {}

    def _shm_status(self, client: Client, slot: int, msg: SystemRegionStatus) -> Answer:
        return 200, self.regions.system.status(msg.name)

    def _cuda_register(self, client: Client, slot: int, msg: RegisterCudaRegion) -> Answer:
        self.regions.cuda.register(msg.name, msg.raw_handle, msg.device_id, msg.byte_size,
                                   self._client_shm(msg.caller, client))
        self.regions.publish()
        return 200, {}

    def _cuda_unregister(self, client: Client, slot: int, msg: UnregisterCudaRegion) -> Answer:
        self.regions.unregister(self.regions.cuda, msg.name, self._client_shm(msg.caller, client))
        return 200, {}

    def _cuda_status(self, client: Client, slot: int, msg: CudaRegionStatus) -> Answer:
        return 200, self.regions.cuda.status(msg.name)

    # -- logging extension ----------------------------------------------------------------------
    def _log_settings(self, client: Client, slot: int, msg: LogSettings) -> Answer:
        """GET /v2/logging, or POST with an 'update': applied here, then published to all."""
        if msg.update is not None:
            try:
                new = logs.merge(logs.current(), msg.update)
            except ValueError as e:
                refused = InvalidRequest(str(e))
                refused.status = getattr(e, "status", 400)
                raise refused from None
            logs.configure(new)
            logs.publish(self.seg.settings, logs.current())
            self.journal.set("log", logs.current())
        shown = logs.current()
        if shown["log_file"] and shown["log_file"] == self.opts.log["log_file"]:
            shown["log_file"] = self.opts.log_file_shown  # as the flag named it, as Triton shows it
        return 200, shown

    def _trace_settings(self, client: Client, slot: int, msg: TraceSettings) -> Answer:
        """GET/POST v2[/models/<model>]/trace/setting; a model must exist, as in Triton (whose
        answer here is a 400 with this text)."""
        if msg.model:
            try:
                self._version(msg.model)
            except UnknownModel:
                raise InvalidRequest(f"Request for unknown model : {msg.model}") from None
        answer = self.trace.handle(msg.model, msg.update)
        if msg.update is not None:
            self.journal.set("trace", self.trace.saved())
        return answer



class UploadsRefused(InvalidRequest):
    """A load with 'file:' contents the server does not take (--allow-model-file-uploads): 403."""

    status = 403


class RepositoryPollFailed(InvalidRequest):
    """A path component longer than the file system allows: Triton reports it as a failed poll
    of the model repository, INTERNAL (500), and Triton's own example programs check for that."""

    status = 500


class ServerNotReady(InvalidRequest):
    """The server stops: what Triton answers (UNAVAILABLE, its words) to a repository index then."""

    status = 503

    def __init__(self) -> None:
        super().__init__("Server not ready")


def index_state(mv: ModelVersion, stale: str, catalog: Catalog) -> dict[str, str]:
    """A version's state and reason in the repository index. A loaded version none of whose
    instances serves (each dead or restarting) is UNAVAILABLE until one is back, as its ready
    endpoint says; so is an ensemble while one of its steps is (readiness.py)."""
    if mv.state == State.READY and not mv.live():
        return {"state": State.UNAVAILABLE.value,
                "reason": "no instance serves: every instance is restarting after it exited"}
    blocked = blocked_step(mv, catalog) if mv.state == State.READY and mv.ensemble is not None else None
    if blocked:
        return {"state": State.UNAVAILABLE.value, "reason": blocked}
    return _state(mv.state.value, mv.reason or (stale if mv.state == State.READY else ""))


def _state(state: str, reason: str) -> dict[str, str]:
    """An index entry's state, and its reason only when it has one (Triton leaves an empty one out)."""
    return {"state": state, "reason": reason} if reason else {"state": state}


def unloaded_entries(name: str, catalog: Catalog) -> list[dict[str, str]]:
    """The versions of an unloaded model, which Triton keeps listing: UNLOADING while they drain,
    then UNAVAILABLE with the reason "unloaded"."""
    draining = {r.version.version for r in catalog.retiring if r.version.name == name}
    return [{"name": name, "version": str(v), **(_state(State.UNLOADING.value, "") if v in draining
                                                 else _state(State.UNAVAILABLE.value, "unloaded"))}
            for v in catalog.unloaded[name]]


def write_model_files(name: str, files: dict[str, Any]) -> Path:
    """The 'file:<path>' parameters of a load, as a model folder of its own (Triton's override
    for a model that does not exist in the repository). Paths stay inside the folder."""
    # The name comes from the URL: '..' or '.' would put the folder outside its private temp dir.
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise InvalidRequest(f"failed to load '{name}', a model loaded with 'file:' parameters needs a plain name")
    root = Path(tempfile.mkdtemp(prefix=UPLOAD_PREFIX)) / name
    try:
        for rel, content in files.items():
            path = (root / rel).resolve()
            if not str(path).startswith(str(root.resolve()) + os.sep) or not isinstance(content, str):
                raise InvalidRequest(f"failed to load '{name}', invalid file parameter 'file:{rel}'")
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"failed to load '{name}', 'file:{rel}' is not base64") from None
            try:  # a name too long, a file where a folder must go, ...: the client's mistake
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            except OSError as e:
                reason = f"cannot write 'file:{rel}': {e.strerror}"
                if e.errno == errno.ENAMETOOLONG:
                    raise RepositoryPollFailed(f"failed to load '{name}', failed to poll from model repository: "
                                               f"{reason}") from None
                raise InvalidRequest(f"failed to load '{name}', {reason}") from None
    except BaseException:
        shutil.rmtree(root.parent, ignore_errors=True)  # nothing of a refused load stays behind
        raise
    return root
