"""Canary releases: the configured split of unversioned traffic, automatic rollback on the
canary's error rate and p99 latency, manual promote and rollback, and settings changed at run time.
Each test builds its own repository: version 1 is the stable model, version 2 the canary."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import raw_request
from shmserve.shm.client import Client

MODEL = "cm"
STABLE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("V", np.array([self.version], dtype=np.int32))])
                for _ in requests]
"""
FAILING_HALF = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.n = 0

    def execute(self, requests):
        out = []
        for _ in requests:
            self.n += 1
            if self.n % 2:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("canary is broken")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("V", np.array([2], dtype=np.int32))]))
        return out
"""
SLOW = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)  # far above the stable version's p99, even on a loaded host
        return [pb_utils.InferenceResponse([pb_utils.Tensor("V", np.array([2], dtype=np.int32))])
                for _ in requests]
"""


def make_repo(root: Path, canary_code: str, **params: str) -> Path:
    repo = root / "repo"
    model = repo / MODEL
    for v, code in ((1, STABLE), (2, canary_code)):
        (model / str(v)).mkdir(parents=True)
        (model / str(v) / "model.py").write_text(textwrap.dedent(code))
    parameters = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    (model / "config.pbtxt").write_text(textwrap.dedent(f"""
        name: "{MODEL}"
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "V" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        version_policy: {{ all {{ }} }}
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        """) + parameters + "\n")
    return repo


def ask(url: str, version: str = "") -> int:
    """The version that answered an unversioned (or versioned) request."""
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([1], dtype=np.int32))
        return int(client.infer(MODEL, [x], model_version=version).as_numpy("V")[0])
    finally:
        client.close()


def canary_status(server) -> dict:
    raw = raw_request(server.port, "GET", f"/v2/repository/models/{MODEL}/canary")
    assert raw.status == 200, raw
    return raw.json()


def post(server, path: str, body: dict | None = None):
    return raw_request(server.port, "POST", f"/v2/repository/models/{MODEL}/canary{path}",
                       body=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"})


def metrics(server) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60).read().decode()


def success_by_version(server) -> dict[str, int]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats = client.get_inference_statistics(MODEL)["model_stats"]
    finally:
        client.close()
    return {s["version"]: s["inference_stats"]["success"]["count"] for s in stats}


def test_split_follows_the_configured_fraction_over_http_and_the_local_client(server_factory, tmp_path):
    # Both versions are the same model: no automatic decision may interfere with the split.
    server = server_factory.start([make_repo(tmp_path, STABLE, canary_fraction="0.3", canary_max_p99_margin="1000")])
    status = canary_status(server)
    assert status["split"] == {"stable": 1, "canary": 2, "fraction": 0.3}
    seen = collections.Counter(ask(server.url) for _ in range(300))
    with Client(server.id) as local:
        for _ in range(300):
            seen[int(local.infer(MODEL, {"X": np.array([1], dtype=np.int32)})["V"][0])] += 1
    share = seen[2] / 600
    assert 0.23 <= share <= 0.37, seen  # 0.3 +- 3.5 standard deviations
    assert success_by_version(server) == {"1": seen[1], "2": seen[2]}  # per-version statistics agree
    assert {ask(server.url, "1") for _ in range(20)} == {1}  # a named version is never redirected
    assert {ask(server.url, "2") for _ in range(20)} == {2}
    text = metrics(server)
    assert f'shmserve_canary_traffic_fraction{{model="{MODEL}",version="2"}} 0.3' in text
    assert f'shmserve_canary_traffic_fraction{{model="{MODEL}",version="1"}} 0.7' in text


def test_automatic_rollback_on_error_rate(server_factory, tmp_path):
    server = server_factory.start([make_repo(tmp_path, FAILING_HALF, canary_fraction="0.5", canary_window_s="10",
                                             canary_min_requests="20")])
    failures = 0
    deadline = time.monotonic() + 90
    while not canary_status(server)["decisions"]:
        assert time.monotonic() < deadline, "no rollback decision within 90 s"
        try:
            ask(server.url)
        except InferenceServerException as e:
            assert "canary is broken" in e.message()
            failures += 1
    assert failures >= 5
    status = canary_status(server)
    decision = status["decisions"][-1]
    assert decision["action"] == "rollback" and decision["trigger"] == "error_rate"
    assert decision["version"] == 2 and decision["stable"] == 1
    assert status["split"] == {"stable": 1, "canary": None, "fraction": 0.0}
    assert status["rolled_back"] == [2]
    # After the decision every unversioned request goes to the stable version and succeeds.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda _: ask(server.url), range(100))) == {1}
    assert (f'shmserve_canary_decisions{{action="rollback",model="{MODEL}",trigger="error_rate",version="2"}} 1.0'
            in metrics(server))
    assert re.search(r"canary of 'cm': rollback version 2 \(stable 1\), error_rate", server.log())


def test_automatic_rollback_on_p99_latency(server_factory, tmp_path):
    server = server_factory.start([make_repo(tmp_path, SLOW, canary_fraction="0.5", canary_window_s="10",
                                             canary_min_requests="20", canary_max_p99_margin="1.0")])
    deadline = time.monotonic() + 120
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        while not canary_status(server)["decisions"]:
            assert time.monotonic() < deadline, "no rollback decision within 120 s"
            assert set(pool.map(lambda _: ask(server.url), range(10))) <= {1, 2}  # none failed
    decision = canary_status(server)["decisions"][-1]
    assert decision["action"] == "rollback" and decision["trigger"] == "p99_latency", decision
    assert {ask(server.url) for _ in range(30)} == {1}


def test_manual_promote_and_rollback_and_run_time_settings(server_factory, tmp_path):
    server = server_factory.start([make_repo(tmp_path, STABLE)],  # no canary configured
                                  ["--model-control-mode=explicit", "--load-model", MODEL])
    assert canary_status(server)["split"] == {"stable": 2, "canary": None, "fraction": 0.0}
    assert {ask(server.url) for _ in range(20)} == {2}  # as Triton: the newest ready version

    changed = post(server, "", {"fraction": 0.5})
    assert changed.status == 200, changed
    assert changed.json()["split"] == {"stable": 1, "canary": 2, "fraction": 0.5}
    assert {ask(server.url) for _ in range(60)} == {1, 2}

    promoted = post(server, "/promote")
    assert promoted.status == 200, promoted
    assert promoted.json()["split"] == {"stable": 2, "canary": None, "fraction": 0.0}
    assert {ask(server.url) for _ in range(30)} == {2}
    none_left = post(server, "/rollback")
    assert none_left.status == 400 and "no canary in progress" in none_left.json()["error"]

    # Reloading the model keeps the decision: version 2 stays promoted, so no new canary starts.
    client = httpclient.InferenceServerClient(server.url)
    client.load_model(MODEL)
    client.close()
    status = canary_status(server)
    assert status["split"]["canary"] is None and status["promoted"] == 2

    text = metrics(server)
    assert (f'shmserve_canary_decisions{{action="promote",model="{MODEL}",trigger="manual",version="2"}} 1.0'
            in text)


def test_manual_rollback_sends_everything_to_the_stable_version(server_factory, tmp_path):
    server = server_factory.start([make_repo(tmp_path, STABLE, canary_fraction="0.5")])
    assert {ask(server.url) for _ in range(60)} == {1, 2}
    rolled = post(server, "/rollback")
    assert rolled.status == 200, rolled
    assert rolled.json()["rolled_back"] == [2]
    assert rolled.json()["decisions"][-1]["trigger"] == "manual"
    assert {ask(server.url) for _ in range(40)} == {1}
    assert {ask(server.url, "2") for _ in range(5)} == {2}  # still loaded, still addressable by version


def test_bad_canary_settings_are_refused(server_factory, tmp_path):
    server = server_factory.start([make_repo(tmp_path, STABLE)])
    for body, text in (({"fraction": 2}, "[0, 1]"), ({"fraction": "lots"}, "must be a number"),
                       ({"speed": 1}, "unknown canary setting")):
        raw = post(server, "", body)
        assert raw.status == 400 and text in raw.json()["error"], raw
    raw = raw_request(server.port, "POST", f"/v2/repository/models/{MODEL}/canary", body=b"{not json")
    assert raw.status == 400
    assert post(server, "/sideways").status == 404
    raw = raw_request(server.port, "GET", "/v2/repository/models/nope/canary")
    assert raw.status == 404 and "Request for unknown model" in raw.json()["error"]
    assert canary_status(server)["policy"]["fraction"] == 0.0  # nothing changed


def test_bad_canary_parameter_fails_the_load(server_factory, tmp_path):
    repo = make_repo(tmp_path, STABLE, canary_fraction="abc")
    server = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    index = raw_request(server.port, "POST", "/v2/repository/index", body=b"{}").json()
    entry = next(e for e in index if e["name"] == MODEL)
    assert entry["state"] == "UNAVAILABLE"
    assert "failed to load 'cm'" in entry["reason"] and "canary_fraction" in entry["reason"]
    with pytest.raises(InferenceServerException):
        ask(server.url)


def test_a_canary_that_cannot_act_is_named_in_a_warning(server_factory, tmp_path):
    """A misspelt canary setting, which would leave the canary off in silence, is named with the
    setting it is closest to; a fraction on a model whose version policy loads one version says
    that a canary needs two. Both models load and serve."""
    typo = make_repo(tmp_path / "typo", STABLE, canary_fracton="0.1")
    config = typo / MODEL / "config.pbtxt"
    one = make_repo(tmp_path / "one", STABLE, canary_fraction="0.2")
    (one / MODEL / "config.pbtxt").write_text((one / MODEL / "config.pbtxt").read_text()
                                              .replace("version_policy: { all { } }", ""))
    server = server_factory.start([typo], [])
    assert ask(server.url) in (1, 2)
    assert f"model '{MODEL}': parameter 'canary_fracton' is no canary setting and is ignored (did you mean " \
           f"'canary_fraction'?)" in server.log(), config.read_text()
    second = server_factory.start([one], [])
    assert ask(second.url) == 2
    assert f"model '{MODEL}': canary_fraction 0.2 has no effect while its version policy loads 1 version(s)" \
        in second.log()


CANARY_WITH_EXTRA_OUTPUT = STABLE + """
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_output({"name": "CANARY_ONLY", "data_type": "TYPE_INT32", "dims": [1]})
        return auto_complete_model_config
"""


def test_unversioned_metadata_and_config_answer_for_the_stable_version(server_factory, tmp_path):
    """Only inference is split: metadata and config without a version (and so generate, which
    reads the config) describe the stable version every time, while a named version still
    describes itself. The canary declares an output the stable version lacks, to tell them apart."""
    server = server_factory.start([make_repo(tmp_path, CANARY_WITH_EXTRA_OUTPUT, canary_fraction="0.5",
                                             canary_max_p99_margin="1000")])
    assert canary_status(server)["split"] == {"stable": 1, "canary": 2, "fraction": 0.5}

    def outputs(path: str) -> list[str]:
        raw = raw_request(server.port, "GET", path)
        assert raw.status == 200, raw
        return [o["name"] for o in raw.json()["output" if path.endswith("/config") else "outputs"]]

    for _ in range(20):
        assert outputs(f"/v2/models/{MODEL}") == ["V"]
        assert outputs(f"/v2/models/{MODEL}/config") == ["V"]
    assert outputs(f"/v2/models/{MODEL}/versions/2") == ["V", "CANARY_ONLY"]
    assert outputs(f"/v2/models/{MODEL}/versions/2/config") == ["V", "CANARY_ONLY"]
    assert {ask(server.url) for _ in range(60)} == {1, 2}  # inference is still split
