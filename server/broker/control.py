"""Control requests (everything that is not an inference): health, metadata, config, repository
index and shared-memory registration. They travel as small JSON documents on the same channel as
inference, so the frontend holds no state of its own.
"""
from __future__ import annotations

import base64
import binascii
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable


from .models import Client, ModelVersion, State
from .regions import CudaRegionRegistry, RegionRegistry
from workers.signature import InvalidRequest

if TYPE_CHECKING:
    from .broker import Broker

Answer = tuple[int, Any]


class ControlHandler:
    def __init__(self, broker: "Broker") -> None:
        self.broker = broker
        self.regions = RegionRegistry()
        self.cuda_regions = CudaRegionRegistry()
        self.ops: dict[str, Callable[[Client, int, dict], Answer]] = {
            "server_ready": self._server_ready,
            "model_ready": self._model_ready,
            "model_metadata": self._model_metadata,
            "model_config": self._model_config,
            "repository_index": self._repository_index,
            "shm_register": self._shm_register,
            "shm_unregister": self._shm_unregister,
            "shm_status": self._shm_status,
            "load": self._load,
            "unload": self._unload,
            "cuda_register": self._cuda_register,
            "cuda_unregister": self._cuda_unregister,
            "cuda_status": self._cuda_status,
        }

    def handle(self, client: Client, slot: int, doc: dict) -> Answer:
        op = self.ops.get(doc.get("op", ""))
        if op is None:
            raise InvalidRequest(f"unknown control operation '{doc.get('op')}'")
        return op(client, slot, doc)

    def forget_client(self, client: Client) -> None:
        self.regions.drop_owner(client.name)

    # -- health and metadata --------------------------------------------------------------------
    def _server_ready(self, client: Client, slot: int, doc: dict) -> Answer:
        return 200, {"ready": self.broker.server_ready()}

    def _version(self, doc: dict) -> ModelVersion:
        return self.broker.find_version(doc["model"], doc.get("version"))

    def _model_ready(self, client: Client, slot: int, doc: dict) -> Answer:
        try:
            self._version(doc)
            return 200, {"ready": True}
        except InvalidRequest:
            return 200, {"ready": False}

    def _model_metadata(self, client: Client, slot: int, doc: dict) -> Answer:
        mv = self._version(doc)
        sig = mv.signature
        assert sig is not None
        versions = [str(v) for v, m in sorted(self.broker.models[mv.name].items()) if m.state == State.READY]

        def tensors(specs: dict) -> list[dict]:
            return [{"name": s.name, "datatype": s.datatype, "shape": sig.full_shape(s)} for s in specs.values()]

        cfg = mv.config_dict
        return 200, {"name": mv.name, "versions": versions,
                     "platform": cfg.get("platform") or cfg.get("backend", ""),
                     "inputs": tensors(sig.inputs), "outputs": tensors(sig.outputs)}

    def _model_config(self, client: Client, slot: int, doc: dict) -> Answer:
        return 200, self._version(doc).config_dict

    def _repository_index(self, client: Client, slot: int, doc: dict) -> Answer:
        b = self.broker
        out = []
        for name in sorted(set(b.model_dirs) | set(b.models) | set(b.load_errors) | set(b.loading)):
            versions = b.models.get(name, {})
            if name in b.loading and not versions:
                versions = b.loading[name].versions
            if versions:
                for v, mv in sorted(versions.items()):
                    out.append({"name": name, "version": str(v), "state": mv.state.value, "reason": mv.reason})
            elif name in b.load_errors:
                out.append({"name": name, "state": State.UNAVAILABLE.value, "reason": b.load_errors[name]})
            else:
                out.append({"name": name})
        if doc.get("ready"):
            out = [e for e in out if e.get("state") == State.READY.value]
        return 200, out

    # -- repository API -------------------------------------------------------------------------
    def _explicit_only(self) -> None:
        mode = self.broker.opts.control_mode
        if mode != "explicit":
            raise InvalidRequest(f"explicit model load / unload is not allowed if model control mode is "
                                 f"'{mode}' (start the server with --model-control-mode=explicit)")

    def _load(self, client: Client, slot: int, doc: dict) -> Answer:
        """Load (or reload) a model; answered when it serves, or why it does not."""
        self._explicit_only()
        name = doc["model"]
        params = doc.get("parameters") or {}
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidRequest(f"failed to load '{name}', the 'config' parameter must be a JSON string")
        files = {k[len("file:"):]: v for k, v in params.items() if k.startswith("file:")}
        model_dir = None
        if files:
            if config is None:
                raise InvalidRequest(f"failed to load '{name}', model files given with 'file:' need a 'config' "
                                     f"parameter too")
            model_dir = write_model_files(name, files)
        error = self.broker.load_model(name, config, waiter=(client, slot), model_dir=model_dir)
        if error:
            return 400, {"error": error}
        return 0, None

    def _unload(self, client: Client, slot: int, doc: dict) -> Answer:
        self._explicit_only()
        params = doc.get("parameters") or {}
        self.broker.unload_model(doc["model"], waiter=(client, slot),
                                 dependents=bool(params.get("unload_dependents", False)))
        return 0, None

    # -- shared memory --------------------------------------------------------------------------
    def _shm_register(self, client: Client, slot: int, doc: dict) -> Answer:
        owner = client.name if doc.get("owned") else None
        self.regions.register(doc["name"], doc["key"], int(doc.get("offset", 0)), int(doc["byte_size"]), owner)
        return 200, {}

    def _shm_unregister(self, client: Client, slot: int, doc: dict) -> Answer:
        self.regions.unregister(doc.get("name"))
        return 200, {}

    def _shm_status(self, client: Client, slot: int, doc: dict) -> Answer:
        return 200, self.regions.status(doc.get("name"))



    def _cuda_register(self, client: Client, slot: int, doc: dict) -> Answer:
        self.cuda_regions.register(doc["name"], doc["raw_handle"], int(doc.get("device_id", 0)),
                                   int(doc["byte_size"]))
        return 200, {}

    def _cuda_unregister(self, client: Client, slot: int, doc: dict) -> Answer:
        self.cuda_regions.unregister(doc.get("name"))
        return 200, {}

    def _cuda_status(self, client: Client, slot: int, doc: dict) -> Answer:
        return 200, self.cuda_regions.status(doc.get("name"))


def write_model_files(name: str, files: dict[str, Any]) -> Path:
    """The 'file:<path>' parameters of a load, as a model folder of its own (Triton's override
    for a model that does not exist in the repository). Paths stay inside the folder."""
    root = Path(tempfile.mkdtemp(prefix="shmserve-model-")) / name
    for rel, content in files.items():
        path = (root / rel).resolve()
        if not str(path).startswith(str(root.resolve()) + os.sep) or not isinstance(content, str):
            raise InvalidRequest(f"failed to load '{name}', invalid file parameter 'file:{rel}'")
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"failed to load '{name}', 'file:{rel}' is not base64") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root
