"""KServe's model agent against a server started as deploy/kserve/clusterservingruntime.yaml starts it.

The agent (kserve/kserve, pkg/agent/puller.go) serves multi-model InferenceServices: to add a model
it downloads it into the model folder, then POSTs ``{}`` as JSON to
``/v2/repository/models/<name>/load``; to remove one it deletes the folder first, then POSTs ``{}``
to ``.../unload``; only a 200 counts as done. The runtime's explicit mode with ``--load-model=*``
also loads what the storage initializer put in the folder before the server started.
"""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

from conftest import PRODUCT_MODELS, ROOT, TEST_MODELS

RUNTIME = ROOT / "deploy" / "kserve" / "clusterservingruntime.yaml"
SET_BY_THE_TEST = ("--model-repository=", "--http-port=", "--grpc-port=", "--metrics-port=")


def runtime_flags() -> list[str]:
    """The runtime's flags, less the folder and ports each test server gets its own of."""
    (container,) = yaml.safe_load(RUNTIME.read_text())["spec"]["containers"]
    return [a for a in container["args"] if not a.startswith(SET_BY_THE_TEST)]


def agent_post(url: str, path: str) -> tuple[int, bytes]:
    """What the agent sends: POST, Content-Type application/json, body {}."""
    req = urllib.request.Request(f"http://{url}{path}", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def add_sub_over_http_and_grpc(server) -> None:
    a = np.arange(16, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    with server.client() as c:
        np.testing.assert_array_equal(c.infer("add_sub", inputs).as_numpy("OUTPUT1"), np.zeros(16, np.int32))
    ginputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    for i in ginputs:
        i.set_data_from_numpy(a)
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        np.testing.assert_array_equal(g.infer("add_sub", ginputs).as_numpy("OUTPUT0"), 2 * a)


def sleeper(server) -> str:
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    with server.client() as c:
        return c.infer("sleeper", [x]).as_numpy("INSTANCE")[0].decode()


def test_the_agents_load_and_unload_calls(server_factory, tmp_path):
    models = tmp_path / "mnt-models"
    shutil.copytree(PRODUCT_MODELS / "add_sub", models / "add_sub")  # the storage initializer's part
    s = server_factory.start([models], runtime_flags())
    add_sub_over_http_and_grpc(s)

    # Add: download, then load.
    shutil.copytree(TEST_MODELS / "sleeper", models / "sleeper")
    assert agent_post(s.url, "/v2/repository/models/sleeper/load") == (200, b"")
    assert sleeper(s).startswith("sleeper_")
    assert s.http_status("/v2/models/sleeper/ready") == 200

    # Remove: the folder goes first, then the unload.
    shutil.rmtree(models / "sleeper")
    assert agent_post(s.url, "/v2/repository/models/sleeper/unload") == (200, b"")
    assert s.http_status("/v2/models/sleeper/ready") != 200
    index = json.loads(agent_post(s.url, "/v2/repository/index")[1])
    assert {m["name"]: m.get("state") for m in index}.get("sleeper") != "READY", index
    add_sub_over_http_and_grpc(s)  # the others serve on
    assert s.http_status("/v2/health/ready") == 200

    # Added again, as after a TrainedModel is re-created.
    shutil.copytree(TEST_MODELS / "sleeper", models / "sleeper")
    assert agent_post(s.url, "/v2/repository/models/sleeper/load") == (200, b"")
    assert sleeper(s).startswith("sleeper_")

    # A model the agent failed to download (no folder) is not a 200: the agent logs the answer
    # (Triton's 500 "failed to poll from model repository").
    status, body = agent_post(s.url, "/v2/repository/models/missing/load")
    assert status == 500 and b"missing" in body
