"""How Triton shows a model's configuration: its config endpoints, and the ``model_config`` a
Python model's ``initialize`` gets. Defaults included, int64 as numbers, and what Triton's
normalization fills that the server has no use for. The broker and workers both show configs;
this is the one place that knows how.
"""
from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc.model_config_pb2 import ModelConfig


def _fix_int64(descriptor: Any, value: Any) -> Any:
    """protobuf's JSON writes int64 as strings; Triton writes numbers. Walk the schema and fix."""
    if isinstance(value, list):
        return [_fix_int64(descriptor, v) for v in value]
    if not isinstance(value, dict) or descriptor is None:
        return value
    out = {}
    for key, v in value.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            out[key] = v
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                vf = sub.fields_by_name["value"]
                if vf.type == FieldDescriptor.TYPE_MESSAGE:
                    out[key] = {k: _fix_int64(vf.message_type, x) for k, x in v.items()}
                else:
                    out[key] = v
            else:
                out[key] = _fix_int64(sub, v)
        elif field.cpp_type in (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64):
            out[key] = [int(x) for x in v] if isinstance(v, list) else int(v)
        else:
            out[key] = v
    return out


def to_dict(config: ModelConfig) -> dict:
    """The config as Triton's HTTP API and Python backend show it (defaults included, ints as ints)."""
    try:
        raw = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26
        raw = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                        including_default_value_fields=True)  # type: ignore[call-arg]
    return _fix_int64(ModelConfig.DESCRIPTOR, raw)


# What Triton's normalization puts in a config's optimization policy when it sets none (2.51).
TRITON_OPTIMIZATION = {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                       "output_pinned_memory": {"enable": True}, "gather_kernel_buffer_threshold": 0,
                       "eager_batching": False}


def as_triton_shows(config: dict) -> dict:
    """The config as Triton's config endpoints show it: what its normalization fills and ours
    has no use for (a Python model's file name, the optimization policy's defaults, a dynamic
    batcher's and an Oldest sequence batcher's preferred size of max_batch_size when they name
    none), added to a copy; what the server runs by is left as it is."""
    out = dict(config)
    if config.get("backend") == "python" and not config.get("default_model_filename"):
        out["default_model_filename"] = "model.py"
    if config.get("platform") != "ensemble":
        out["optimization"] = {**TRITON_OPTIMIZATION, **(config.get("optimization") or {})}
    batching = config.get("dynamic_batching")
    max_batch = int(config.get("max_batch_size") or 0)
    if isinstance(batching, dict) and max_batch > 0 and not batching.get("preferred_batch_size"):
        out["dynamic_batching"] = {**batching, "preferred_batch_size": [max_batch]}
    sequences = config.get("sequence_batching")
    oldest = sequences.get("oldest") if isinstance(sequences, dict) else None
    if isinstance(oldest, dict) and max_batch > 0 and not oldest.get("preferred_batch_size"):
        out["sequence_batching"] = {**sequences, "oldest": {**oldest, "preferred_batch_size": [max_batch]}}
    scheduling = config.get("ensemble_scheduling")
    if isinstance(scheduling, dict) and not scheduling.get("max_inflight_requests"):
        # a field of later Triton's (2.51 has none): shown only when set
        out["ensemble_scheduling"] = {k: v for k, v in scheduling.items() if k != "max_inflight_requests"}
    return out


def as_model_sees(config: dict) -> dict:
    """A config in the dict form the server keeps, as Triton gives it to a model's
    ``initialize`` (its completed, normalized form); as it is when it does not parse."""
    try:
        parsed = json_format.ParseDict(config, ModelConfig(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError):
        return config
    return as_triton_shows(to_dict(parsed))


def model_config_json(config: dict) -> str:
    """``args["model_config"]`` of a model's ``initialize``."""
    return json.dumps(as_model_sees(config))
