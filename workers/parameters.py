"""A model config's ``parameters``, read as Triton's backends read them: each value a string
(``string_value``), integers and booleans converted with the parameter named when one does not
convert. Shared by the backends that read Triton's keys (onnx_session.py, pytorch_settings.py)."""
from __future__ import annotations

from typing import Any

from .backend import ModelLoadError

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")


class ParameterError(ModelLoadError, ValueError):
    """A parameter's value is not of its kind: the load fails with this text."""


def string_parameters(config: dict[str, Any]) -> dict[str, str]:
    return {k: str((v or {}).get("string_value", "")) for k, v in (config.get("parameters") or {}).items()}


def int_parameter(params: dict[str, str], key: str) -> int:
    """``key``'s integer (0 when unset or empty)."""
    try:
        return int(params.get(key) or 0)
    except ValueError:
        raise ParameterError(f"parameter '{key}': failed to convert '{params[key]}' to an integer") from None


def bool_value(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    raise ParameterError(f"parameter '{key}': failed to convert '{value}' to a boolean")


def bool_parameter(params: dict[str, str], key: str) -> bool | None:
    """``key``'s boolean, None when the config does not set it."""
    return None if key not in params else bool_value(key, params[key])
