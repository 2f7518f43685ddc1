"""Control messages cross from clients to the broker as JSON: each decodes back to the message it
was, and what a client could write that no sender builds (an unknown operation, a missing or
mistyped field, a field no message has) is refused naming it."""
from __future__ import annotations

import orjson
import pytest

from shmserve.shm import control_messages as control

EVERY_KIND = [
    control.ServerReady(), control.ModelReady("m", "2"), control.ModelMetadata("m"), control.ModelConfig("m", "1"),
    control.ModelStatistics(), control.RepositoryIndex(ready=True),
    control.LoadModel("m", {"config": "{}", "file:1/model.py": "eA=="}, from_network="key"),
    control.UnloadModel("m", {"unload_dependents": True}),
    control.RegisterSystemRegion("r", "/key", 64, 8, control.NetworkCaller(1000, True), created=True),
    control.UnregisterSystemRegion(None, control.NetworkCaller(None)), control.SystemRegionStatus("r"),
    control.RegisterCudaRegion("c", "aGFuZGxl", 64, 1, control.NetworkCaller(0)),
    control.UnregisterCudaRegion("c"), control.CudaRegionStatus(),
    control.LogSettings({"log_verbose_level": 1}), control.TraceSettings("m", {"trace_rate": "2"}),
    control.CanaryStatus("m"), control.SetCanary("m", {"fraction": 0.5}), control.PromoteCanary("m", "ok"),
    control.RollBackCanary("m"), control.EdgeReport("http", 3, {"head-timeout": 2, "send-timeout": 1}),
]


def test_every_message_is_listed_and_comes_back_as_it_was_sent():
    assert {type(m) for m in EVERY_KIND} == set(control.MESSAGES.values())
    for message in EVERY_KIND:
        assert control.decode(orjson.loads(message.encode())) == message


@pytest.mark.parametrize("doc, refusal", [
    ({"model": "m"}, "unknown control operation None"),
    ({"op": "drop_tables"}, "unknown control operation 'drop_tables'"),
    ({"op": "model_ready"}, "model_ready: 'model' is missing"),
    ({"op": "model_ready", "model": 5}, "model_ready: 'model' must be a string"),
    ({"op": "repository_index", "ready": 1}, "repository_index: 'ready' must be true or false"),
    ({"op": "shm_register", "name": "r", "key": "/k", "byte_size": -1}, "'byte_size' must be a non-negative integer"),
    ({"op": "edge_report", "protocol": "http", "refusals": {"head": -1}},
     "edge_report: 'refusals' must be a JSON object of non-negative integers"),
    ({"op": "edge_report", "protocol": "http", "refusals": {"head": True}},
     "edge_report: 'refusals' must be a JSON object of non-negative integers"),
    ({"op": "shm_register", "name": "r", "key": "/k", "byte_size": True}, "'byte_size' must be a non-negative"),
    ({"op": "shm_register", "name": "r", "key": "/k", "byte_size": 8, "caller": {"uid": "root"}},
     "'caller' must be a caller (uid, admin)"),
    ({"op": "shm_register", "name": "r", "key": "/k", "byte_size": 8, "caller": {"uid": 0, "sudo": True}},
     "'caller' must be a caller (uid, admin)"),
    ({"op": "load", "model": "m", "parameters": []}, "load: 'parameters' must be a JSON object"),
    ({"op": "log_settings", "update": [1]}, "log_settings: 'update' must be a JSON object"),
    ({"op": "server_ready", "owned": True}, "server_ready: no field 'owned'"),
])
def test_what_no_sender_builds_is_refused_by_name(doc, refusal):
    with pytest.raises(control.MalformedControl) as e:
        control.decode(doc)
    assert refusal in str(e.value)
