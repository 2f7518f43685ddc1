"""Control messages: what a client asks the broker besides inference (health, metadata,
configuration, statistics, the repository, shared-memory regions, log and trace settings,
canaries), one typed structure each, defined here for every side.

A sender (an HTTP or gRPC frontend, a local ``Client``, a model's model-control call) builds one,
and ``Connection.submit`` puts its ``encode``d JSON in the request block, as it puts an
inference's descriptor (``descriptor.py``). The broker ``decode``s it: those bytes lie in the
client's memory, so every field is checked against its type here, and an unknown operation, a
missing or mistyped field or one no message has is refused (``MalformedControl``, a 400).

What a message may say depends on who sends it. ``caller`` (a network peer's uid and admin
key) and ``from_network`` are the frontends' word; the broker drops them from a local client of
another user (server/broker/control.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import orjson


class MalformedControl(ValueError):
    """A control message that is not one of these (the broker answers 400)."""


@dataclasses.dataclass(frozen=True)
class NetworkCaller:
    """Who registers or unregisters a region over HTTP or gRPC: the uid owning the peer's socket
    (None: a peer with no socket on this host, under --allow-remote-shm), and whether the request
    carried the key of a restricted 'shared-memory' group (server/edge/shm_callers.py)."""

    uid: int | None
    admin: bool = False


@dataclasses.dataclass(frozen=True)
class ControlMessage:
    """The base of every message: ``OP`` names it on the wire."""

    OP: ClassVar[str] = ""

    def encode(self) -> bytes:
        # (orjson writes a nested dataclass itself: dataclasses.asdict's deep copy took 20 times as long)
        return orjson.dumps({"op": self.OP, **vars(self)})


@dataclasses.dataclass(frozen=True)
class ServerReady(ControlMessage):
    OP: ClassVar[str] = "server_ready"


@dataclasses.dataclass(frozen=True)
class ModelReady(ControlMessage):
    OP: ClassVar[str] = "model_ready"
    model: str
    version: str = ""


@dataclasses.dataclass(frozen=True)
class ModelMetadata(ControlMessage):
    OP: ClassVar[str] = "model_metadata"
    model: str
    version: str = ""


@dataclasses.dataclass(frozen=True)
class ModelConfig(ControlMessage):
    OP: ClassVar[str] = "model_config"
    model: str
    version: str = ""


@dataclasses.dataclass(frozen=True)
class ModelStatistics(ControlMessage):
    """Every loaded version's (no model), one model's, or one version's."""

    OP: ClassVar[str] = "model_stats"
    model: str = ""
    version: str = ""


@dataclasses.dataclass(frozen=True)
class RepositoryIndex(ControlMessage):
    OP: ClassVar[str] = "repository_index"
    ready: bool = False


@dataclasses.dataclass(frozen=True)
class LoadModel(ControlMessage):
    """Triton's load: ``parameters`` as its request gives them ('config', 'file:<path>' as
    base64). ``from_network``: None from a local client or a model (the server's user already);
    "key" when the restricted model-repository key came with it; "open" otherwise, which may
    not carry 'file:' code without --allow-model-file-uploads."""

    OP: ClassVar[str] = "load"
    model: str
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    from_network: str | None = None


@dataclasses.dataclass(frozen=True)
class UnloadModel(ControlMessage):
    OP: ClassVar[str] = "unload"
    model: str
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)


# Triton's status (UNSUPPORTED: 501) and text for a register or unregister when the server is
# started with --allow-client-shm=false: the broker's answer, and the HTTP frontend's before it
# reads a register's body (Triton refuses before it parses one).
CLIENT_SHM_DISABLED = ("Client shared memory is disabled. Start the server with '--allow-client-shm=true' "
                       "to enable.")


@dataclasses.dataclass(frozen=True)
class RegisterSystemRegion(ControlMessage):
    """``created``: the local client made the object itself (``Client.create_region``), so the
    broker unlinks it if that client dies."""

    OP: ClassVar[str] = "shm_register"
    name: str
    key: str
    byte_size: int
    offset: int = 0
    caller: NetworkCaller | None = None
    created: bool = False


@dataclasses.dataclass(frozen=True)
class UnregisterSystemRegion(ControlMessage):
    """``name`` None: every region the caller may unregister."""

    OP: ClassVar[str] = "shm_unregister"
    name: str | None = None
    caller: NetworkCaller | None = None


@dataclasses.dataclass(frozen=True)
class SystemRegionStatus(ControlMessage):
    OP: ClassVar[str] = "shm_status"
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class RegisterCudaRegion(ControlMessage):
    """``raw_handle``: the CUDA IPC handle, base64."""

    OP: ClassVar[str] = "cuda_register"
    name: str
    raw_handle: str
    byte_size: int
    device_id: int = 0
    caller: NetworkCaller | None = None


@dataclasses.dataclass(frozen=True)
class UnregisterCudaRegion(ControlMessage):
    OP: ClassVar[str] = "cuda_unregister"
    name: str | None = None
    caller: NetworkCaller | None = None


@dataclasses.dataclass(frozen=True)
class CudaRegionStatus(ControlMessage):
    OP: ClassVar[str] = "cuda_status"
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class LogSettings(ControlMessage):
    """The logging extension: ``update`` None asks for the settings, else changes those given."""

    OP: ClassVar[str] = "log_settings"
    update: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class TraceSettings(ControlMessage):
    """The trace extension, the server's settings (no model) or a model's."""

    OP: ClassVar[str] = "trace_settings"
    model: str = ""
    update: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class CanaryStatus(ControlMessage):
    OP: ClassVar[str] = "canary_status"
    model: str


@dataclasses.dataclass(frozen=True)
class SetCanary(ControlMessage):
    OP: ClassVar[str] = "canary_set"
    model: str
    settings: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PromoteCanary(ControlMessage):
    OP: ClassVar[str] = "canary_promote"
    model: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class RollBackCanary(ControlMessage):
    OP: ClassVar[str] = "canary_rollback"
    model: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class EdgeReport(ControlMessage):
    """A frontend's network edge as it stands (server/edge/edge_counts.py): its open connections,
    and what its limits refused or cut since it started, by reason. Sent on its tick when changed;
    the broker serves it as metrics, and takes it from the server's own user only."""

    OP: ClassVar[str] = "edge_report"
    protocol: str
    connections: int = 0
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count


MESSAGES: dict[str, type[ControlMessage]] = {cls.OP: cls for cls in (
    ServerReady, ModelReady, ModelMetadata, ModelConfig, ModelStatistics, RepositoryIndex, LoadModel, UnloadModel,
    RegisterSystemRegion, UnregisterSystemRegion, SystemRegionStatus, RegisterCudaRegion, UnregisterCudaRegion,
    CudaRegionStatus, LogSettings, TraceSettings, CanaryStatus, SetCanary, PromoteCanary, RollBackCanary, EdgeReport)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A field's annotation -> (check of a JSON value, what the refusal says it must be).
_KINDS: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string"),
    "int": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a JSON object"),
    "dict[str, Any] | None": (lambda v: v is None or isinstance(v, dict), "a JSON object"),
    "dict[str, int]": (lambda v: isinstance(v, dict) and all(_is_int(n) and n >= 0 for n in v.values()),
                       "a JSON object of non-negative integers"),
    "NetworkCaller | None": (lambda v: v is None or (isinstance(v, dict) and set(v) <= {"uid", "admin"} and (
        v.get("uid") is None or _is_int(v["uid"])) and isinstance(v.get("admin", False), bool)),
        "a caller (uid, admin)"),
}


def decode(doc: dict[str, Any]) -> ControlMessage:
    """The message a client's JSON object is. Raises MalformedControl naming what is wrong."""
    op = doc.get("op")
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise MalformedControl(f"unknown control operation {op!r}")
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in doc:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise MalformedControl(f"{op}: '{field.name}' is missing")
            continue
        value = doc[field.name]
        check, kind = _KINDS[str(field.type)]
        if not check(value):
            raise MalformedControl(f"{op}: '{field.name}' must be {kind}")
        if field.type == "NetworkCaller | None" and value is not None:
            value = NetworkCaller(value.get("uid"), value.get("admin", False))
        values[field.name] = value
    extra = sorted(set(doc) - {"op"} - set(values) - {f.name for f in dataclasses.fields(cls)})
    if extra:
        raise MalformedControl(f"{op}: no field '{extra[0]}'")
    return cls(**values)
