"""The model loading API (``pb_utils.load_model`` and friends): the repository API's calls, made
from inside a model through the worker's executor."""
from __future__ import annotations

import base64
from typing import Any, Optional

from shmserve.shm.control_messages import ControlMessage, LoadModel, ModelReady, UnloadModel

from . import runtime
from .errors import TritonModelException


def _control(message: ControlMessage) -> Any:
    bls = runtime.executor("the model loading API is only available inside a running model")
    return bls.control(message)


def load_model(model_name: str, config: str = "", files: Optional[dict] = None) -> None:
    """Load (or reload) a model, as the repository API does: ``config`` a JSON model config
    overriding the repository's, ``files`` {"file:<path>": bytes} a model's own files. The server
    must run with --model-control-mode=explicit; raises TritonModelException if the load fails."""
    params: dict[str, Any] = {}
    if config:
        params["config"] = config
    for key, content in (files or {}).items():
        if not isinstance(content, (bytes, bytearray)):
            raise TritonModelException(f"load_model: the content of '{key}' must be bytes")
        params[key] = base64.b64encode(bytes(content)).decode("ascii")
    _control(LoadModel(model_name, params))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (explicit model control mode); raises TritonModelException on refusal."""
    _control(UnloadModel(model_name, {"unload_dependents": unload_dependents}))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    return bool(_control(ModelReady(model_name, str(model_version or "")))["ready"])
