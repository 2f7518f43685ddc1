"""The model as the server describes it (metadata and config), through the protocol the run uses,
so that the tool needs nothing but the server: the same code reads shmserve and Triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmserve.tools.perf.plan import Target


@dataclass(frozen=True)
class ModelInfo:
    """What the requests depend on: the tensors, the batch limit, sequences and streaming."""

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    max_batch_size: int
    sequence: bool
    decoupled: bool


def describe(target: Target, model: str, version: str) -> ModelInfo:
    """Metadata and config of ``model`` at ``target``; raises when it is not ready."""
    from shmserve.shm.client import ServerUnavailable

    try:
        meta, config = _fetch(target, model, version)
    except ServerUnavailable:  # (names the server's id already)
        raise
    except ConnectionError as exc:  # nothing listens there: say where (tritonclient's HTTP error does not)
        raise RuntimeError(f"cannot reach {target.protocol}:{target.address}: {exc}") from None
    policy = config.get("model_transaction_policy") or {}
    return ModelInfo(
        inputs=[_tensor(e) for e in meta.get("inputs", [])],
        outputs=[_tensor(e) for e in meta.get("outputs", [])],
        max_batch_size=int(config.get("max_batch_size", 0) or 0),
        sequence=bool(config.get("sequence_batching")),
        decoupled=bool(policy.get("decoupled", False)),
    )


def _tensor(entry: dict[str, Any]) -> dict[str, Any]:
    """gRPC's JSON form spells int64 dims as strings: ints, as HTTP gives them."""
    return {"name": entry["name"], "datatype": entry["datatype"], "shape": [int(d) for d in entry["shape"]]}


def _fetch(target: Target, model: str, version: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if target.protocol == "http":
        import tritonclient.http as httpclient

        with httpclient.InferenceServerClient(target.address, connection_timeout=10.0, network_timeout=60.0) as c:
            _ready(c.is_model_ready(model, version), target, model)
            return c.get_model_metadata(model, version), c.get_model_config(model, version)
    if target.protocol == "grpc":
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(target.address) as c:
            _ready(c.is_model_ready(model, version), target, model)
            config = c.get_model_config(model, version, as_json=True)
            return c.get_model_metadata(model, version, as_json=True), config.get("config", config)
    from shmserve.shm.client import Client

    with Client(target.address) as c:
        _ready(c.is_model_ready(model, version), target, model)
        return c.model_metadata(model, version), c.model_config(model, version)


def _ready(ready: bool, target: Target, model: str) -> None:
    if not ready:
        raise RuntimeError(f"model {model!r} is not ready at {target.protocol}:{target.address}")
