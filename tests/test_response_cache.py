"""Triton's response cache (``--cache-config local,size=<bytes>`` and ``response_cache { enable:
true }``) against real servers and clients: a hit answers without running the model; other bytes,
another shape or other requested outputs miss; eviction takes the least recently used; one cache
serves every process (two HTTP frontends, the local client, two instances of a model); decoupled
and sequence models are refused as Triton refuses them; the statistics extension and the metrics
count hits and misses as Triton does. An ensemble that enables the cache is answered from it
without running a step (nested too), independently of its composing models' caches; one that
reaches a decoupled model is refused as Triton refuses it. (tests/unit/test_response_cache_store.py
covers the store.)
"""
from __future__ import annotations

import http.client
import json
import mmap
import os
import shutil
import signal
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, TESTS, processes_mapping, shm_names, wait_until
from gates import Gate
from shmserve import Client
from shmserve.shm.answer import AnswerCorrupt, decode_answer
from shmserve.shm.liveness import process_ticket
from shmserve.shm.names import object_name
from shmserve.server.cli import parse_args
from test_shared_memory import Regions

CACHE_MODELS = TESTS / "models" / "cache"
LOADED = ["cached", "uncached", "batched", "batched_pair", "ensemble_cached", "ensemble_plain", "ensemble_outer"]


@pytest.fixture(scope="module")
def cache_server(module_factory):
    # The size twice, as Triton's command lines may repeat a setting: the last one counts.
    args = ["--cache-config=local,size=1024", "--cache-config", "local,size=4194304", "--http-workers", "2",
            "--model-control-mode", "explicit"]
    for model in LOADED:
        args += ["--load-model", model]
    return module_factory.start([CACHE_MODELS], args)


@pytest.fixture(scope="module")
def small_cache_server(module_factory):
    """64 KiB through Triton's deprecated flag: room for three of the LRU test's answers."""
    return module_factory.start([CACHE_MODELS], ["--response-cache-byte-size", "65536", "--model-control-mode",
                                                 "explicit", "--load-model", "cached"])


_seeds = iter(range(1, 1 << 20))


def fresh(shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """An input no other test of the module sends."""
    return (np.arange(np.prod(shape), dtype=np.float32) + 1000 * next(_seeds)).reshape(shape)


def infer(server, model: str, x: np.ndarray, outputs: list | None = None, **options) -> httpclient.InferResult:
    client = server.client()
    try:
        t = httpclient.InferInput("X", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        return client.infer(model, [t], outputs=outputs, **options)
    finally:
        client.close()


def stats(server, model: str) -> dict:
    client = server.client()
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def counts(server, model: str) -> dict[str, int]:
    s = stats(server, model)
    inference = s["inference_stats"]
    return {"executions": s["execution_count"], "inferences": s["inference_count"],
            "success": inference["success"]["count"], "hits": inference["cache_hit"]["count"],
            "misses": inference["cache_miss"]["count"]}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def test_a_miss_counts_at_its_lookup_whatever_the_outcome(cache_server):
    """As Triton 2.51 counts misses: a request that misses and then fails is a miss too; its
    error is not stored (Triton 2.51 stores a failure as an empty success), so it misses again."""
    x = fresh()
    before = counts(cache_server, "cached")
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="asked to fail"):
            infer(cache_server, "cached", x, parameters={"fail": True})
    assert delta(before, counts(cache_server, "cached"))["misses"] == 2
    assert delta(before, counts(cache_server, "cached"))["hits"] == 0


def test_a_hit_answers_without_running_the_model(cache_server):
    x = fresh()
    before = counts(cache_server, "cached")
    first = infer(cache_server, "cached", x)
    second = infer(cache_server, "cached", x)
    np.testing.assert_array_equal(first.as_numpy("Y"), x * 2)
    for name in ("Y", "Z"):
        np.testing.assert_array_equal(second.as_numpy(name), first.as_numpy(name))
    # the response parameters are stored too: the pid of the process that ran the model
    assert second.get_response()["parameters"] == first.get_response()["parameters"]
    # As Triton counts: both succeeded, one ran (one inference, one execution), one hit, one miss.
    assert delta(before, counts(cache_server, "cached")) == \
        {"executions": 1, "inferences": 1, "success": 2, "hits": 1, "misses": 1}


def test_an_answer_without_a_requested_output_is_stored_as_it_is(cache_server):
    """A model that leaves out an output the request named is answered without it, and so is
    the next request, from the cache, as in Triton (storing it used to kill the worker, failing
    its whole batch)."""
    x = fresh()
    both = [httpclient.InferRequestedOutput("Y"), httpclient.InferRequestedOutput("Z")]
    before = counts(cache_server, "cached")
    for _ in range(2):
        result = infer(cache_server, "cached", x, outputs=both, parameters={"omit_z": True})
        assert [o["name"] for o in result.get_response()["outputs"]] == ["Y"]
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)
    assert delta(before, counts(cache_server, "cached")) == {"executions": 1, "inferences": 1, "success": 2,
                                                           "hits": 1, "misses": 1}


def test_a_stored_answer_scribbled_on_is_a_miss_and_the_model_runs(cache_server):
    """The cache lies in memory every worker writes. An entry whose stored answer no longer reads
    (here its descriptor, after its first two bytes, overwritten) is a miss: the model runs and answers,
    and the next identical request is a hit again. Before, the worker parsed whatever was there."""
    x = fresh()
    first = infer(cache_server, "cached", x)
    y = first.as_numpy("Y").tobytes()
    with open(f"/dev/shm/{object_name(cache_server.id, 'cache', 0)}", "r+b") as f, \
            mmap.mmap(f.fileno(), 0) as mm:
        view = memoryview(mm)
        try:
            at = mm.find(y)
            starts = [i for i in range(max(0, at - 512), at)  # the answer whose data starts with Y
                      if _data_start(view, i) == at]
            assert at > 0 and len(starts) == 1, (at, starts)
            view[starts[0] + 2:_data_start(view, starts[0])] = b"\xff" * (_data_start(view, starts[0]) - starts[0] - 2)
        finally:
            view.release()
    before = counts(cache_server, "cached")
    again = infer(cache_server, "cached", x)
    np.testing.assert_array_equal(again.as_numpy("Y"), x * 2)
    third = infer(cache_server, "cached", x)
    np.testing.assert_array_equal(third.as_numpy("Z"), first.as_numpy("Z"))
    assert delta(before, counts(cache_server, "cached")) == \
        {"executions": 1, "inferences": 1, "success": 2, "hits": 1, "misses": 1}


def _data_start(view: memoryview, offset: int) -> int | None:
    try:
        return decode_answer(view, offset, offset + 512)[1]
    except AnswerCorrupt:
        return None


def test_other_bytes_shape_or_outputs_miss(cache_server):
    x = fresh((2, 3))
    y_only = [httpclient.InferRequestedOutput("Y")]
    both = [httpclient.InferRequestedOutput("Y"), httpclient.InferRequestedOutput("Z")]
    variants = [(x, None), (x + 0.5, None), (x.reshape(3, 2), None), (x, y_only)]
    before = counts(cache_server, "cached")
    for data, outputs in variants:
        result = infer(cache_server, "cached", data, outputs)
        np.testing.assert_array_equal(result.as_numpy("Y"), data * 2)  # (3, 2) answered as (3, 2)
    assert delta(before, counts(cache_server, "cached"))["executions"] == len(variants)
    for data, outputs in variants:  # each is now stored under its own key
        result = infer(cache_server, "cached", data, outputs)
        np.testing.assert_array_equal(result.as_numpy("Y"), data * 2)
        assert (result.as_numpy("Z") is None) == (outputs is y_only)
    # Naming every output asks for what naming none does; request parameters are not part of the
    # key, as in Triton.
    infer(cache_server, "cached", x, both)
    infer(cache_server, "cached", x, parameters={"note": "not in the key"})
    assert delta(before, counts(cache_server, "cached")) == \
        {"executions": 4, "inferences": 4, "success": 10, "hits": 6, "misses": 4}


def test_a_hit_is_classified_like_an_answer_of_the_model(cache_server):
    """The cache holds the model's outputs; classification is applied to a hit as to a run."""
    x = np.array([[1.0, 4.0, 2.0, 3.0]], dtype=np.float32) + next(_seeds)
    top2 = [httpclient.InferRequestedOutput("Y", class_count=2)]
    raw = infer(cache_server, "cached", x, [httpclient.InferRequestedOutput("Y")])  # stored
    before = counts(cache_server, "cached")
    classified = infer(cache_server, "cached", x, top2)
    assert delta(before, counts(cache_server, "cached"))["hits"] == 1
    expected = infer(cache_server, "uncached", x, top2)
    np.testing.assert_array_equal(classified.as_numpy("Y"), expected.as_numpy("Y"))
    assert classified.as_numpy("Y").shape != raw.as_numpy("Y").shape


@pytest.mark.parametrize("model", ["batched", "batched_pair"])
def test_in_a_batch_hits_are_answered_and_misses_run_together(cache_server, model):
    """One instance batching its own lanes, or two batched by the broker: of three requests
    sent together, the one stored is answered from the cache, the other two run as one batch
    (the batcher waits up to 1 s for them)."""
    a, b, c = (fresh((1, 4)) for _ in range(3))
    infer(cache_server, model, a)
    before = counts(cache_server, model)
    pairs_before = _batches_of(stats(cache_server, model), 2)
    client = httpclient.InferenceServerClient(cache_server.url, concurrency=3)
    try:
        pending = []
        for x in (a, b, c):
            t = httpclient.InferInput("X", [1, 4], "FP32")
            t.set_data_from_numpy(x)
            pending.append((x, client.async_infer(model, [t])))
        for x, request in pending:
            np.testing.assert_array_equal(request.get_result().as_numpy("Y"), x * 2)
    finally:
        client.close()
    after = stats(cache_server, model)
    assert delta(before, counts(cache_server, model)) == \
        {"executions": 1, "inferences": 2, "success": 3, "hits": 1, "misses": 2}
    assert _batches_of(after, 2) == pairs_before + 1


def _batches_of(model_stats: dict, size: int) -> int:
    return sum(b["compute_infer"]["count"] for b in model_stats["batch_stats"] if b["batch_size"] == size)


def test_one_cache_for_frontends_local_clients_and_instances(cache_server, tmp_path):
    """A request first sent over HTTP is a hit through the local client on the other instance
    of the model, and over HTTP through each of the two frontends."""
    x = fresh()
    marks = Gate(tmp_path / "marks")
    marks.open()  # only marks which process ran what
    before = counts(cache_server, "cached")
    first = infer(cache_server, "cached", x, parameters={"gate": marks.param})
    [ran_x] = marks.started()
    assert first.get_response()["parameters"]["pid"] == ran_x

    # The local client sends each request to the instance where it has fewest requests in flight
    # (the first one on a tie). Held executions steer its request for x to the instance that did
    # not run x.
    held = Gate(tmp_path / "held")
    with Client(cache_server.id) as local:
        holding = [local.infer_async("cached", {"X": fresh()}, parameters={"gate": held.param})]
        if held.wait_started(1)[0] != ran_x:  # the first instance is not x's: hold x's too
            holding.append(local.infer_async("cached", {"X": fresh()}, parameters={"gate": held.param}))
            assert held.wait_started(2)[1] == ran_x
        again = local.infer_async("cached", {"X": x})  # to the held instance that is not x's
        held.open()
        result = again.result(timeout=60)
        np.testing.assert_array_equal(result["Y"], x * 2)
        assert result.parameters["pid"] == ran_x  # the stored answer
        for h in holding:
            h.result(timeout=60)
    ran = len(holding)

    for frontend in _frontends(cache_server):
        body = _json_request(x, http_port=cache_server.port, only=frontend, others=_frontends(cache_server))
        y = next(o for o in body["outputs"] if o["name"] == "Y")
        np.testing.assert_array_equal(np.array(y["data"], np.float32).reshape(x.shape), x * 2)
        assert body["parameters"]["pid"] == ran_x
    assert delta(before, counts(cache_server, "cached")) == \
        {"executions": 1 + ran, "inferences": 1 + ran, "success": 4 + ran, "hits": 3, "misses": 1 + ran}


def _frontends(server) -> list[int]:
    return sorted(pid for pid, title in server.titles().items() if title.startswith(f"shmserve frontend {server.id} "))


def _json_request(x: np.ndarray, http_port: int, only: int, others: list[int]) -> dict:
    """A KServe v2 JSON request accepted by the frontend ``only``: the others are stopped while
    the connection is made and answered (they share the listening socket)."""
    stopped = [pid for pid in others if pid != only]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        body = json.dumps({"inputs": [{"name": "X", "shape": list(x.shape), "datatype": "FP32",
                                       "data": x.reshape(-1).tolist()}]})
        conn.request("POST", "/v2/models/cached/infer", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        answer = json.loads(response.read())
        conn.close()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    return answer


def test_a_model_without_response_cache_is_not_cached(cache_server):
    x = fresh()
    before = counts(cache_server, "uncached")
    for _ in range(2):
        infer(cache_server, "uncached", x)
    assert delta(before, counts(cache_server, "uncached")) == \
        {"executions": 2, "inferences": 2, "success": 2, "hits": 0, "misses": 0}


def test_the_global_cache_gauges_are_tritons(cache_server):
    """Triton's global nv_cache_* gauges (names, words, types as 2.51's): the cache's own counts,
    over every model and ensemble that uses it."""
    def gauges() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{cache_server.metrics_port}/metrics", timeout=5).read()
        out = {}
        for line in text.decode().splitlines():
            if line.startswith("nv_cache_") and "{" not in line:
                name, value = line.split(" ")
                out[name] = float(value)
        assert "# TYPE nv_cache_num_lookups gauge" in text.decode()
        assert "# HELP nv_cache_util Cache utilization [0.0 - 1.0]" in text.decode()
        return out

    before = gauges()
    x = fresh()
    for _ in range(3):
        infer(cache_server, "cached", x)
    after = gauges()
    assert after["nv_cache_num_lookups"] - before["nv_cache_num_lookups"] == 3
    assert after["nv_cache_num_hits"] - before["nv_cache_num_hits"] == 2
    assert after["nv_cache_num_misses"] - before["nv_cache_num_misses"] == 1
    assert after["nv_cache_num_lookups"] == after["nv_cache_num_hits"] + after["nv_cache_num_misses"]
    assert after["nv_cache_num_entries"] >= 1 and 0 < after["nv_cache_util"] <= 1
    assert after["nv_cache_insertion_duration"] > 0 and after["nv_cache_lookup_duration"] > 0
    assert set(after) == {"nv_cache_num_entries", "nv_cache_num_lookups", "nv_cache_num_hits", "nv_cache_num_misses",
                          "nv_cache_num_evictions", "nv_cache_lookup_duration", "nv_cache_insertion_duration",
                          "nv_cache_util"}


def test_metrics_count_hits_and_misses_per_model(cache_server):
    x = fresh()
    infer(cache_server, "cached", x)
    infer(cache_server, "cached", x)
    text = urllib.request.urlopen(f"http://127.0.0.1:{cache_server.metrics_port}/metrics", timeout=5).read().decode()
    s = stats(cache_server, "cached")["inference_stats"]
    labels = '{model="cached",version="1"}'
    assert f"nv_cache_num_hits_per_model{labels} {float(s['cache_hit']['count'])}" in text
    assert f"nv_cache_num_misses_per_model{labels} {float(s['cache_miss']['count'])}" in text
    assert f"nv_cache_hit_duration_per_model{labels} {float(s['cache_hit']['ns'] // 1000)}" in text
    assert f"nv_cache_miss_duration_per_model{labels} {float(s['cache_miss']['ns'] // 1000)}" in text
    assert "# HELP nv_cache_miss_duration_per_model Total cache miss (insert+lookup) duration per model, in " \
           "microseconds" in text
    assert s["cache_hit"]["ns"] > 0 and s["cache_miss"]["ns"] > 0
    # as Triton: the families list only the models that use the cache
    assert 'nv_cache_num_hits_per_model{model="uncached"' not in text
    assert 'nv_cache_num_hits_per_model{model="batched",version="1"}' in text


def test_an_ensemble_hit_runs_no_step(cache_server):
    """ensemble_cached: cached (which caches its own answers) then uncached. The repeated
    request is answered by the broker from the cache: no step model sees it."""
    x = fresh()
    models = ("ensemble_cached", "cached", "uncached")
    before = {m: counts(cache_server, m) for m in models}
    first = infer(cache_server, "ensemble_cached", x)
    second = infer(cache_server, "ensemble_cached", x)
    np.testing.assert_array_equal(first.as_numpy("Y"), x * 4)
    np.testing.assert_array_equal(first.as_numpy("Z"), x + 1)
    assert second.get_response() == first.get_response()
    for name in ("Y", "Z"):
        np.testing.assert_array_equal(second.as_numpy(name), first.as_numpy(name))
    after = {m: counts(cache_server, m) for m in models}
    # As Triton counts an ensemble: two successes, one miss (run and stored: one execution of its
    # batch), one hit (no execution).
    assert delta(before["ensemble_cached"], after["ensemble_cached"]) == \
        {"executions": 1, "inferences": 1, "success": 2, "hits": 1, "misses": 1}
    # The steps ran for the first request only.
    assert delta(before["cached"], after["cached"]) == \
        {"executions": 1, "inferences": 1, "success": 1, "hits": 0, "misses": 1}
    assert delta(before["uncached"], after["uncached"]) == \
        {"executions": 1, "inferences": 1, "success": 1, "hits": 0, "misses": 0}


def test_an_ensemble_hit_is_classified_like_its_answer(cache_server):
    """The ensemble's cache holds its outputs; the broker classifies a hit as it does a run."""
    x = np.array([[1.0, 4.0, 2.0, 3.0]], dtype=np.float32) + next(_seeds)
    top2 = [httpclient.InferRequestedOutput("Y", class_count=2)]
    infer(cache_server, "ensemble_cached", x, [httpclient.InferRequestedOutput("Y")])  # stored
    before = counts(cache_server, "ensemble_cached")
    classified = infer(cache_server, "ensemble_cached", x, top2)
    assert delta(before, counts(cache_server, "ensemble_cached"))["hits"] == 1
    expected = infer(cache_server, "uncached", x * 2, top2)  # the ensemble's Y is uncached's of 2 X
    assert classified.as_numpy("Y").tolist() == expected.as_numpy("Y").tolist()
    assert classified.as_numpy("Y").shape == (2,)


def test_an_ensemble_s_other_inputs_or_outputs_miss(cache_server):
    x = fresh((2, 3))
    y_only = [httpclient.InferRequestedOutput("Y")]
    z_then_y = [httpclient.InferRequestedOutput("Z"), httpclient.InferRequestedOutput("Y")]
    variants = [(x, None), (x + 0.5, None), (x.reshape(3, 2), None), (x, y_only)]
    before = {m: counts(cache_server, m) for m in ("ensemble_cached", "uncached")}
    for data, outputs in variants:
        np.testing.assert_array_equal(infer(cache_server, "ensemble_cached", data, outputs).as_numpy("Y"), data * 4)
    for data, outputs in variants:  # each is now stored under its own key
        result = infer(cache_server, "ensemble_cached", data, outputs)
        np.testing.assert_array_equal(result.as_numpy("Y"), data * 4)
        assert (result.as_numpy("Z") is None) == (outputs is y_only)
    # Naming every output, in any order, asks for what naming none does: a hit, answered in the
    # order asked.
    both = infer(cache_server, "ensemble_cached", x, z_then_y)
    assert [o["name"] for o in both.get_response()["outputs"]] == ["Z", "Y"]
    np.testing.assert_array_equal(both.as_numpy("Z"), x + 1)
    assert delta(before["ensemble_cached"], counts(cache_server, "ensemble_cached")) == \
        {"executions": 4, "inferences": 4, "success": 9, "hits": 5, "misses": 4}  # (each miss a run)
    assert delta(before["uncached"], counts(cache_server, "uncached"))["executions"] == len(variants)


def test_after_a_reload_neither_the_model_nor_an_ensemble_over_it_answers_from_before(server_factory, tmp_path):
    """A model reloaded with other files, and a new version of it, answer anew, as does an
    ensemble whose step reaches them: no answer of the previous load comes from the cache
    (Triton's key has no load and serves them)."""
    repo = tmp_path / "repo"
    for model in ("cached", "uncached", "ensemble_cached"):
        shutil.copytree(CACHE_MODELS / model, repo / model, ignore=shutil.ignore_patterns("__pycache__"))
    server = server_factory.start([repo], ["--cache-config", "local,size=1048576", "--model-control-mode",
                                           "explicit", "--load-model", "ensemble_cached"])
    x = fresh()
    assert infer(server, "cached", x).as_numpy("Y").tolist() == (2 * x).tolist()
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (4 * x).tolist()
    source = repo / "cached" / "1" / "model.py"
    source.write_text(source.read_text().replace("x * 2", "x * 3.0"))  # (another size: no stale bytecode)
    client = server.client()
    try:
        client.load_model("cached")
    finally:
        client.close()
    before = counts(server, "ensemble_cached")
    assert infer(server, "cached", x).as_numpy("Y").tolist() == (3 * x).tolist()
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (6 * x).tolist()
    assert delta(before, counts(server, "ensemble_cached"))["hits"] == 0
    # the step's latest version now (without version 1's bytecode: its source's mtime, kept there in
    # whole seconds, can be this second's, and the new source has the same size)
    shutil.copytree(repo / "cached" / "1", repo / "cached" / "2", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "cached" / "2" / "model.py").write_text(source.read_text().replace("x * 3.0", "x * 5.0"))
    client = server.client()
    try:
        client.load_model("cached")
    finally:
        client.close()
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (10 * x).tolist()
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (10 * x).tolist()  # a hit again
    assert delta(before, counts(server, "ensemble_cached"))["hits"] == 1


def test_an_ensemble_over_a_canary_split_is_not_answered_from_the_canary_after_a_rollback(server_factory, tmp_path):
    """An unversioned step whose model sends its traffic to a canary draws its version per call:
    the ensemble's key cannot say which version answered, so such requests are not cached. They
    were, under the stable version's load, and a rolled-back canary's answers were served on."""
    repo = tmp_path / "repo"
    for model in ("cached", "uncached", "ensemble_cached"):
        shutil.copytree(CACHE_MODELS / model, repo / model, ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / "cached" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 2", "count: 1") + (
        'version_policy: { latest { num_versions: 2 } }\n'
        'parameters { key: "canary_fraction" value: { string_value: "1" } }\n'))
    shutil.copytree(repo / "cached" / "1", repo / "cached" / "2")
    source = repo / "cached" / "2" / "model.py"
    source.write_text(source.read_text().replace("x * 2", "x * 5.0"))  # the canary: Y = 5 X
    server = server_factory.start([repo], ["--cache-config", "local,size=1048576", "--model-control-mode",
                                           "explicit", "--load-model", "ensemble_cached"])
    x = fresh()
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (10 * x).tolist()  # (on the canary)
    request = urllib.request.Request(f"http://{server.url}/v2/repository/models/cached/canary/rollback",
                                     data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
    assert infer(server, "ensemble_cached", x).as_numpy("Y").tolist() == (4 * x).tolist()  # the stable version's


def test_an_ensemble_without_response_cache_is_not_cached(cache_server):
    """ensemble_plain has ensemble_cached's steps and no response_cache of its own: on a server
    with a cache, every request runs its steps; its first step's model still uses its own cache."""
    x = fresh()
    models = ("ensemble_plain", "cached", "uncached")
    before = {m: counts(cache_server, m) for m in models}
    for _ in range(2):
        np.testing.assert_array_equal(infer(cache_server, "ensemble_plain", x).as_numpy("Y"), x * 4)
    after = {m: counts(cache_server, m) for m in models}
    assert delta(before["ensemble_plain"], after["ensemble_plain"]) == \
        {"executions": 2, "inferences": 2, "success": 2, "hits": 0, "misses": 0}
    assert delta(before["cached"], after["cached"]) == \
        {"executions": 1, "inferences": 1, "success": 2, "hits": 1, "misses": 1}
    assert delta(before["uncached"], after["uncached"])["executions"] == 2


def test_a_nested_ensemble_is_answered_from_its_cache(cache_server):
    """ensemble_outer, without a cache, has ensemble_cached as its step: as in Triton, the
    nested ensemble's request is looked up like any request to it."""
    x = fresh()
    models = ("ensemble_outer", "ensemble_cached", "uncached")
    before = {m: counts(cache_server, m) for m in models}
    first = infer(cache_server, "ensemble_outer", x)
    second = infer(cache_server, "ensemble_outer", x)
    np.testing.assert_array_equal(first.as_numpy("Y"), x * 4)
    assert second.get_response() == first.get_response()
    after = {m: counts(cache_server, m) for m in models}
    assert delta(before["ensemble_outer"], after["ensemble_outer"]) == \
        {"executions": 2, "inferences": 2, "success": 2, "hits": 0, "misses": 0}
    assert delta(before["ensemble_cached"], after["ensemble_cached"]) == \
        {"executions": 1, "inferences": 1, "success": 2, "hits": 1, "misses": 1}
    assert delta(before["uncached"], after["uncached"])["executions"] == 1


def test_an_ensemble_hit_fills_the_client_s_output_region(cache_server):
    x = fresh()
    infer(cache_server, "ensemble_cached", x)  # stored
    regions = Regions(cache_server)
    try:
        region = regions.make("ens_out", x.nbytes)
        out = httpclient.InferRequestedOutput("Y")
        out.set_shared_memory("ens_out", x.nbytes)
        before = counts(cache_server, "ensemble_cached")
        result = infer(cache_server, "ensemble_cached", x, [out])
        assert delta(before, counts(cache_server, "ensemble_cached"))["hits"] == 0  # only Y asked: another key
        again = infer(cache_server, "ensemble_cached", x, [out])
        assert delta(before, counts(cache_server, "ensemble_cached"))["hits"] == 1
        for answer in (result, again):
            assert answer.get_output("Y")["parameters"]["shared_memory_region"] == "ens_out"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, list(x.shape)), x * 4)
    finally:
        regions.close()


def test_metrics_count_an_ensemble_s_hits_and_misses(cache_server):
    x = fresh()
    for _ in range(2):
        infer(cache_server, "ensemble_cached", x)
    text = urllib.request.urlopen(f"http://127.0.0.1:{cache_server.metrics_port}/metrics", timeout=5).read().decode()
    s = stats(cache_server, "ensemble_cached")["inference_stats"]
    labels = '{model="ensemble_cached",version="1"}'
    assert f"nv_cache_num_hits_per_model{labels} {float(s['cache_hit']['count'])}" in text
    assert f"nv_cache_num_misses_per_model{labels} {float(s['cache_miss']['count'])}" in text
    assert s["cache_hit"]["count"] > 0 and s["cache_miss"]["count"] > 0
    assert 'nv_cache_num_hits_per_model{model="ensemble_plain"' not in text


@pytest.mark.parametrize("model", ["refused_decoupled_ensemble", "refused_nested_decoupled"])
def test_an_ensemble_reaching_a_decoupled_model_is_refused_with_the_cache(cache_server, model):
    """Triton marks an ensemble decoupled when a model its steps reach is, then refuses its
    response_cache as any decoupled model's. The same ensemble without the cache loads."""
    client = cache_server.client()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.load_model(model)
        assert (f"Response Cache does not currently support model {model} with 'decoupled' transaction policy. "
                f"Please disable the response cache.") in str(e.value)
        assert not client.is_model_ready(model)
        client.load_model("decoupled_pipeline")
        assert client.is_model_ready("decoupled_pipeline")
    finally:
        client.close()


@pytest.mark.parametrize("model,words", [
    ("refused_decoupled", "Response Cache does not currently support model refused_decoupled with 'decoupled' "
                          "transaction policy. Please disable the response cache."),
    ("refused_sequence", "Response Cache does not currently support model refused_sequence with sequence "
                         "batching scheduler. Please disable the response cache."),
])
def test_decoupled_and_sequence_models_are_refused_at_load(cache_server, model, words):
    client = cache_server.client()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.load_model(model)
        assert words in str(e.value)
        assert not client.is_model_ready(model)
    finally:
        client.close()


def test_the_cache_size_in_use_is_the_last_one_given(cache_server):
    assert "response cache 'local': 4194304 bytes" in cache_server.log()


LRU_ELEMENTS = 4000  # three such answers fit in the 64 KiB cache, four do not


def test_the_least_recently_used_answer_is_evicted(small_cache_server):
    y_only = [httpclient.InferRequestedOutput("Y")]
    a, b, c, d = (fresh((1, LRU_ELEMENTS)) for _ in range(4))
    for x in (a, b, c, a, d):  # a is used again after b and c: b is the least recently used
        infer(small_cache_server, "cached", x, y_only)
    before = counts(small_cache_server, "cached")
    for x in (c, a, d):
        infer(small_cache_server, "cached", x, y_only)
    assert delta(before, counts(small_cache_server, "cached"))["hits"] == 3
    np.testing.assert_array_equal(infer(small_cache_server, "cached", b, y_only).as_numpy("Y"), b * 2)
    assert delta(before, counts(small_cache_server, "cached")) == \
        {"executions": 1, "inferences": 1, "success": 4, "hits": 3, "misses": 1}
    assert "'--response-cache-byte-size' has been deprecated!" in small_cache_server.log()


def test_an_answer_larger_than_the_cache_is_not_stored(small_cache_server):
    x = fresh((1, 20000))  # 80 KB of output
    before = counts(small_cache_server, "cached")
    for _ in range(2):
        np.testing.assert_array_equal(infer(small_cache_server, "cached", x).as_numpy("Y"), x * 2)
    assert delta(before, counts(small_cache_server, "cached")) == \
        {"executions": 2, "inferences": 2, "success": 2, "hits": 0, "misses": 2}
    assert "does not fit in the response cache" in small_cache_server.log()


@pytest.mark.parametrize("flags,words", [
    (["--cache-config", "local"], "No cache specified. --cache-config option format is <cache name>,<setting>=<value>. "
                                  "Got local"),
    (["--cache-config", "local,size"], "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size"),
    (["--cache-config", "local,size="], "--cache-config option format is"),
    (["--cache-config", "local,size=4096", "--cache-config", "redis,host=localhost"],
     "found multiple cache configurations, but only a single cache is currently supported"),
    (["--cache-config", "redis,host=localhost"], "'local' cache only"),
    (["--cache-config", "local,max=4096"], "Failed to initialize LocalCache: config didn't contain a valid 'size' field."),
    (["--cache-config", "local,size=lots"], "Failed to initialize LocalCache: 'size' must be a number of bytes"),
    (["--cache-config", "local,size=100"], "too small"),
    (["--cache-config", "local,size=4096", "--response-cache-byte-size", "4096"],
     "Error: Incompatible flags --response-cache-byte-size and --cache-config both provided."),
    (["--response-cache-byte-size", "0"], "Failed to initialize LocalCache: a size of 0 bytes is too small"),
], ids=["no-cache-name", "no-value", "empty-value", "two-caches", "other-cache", "no-size", "size-text", "too-small",
        "both-flags", "old-flag-zero"])
def test_bad_cache_flags_are_refused_with_triton_s_words(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-repository", str(tmp_path), *flags])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_cache_flags_give_the_size_in_bytes(tmp_path):
    repo = ["--model-repository", str(tmp_path)]
    assert parse_args(repo).response_cache_bytes == 0
    assert parse_args([*repo, "--cache-config=local,size=1048576"]).response_cache_bytes == 1048576
    args = parse_args([*repo, "--cache-config", "local,size=2048", "--cache-config", "local,policy=lru",
                       "--cache-directory", "/opt/tritonserver/caches"])
    assert args.response_cache_bytes == 2048
    assert [line for _, line in args.notices if "policy" in line or "--cache-directory" in line] == [
        "--cache-directory /opt/tritonserver/caches: the local cache is built in; no cache library is loaded",
        "--cache-config local,policy=lru: the local cache has no setting 'policy'; ignored"]


def test_an_input_region_deleted_under_a_cached_ensemble_fails_its_request_only(cache_server):
    """A client that unlinks a registered region's object and then names it as an input of a
    cached ensemble gets an error for that request; the broker, which reads the input to key it,
    serves on."""
    x = fresh()
    broker = [pid for pid, title in cache_server.titles().items() if title.startswith("shmserve broker")]
    regions = Regions(cache_server)
    client = cache_server.client()
    try:
        handle, key = regions.create("gone_in", x.nbytes)
        regions.register("gone_in", key, x.nbytes)
        regions.destroy(key)  # unlinked, still registered
        t = httpclient.InferInput("X", list(x.shape), "FP32")
        t.set_shared_memory("gone_in", x.nbytes)
        with pytest.raises(InferenceServerException) as e:
            client.infer("ensemble_cached", [t])
        assert e.value.status() == "400", e.value
        np.testing.assert_array_equal(infer(cache_server, "ensemble_cached", x).as_numpy("Y"), x * 4)
        assert [pid for pid, title in cache_server.titles().items() if title.startswith("shmserve broker")] == broker
    finally:
        client.close()
        regions.close()


def test_no_process_keeps_a_departed_clients_arena_an_ensemble_read(cache_server):
    """To key a request to a cached ensemble the broker reads the client's arena, and the first
    step's worker reads its inputs there too; once the client leaves, no server process keeps
    that memory mapped (a later client of the same name is read anew)."""
    stem = f"shmserve.{cache_server.id}.client.{process_ticket(cache_server.id)[1]}-"
    before = set(shm_names(stem))
    local = Client(cache_server.id)
    (name,) = set(shm_names(stem)) - before
    x = fresh()
    np.testing.assert_array_equal(local.infer("ensemble_cached", {"X": x})["Y"], x * 4)
    local.close()
    wait_until(lambda: processes_mapping(cache_server.tree(), name) == [],
               "no server process maps the departed client's arena", DEADLINE_S)
