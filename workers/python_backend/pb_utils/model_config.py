"""Reading a model's configuration (the dict ``initialize`` gets as JSON) and completing it
(``ModelConfig``, handed to ``TritonPythonModel.auto_complete_config``)."""
from __future__ import annotations

import copy
import json
import numbers
from typing import Any, Mapping, Optional


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Optional[dict]:
    """The ``input`` entry of a model config dict with this name, or None."""
    for entry in model_config.get("input", ()) or ():
        if entry.get("name") == name:
            return entry
    return None


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Optional[dict]:
    """The ``output`` entry of a model config dict with this name, or None."""
    for entry in model_config.get("output", ()) or ():
        if entry.get("name") == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """True when the config sets model_transaction_policy.decoupled."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def _dims_key(dims: Any) -> tuple[int, ...]:
    """Dims as ints, so [4] and ["4"] (protobuf JSON int64) compare equal."""
    return tuple(int(d) for d in (dims or ()))


class ModelConfig:
    """Model configuration handed to ``TritonPythonModel.auto_complete_config``.

    Built by the worker from the config dict (protobuf JSON field names); a
    JSON string is accepted too, as Triton passes one.  The setters follow
    Triton's merge rules: the model may fill in what the config file left
    unspecified, and a conflicting value raises ValueError.
    """

    def __init__(self, model_config: Mapping[str, Any] | str) -> None:
        if isinstance(model_config, (str, bytes)):
            cfg = json.loads(model_config)
        elif isinstance(model_config, Mapping):
            cfg = copy.deepcopy(dict(model_config))
        else:
            raise TypeError("model_config must be a dict or a JSON string")
        # Triton's JSON always carries these (protobuf defaults); the setters
        # rely on them.
        cfg.setdefault("name", "")
        cfg.setdefault("max_batch_size", 0)
        cfg.setdefault("input", [])
        cfg.setdefault("output", [])
        self._model_config: dict[str, Any] = cfg

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The configuration dict (the live object, as in Triton)."""
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set max_batch_size; refuses to go below a non-zero value the
        config file already specified."""
        if not isinstance(max_batch_size, numbers.Integral) or isinstance(max_batch_size, bool):
            raise TypeError("max_batch_size must be an int")
        current = int(self._model_config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in "
                f"auto-complete-config function for model '{self._name}' "
                f"specified max_batch_size {int(max_batch_size)}"
            )
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher unless another scheduler is configured."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries "
                    "to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:  # noqa: A002 - Triton's name
        """Add (or complete) an input: keys name, data_type ("TYPE_FP32"),
        dims (list) and optionally optional.  An input of the same name that
        the config already has is merged; differing data_type, non-empty
        differing dims, or differing optional raise ValueError."""
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add (or complete) an output: keys name, data_type, dims; same merge
        rules as add_input."""
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def _add_tensor(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        self._check_tensor(kind, tensor, allowed)
        entries = self._model_config.setdefault(kind, [])
        for current in entries:
            if current.get("name") == tensor["name"]:
                self._merge_tensor(kind, current, tensor)
                return
        new_entry = dict(tensor)
        new_entry["dims"] = list(tensor["dims"])
        entries.append(new_entry)

    def _check_tensor(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        """The entry has the properties it must and no others."""
        if not isinstance(tensor, Mapping):
            raise TypeError(f"{kind} must be a dict")
        label = f"{kind} '{tensor['name']}'" if "name" in tensor else kind
        extra = [k for k in tensor if k not in allowed]
        if extra:
            raise ValueError(
                f"{label} in auto-complete-config function for model '{self._name}' "
                f"contains property other than {', '.join(repr(a) for a in allowed[:-1])} and {allowed[-1]!r}."
            )
        for prop in ("name", "data_type", "dims"):
            if prop not in tensor:
                raise ValueError(
                    f"{label} in auto-complete-config function for model "
                    f"'{self._name}' is missing '{prop}' property."
                )

    def _merge_tensor(self, kind: str, current: dict[str, Any], tensor: Mapping[str, Any]) -> None:
        """Complete the config's entry ``current`` with the model's; a value both give must agree."""
        cur_type = current.get("data_type", "TYPE_INVALID")
        if cur_type != "TYPE_INVALID" and cur_type != tensor["data_type"]:
            raise ValueError(
                f"unable to load model '{self._name}', configuration expects "
                f"datatype {cur_type} for {kind} '{tensor['name']}', model "
                f"provides {tensor['data_type']}"
            )
        if current.get("dims") and _dims_key(current["dims"]) != _dims_key(tensor["dims"]):
            raise ValueError(
                f"model '{self._name}', tensor '{tensor['name']}': the model "
                f"expects dims {list(tensor['dims'])} but the model configuration "
                f"specifies dims {list(current['dims'])}"
            )
        if ("optional" in current and "optional" in tensor
                and bool(current["optional"]) != bool(tensor["optional"])):
            raise ValueError(
                f"model '{self._name}', tensor '{tensor['name']}': the model "
                f"expects optional {tensor['optional']} but the model "
                f"configuration specifies optional {current['optional']}"
            )
        current["data_type"] = tensor["data_type"]
        current["dims"] = list(tensor["dims"])
        if "optional" in tensor:
            current["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set model_transaction_policy (only 'decoupled'); cannot flip a
        value the config already set."""
        extra = [k for k in transaction_policy_dict if k != "decoupled"]
        if extra:
            raise ValueError(
                "model transaction property in auto-complete-config function for "
                f"model '{self._name}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            new = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != new:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config "
                    f"for model '{self._name}', which is already set to "
                    f"'{policy['decoupled']}'."
                )
            policy["decoupled"] = new

    def __repr__(self) -> str:
        return f"ModelConfig({self._model_config!r})"
