"""Model lifecycle against a real server: the repository API (load with a config override or
with file contents, unload, index), reloads under load with no failed request, a failed load that
leaves the old version serving, and poll mode picking up changes in the repository."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import shmserve
from conftest import DEADLINE_S, raw_request
from gates import Gate

ADD_SUB = Path(__file__).resolve().parent.parent / "model_repository" / "add_sub"
GATED_LOAD = Path(__file__).resolve().parent / "models" / "lifecycle" / "gated_load"


def config(count: int = 1, generation: int | None = None) -> str:
    """add_sub's config; a ``generation`` (a parameter) that changes makes a load a full reload
    rather than a change of instances in place."""
    params = {} if generation is None else {"parameters": {"generation": {"string_value": str(generation)}}}
    return json.dumps({
        "name": "add_sub", "backend": "python", "max_batch_size": 0, **params,
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                  {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                   {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "instance_group": [{"count": count, "kind": "KIND_CPU"}]})


def add_sub_result(client: httpclient.InferenceServerClient, model: str = "add_sub", version: str = ""):
    a = np.arange(16, dtype=np.int32)
    ins = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(a)
        ins.append(t)
    return client.infer(model, ins, model_version=version)


def add_sub(client: httpclient.InferenceServerClient, model: str = "add_sub") -> np.ndarray:
    return add_sub_result(client, model).as_numpy("OUTPUT0")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(ADD_SUB, root / "add_sub", ignore=shutil.ignore_patterns("__pycache__"))  # (fresh: no bytecode)
    return root


class Load:
    """Client threads sending add_sub in closed loops, counting successes and failures."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url, self.ok, self.errors, self.stop = url, 0, [], False
        self.threads = [threading.Thread(target=self.run) for _ in range(threads)]

    def run(self) -> None:
        client = httpclient.InferenceServerClient(self.url)
        try:
            while not self.stop:
                try:
                    assert add_sub(client).tolist() == list(range(0, 32, 2))
                    self.ok += 1
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            client.close()  # on this thread: left to the GC, its __del__ warned from another one

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        for t in self.threads:
            t.join(DEADLINE_S)

    def wait_more(self, n: int = 10) -> None:
        """Wait until ``n`` more requests have succeeded (or one failed): traffic went on."""
        target = self.ok + n
        wait_until(lambda: self.ok >= target or bool(self.errors), DEADLINE_S, f"{n} more requests served")


def test_repository_api_load_unload_and_index(server_factory, repo):
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    assert c.get_model_repository_index() == [{"name": "add_sub"}]
    assert not c.is_model_ready("add_sub")
    c.load_model("add_sub")
    assert c.is_model_ready("add_sub")
    index = c.get_model_repository_index()
    assert index == [{"name": "add_sub", "version": "1", "state": "READY"}]  # no empty reason, as Triton
    c.load_model("add_sub", config=config(count=2))
    assert c.get_model_config("add_sub")["instance_group"][0]["count"] == 2
    assert add_sub(c).tolist() == list(range(0, 32, 2))
    c.unload_model("add_sub")
    assert not c.is_model_ready("add_sub")
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        add_sub(c)
    # Triton keeps the unloaded version: UNAVAILABLE, "unloaded" (UNLOADING while it drained).
    assert c.get_model_repository_index() == [{"name": "add_sub", "version": "1", "state": "UNAVAILABLE",
                                               "reason": "unloaded"}]
    # A name no repository holds fails as in Triton and leaves no trace: Triton's own
    # model-control examples count the index after loading 'wrong_model_name'.
    with pytest.raises(InferenceServerException, match="failed to load 'wrong_model_name', failed to poll") as e:
        c.load_model("wrong_model_name")
    assert e.value.status() == "500"  # Triton's INTERNAL
    assert [e["name"] for e in c.get_model_repository_index()] == ["add_sub"]
    assert c.is_server_ready()


def test_a_load_without_config_of_an_unchanged_model_reloads_nothing(server_factory, repo):
    """As Triton: a model reloads only when its folder changed since it loaded, so a load with no
    config keeps what serves (no new worker, the override it was loaded with kept) until a file
    changes: one replaced by a copy of the same size and time (rsync -a, cp -p) too, or its
    config.pbtxt; then the folder's config serves. (Loaded plainly first: the first import of a
    version writes its bytecode, which a later load sees as a change, as in Triton.)"""
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    c.load_model("add_sub")
    c.load_model("add_sub", config=config(generation=7))
    assert c.get_model_config("add_sub")["parameters"] == {"generation": {"string_value": "7"}}
    workers = s.worker_pids("add_sub")
    for _ in range(2):
        c.load_model("add_sub")
        assert c.get_model_config("add_sub")["parameters"] == {"generation": {"string_value": "7"}}
        assert s.worker_pids("add_sub") == workers
        assert add_sub(c).tolist() == list(range(0, 32, 2))

    def reloaded(workers: list[int], parameters: dict | None = None) -> list[int]:
        wait_until(lambda: set(s.worker_pids("add_sub")).isdisjoint(workers), 30, "the old worker to stop")
        assert s.worker_pids("add_sub") and c.get_model_config("add_sub").get("parameters") == (parameters or {})
        assert add_sub(c).tolist() == list(range(0, 32, 2))
        return s.worker_pids("add_sub")

    model_py = repo / "add_sub" / "1" / "model.py"
    st = model_py.stat()
    copy = model_py.with_name("model.py.new")
    copy.write_bytes(model_py.read_bytes())
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(copy, model_py)
    c.load_model("add_sub")
    workers = reloaded(workers)
    c.load_model("add_sub")
    assert s.worker_pids("add_sub") == workers
    text = (repo / "add_sub" / "config.pbtxt").read_text()
    (repo / "add_sub" / "config.pbtxt").write_text(text + 'parameters { key: "generation" value { string_value: "8" } }\n')
    c.load_model("add_sub")
    reloaded(workers, {"generation": {"string_value": "8"}})


def test_a_load_without_config_after_an_override_follows_triton_s_file_times(server_factory, repo):
    """Triton 2.51's rule (ModelTimestamp; checked on the reference Triton): a load without config
    reads config.pbtxt again only if something in the model's folder was written after the last
    load, an override counting as written when it was asked for. The Python backend writes a
    version's bytecode when it first imports it: so an override that loads a version never loaded
    before is undone by the next plain load, and one of versions already loaded is kept."""
    shutil.copytree(repo / "add_sub" / "1", repo / "add_sub" / "2")
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()

    def serving() -> tuple[list[str], dict, dict]:
        cfg = c.get_model_config("add_sub")
        return (c.get_model_metadata("add_sub")["versions"], cfg.get("version_policy"), cfg.get("parameters", {}))

    latest = {"latest": {"num_versions": 1}}
    c.load_model("add_sub")
    assert serving() == (["2"], latest, {})
    only_1 = json.dumps({**json.loads(config()), "version_policy": {"specific": {"versions": [1]}}})
    c.load_model("add_sub", config=only_1)  # version 1's first import writes 1/__pycache__
    assert serving() == (["1"], {"specific": {"versions": [1]}}, {})
    assert (repo / "add_sub" / "1" / "__pycache__").is_dir()
    c.load_model("add_sub")
    wait_until(lambda: serving() == (["2"], latest, {}), DEADLINE_S, "config.pbtxt's policy serving again")
    # An override of the version already imported: a plain load keeps it, worker and all ...
    c.load_model("add_sub", config=config(generation=7))
    workers = s.worker_pids("add_sub")
    c.load_model("add_sub")
    assert serving() == (["2"], latest, {"generation": {"string_value": "7"}})
    assert s.worker_pids("add_sub") == workers
    # ... until a file is written after it.
    time.sleep(0.05)
    os.utime(repo / "add_sub" / "2" / "model.py")
    c.load_model("add_sub")
    wait_until(lambda: serving() == (["2"], latest, {}), DEADLINE_S, "config.pbtxt serving again")
    # Version 1 has its bytecode now: the same policy override is kept this time.
    c.load_model("add_sub", config=only_1)
    c.load_model("add_sub")
    assert serving() == (["1"], {"specific": {"versions": [1]}}, {})


def test_an_unloaded_model_has_no_available_versions(server_factory, repo):
    """Triton keeps an unloaded model's versions (UNAVAILABLE): metadata and inference say it has
    no available versions (404, NOT_FOUND), its old version is not at ready state (503), and a
    version it never had is not found, over HTTP and gRPC."""
    import tritonclient.grpc as grpcclient

    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    c = s.client()
    c.unload_model("add_sub")
    text = "Request for unknown model: 'add_sub' has no available versions"
    for call in (lambda: c.get_model_metadata("add_sub"), lambda: add_sub(c)):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert (e.value.status(), e.value.message()) == ("404", text)
    for version, status, words in (("1", "503", "version 1 is not at ready state"),
                                   ("7", "404", "version 7 is not found")):
        with pytest.raises(InferenceServerException) as e:
            add_sub_result(c, version=version)
        assert (e.value.status(), e.value.message()) == (status, f"Request for unknown model: 'add_sub' {words}")
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        with pytest.raises(InferenceServerException) as e:
            g.get_model_metadata("add_sub")
        assert (e.value.status(), e.value.message()) == ("StatusCode.NOT_FOUND", text)
    c.load_model("add_sub")  # loaded again, it serves as before
    assert add_sub(c).tolist() == list(range(0, 32, 2))


def test_load_from_file_contents_of_a_model_not_on_disk(server_factory, repo):
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--allow-model-file-uploads"])
    c = s.client()
    code = (ADD_SUB / "1" / "model.py").read_bytes()
    cfg = json.loads(config())
    cfg["name"] = "uploaded"
    before = uploads()
    c.load_model("uploaded", config=json.dumps(cfg), files={"file:1/model.py": code})
    assert add_sub(c, "uploaded").tolist() == list(range(0, 32, 2))
    first = uploads() - before
    assert len(first) == 1 and (next(iter(first)) / "uploaded" / "1" / "model.py").read_bytes() == code
    # Reloaded with new contents: the old private folder goes once the old version has drained.
    c.load_model("uploaded", config=json.dumps(cfg), files={"file:1/model.py": code + b"\n# v2\n"})
    wait_until(lambda: not (uploads() & first), DEADLINE_S, "the replaced upload folder removed")
    assert len(uploads() - before) == 1
    # A refused load keeps nothing; an unload removes the folder.
    bad = dict(cfg, backend="no_such_backend")
    with pytest.raises(InferenceServerException, match="failed to load"):
        c.load_model("uploaded2", config=json.dumps(dict(bad, name="uploaded2")), files={"file:1/model.py": code})
    c.unload_model("uploaded")
    wait_until(lambda: uploads() == before, DEADLINE_S, "every upload folder removed")


def uploads() -> set:
    import tempfile

    return set(Path(tempfile.gettempdir()).glob("shmserve-model-*"))


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def test_reloads_under_load_lose_no_request(server_factory, repo):
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    c = s.client()
    with Load(s.url) as load:
        load.wait_more()
        for i in range(6):
            c.load_model("add_sub", config=config(count=1 + i % 2, generation=i))
            load.wait_more()  # the clients are served by each new version
    assert load.errors == []


def test_failed_load_leaves_the_old_version_serving(server_factory, repo):
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    c = s.client()
    bad = json.loads(config())
    bad["backend"] = "no_such_backend"
    with Load(s.url) as load:
        with pytest.raises(InferenceServerException) as e:
            c.load_model("add_sub", config=json.dumps(bad))
        assert "failed to load 'add_sub'" in e.value.message()
        load.wait_more()
    assert load.errors == [] and load.ok > 0
    assert c.is_model_ready("add_sub") and c.is_server_ready()
    # The index and a metric say the last load failed, and why, while version 1 serves.
    [entry] = [e for e in c.get_model_repository_index() if e["name"] == "add_sub"]
    assert entry["state"] == "READY", entry
    assert entry["reason"].startswith("serving the previous version; the last load failed: failed to load "
                                      "'add_sub'") and "no_such_backend" in entry["reason"], entry
    assert 'shmserve_model_serving_after_failed_load{model="add_sub"} 1.0' in s.metrics_text()
    # ... and so does the log's error line.
    [line] = [x for x in s.log().splitlines() if "no_such_backend" in x and x.startswith("E")]
    assert line.endswith("(version 1 of 'add_sub' serves on)"), line
    c.load_model("add_sub", config=config())  # a load that works clears both
    [entry] = [e for e in c.get_model_repository_index() if e["name"] == "add_sub"]
    assert "reason" not in entry, entry
    assert "shmserve_model_serving_after_failed_load{" not in s.metrics_text()


def test_a_load_refuses_triton_s_bad_priorities_and_warns_of_an_execution_env(server_factory, repo):
    """Through the repository API of a real server: a default priority level outside its levels is
    Triton's refusal in its words; a Python model's EXECUTION_ENV_PATH loads with a warning naming it."""
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    bad = json.loads(config())
    bad.update(max_batch_size=4, dynamic_batching={"priority_levels": 2, "default_priority_level": 5})
    for io in bad["input"] + bad["output"]:
        io["dims"] = [-1]
    with pytest.raises(InferenceServerException) as e:
        c.load_model("add_sub", config=json.dumps(bad))
    assert "default priority level must be in range [1, 2] for add_sub" in e.value.message()
    env = json.loads(config())
    env["parameters"] = {"EXECUTION_ENV_PATH": {"string_value": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}}
    c.load_model("add_sub", config=json.dumps(env))
    assert c.is_model_ready("add_sub")
    assert "model 'add_sub': parameter 'EXECUTION_ENV_PATH' is not supported: the model runs in the server's " \
           "own Python environment" in s.log()


KILLED_WHILE_LOADING = """
import os
import signal

os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker loading a model too large
"""


def _killed_while_loading(root: Path) -> Path:
    """A repository whose model's worker dies while loading, saying nothing (SIGKILL)."""
    (root / "killed" / "1").mkdir(parents=True)
    (root / "killed" / "1" / "model.py").write_text(KILLED_WHILE_LOADING)
    (root / "killed" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninput [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    return root


def test_a_load_whose_worker_is_killed_while_loading_is_answered(server_factory, repo):
    """Before, its load, and every later load of that model, waited forever: the version failed
    when the worker's exit was seen, but only a worker's own message ended a load."""
    s = server_factory.start([_killed_while_loading(repo)], ["--model-control-mode", "explicit",
                                                             "--load-model", "add_sub"])
    c = httpclient.InferenceServerClient(s.url, network_timeout=60)
    for _ in range(2):  # and again: no load in progress is left behind
        with pytest.raises(InferenceServerException) as e:
            c.load_model("killed")
        assert e.value.status() == "400"
        assert e.value.message() == ("failed to load 'killed' version 1: instance 'killed_0' exited with code -9 "
                                     "while loading")
    assert not c.is_model_ready("killed")
    assert add_sub(c).tolist() == list(range(0, 32, 2))  # the rest serves on


def test_a_start_whose_model_is_killed_while_loading_exits_under_exit_on_error(server_factory, tmp_path):
    s = server_factory.create([_killed_while_loading(tmp_path / "repo")], ["--model-control-mode", "explicit",
                                                                          "--load-model", "killed"])
    s.start()
    assert s.wait_exit(60) != 0  # (before: it waited, never ready, until it was stopped)
    assert "failed to load all models; exiting" in s.log(), s.log_tail()
    assert "removed from /dev/shm by another program" not in s.log()  # (the broker removed its own)


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_load_and_unload_need_explicit_mode(server_factory, repo, mode):
    s = server_factory.start([repo], ["--model-control-mode", mode])
    with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed") as e:
        s.client().load_model("add_sub")
    assert e.value.status() == "503"  # Triton's UNAVAILABLE
    # Triton 2.51's text word for word (in 'none' mode too, as Triton says it), any hint after it
    assert e.value.message().startswith("explicit model load / unload is not allowed if polling is enabled")
    if mode == "poll":
        assert e.value.message() == "explicit model load / unload is not allowed if polling is enabled"
    else:
        assert "--model-control-mode=explicit" in e.value.message()
    with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
        s.client().unload_model("add_sub")
    for action in ("load", "unload"):  # no retry changes the mode: no Retry-After, as Triton sends none
        r = raw_request(s.port, "POST", f"/v2/repository/models/add_sub/{action}")
        assert r.status == 503 and "retry-after" not in r.headers, r.headers


def test_poll_mode_follows_the_repository(server_factory, repo, tmp_path):
    s = server_factory.start([repo], ["--model-control-mode", "poll"])
    c = s.client()
    assert c.get_model_metadata("add_sub")["versions"] == ["1"]
    with Load(s.url) as load:
        load.wait_more()
        # A new version published by atomic rename serves (and the policy retires version 1).
        staging = repo / ".staging-2"
        shutil.copytree(repo / "add_sub" / "1", staging)
        os.rename(staging, repo / "add_sub" / "2")
        wait_until(lambda: c.get_model_metadata("add_sub")["versions"] == ["2"], DEADLINE_S, "version 2 serving")
        load.wait_more()
    assert load.errors == [] and load.ok > 0
    wait_until(lambda: len(s.worker_pids("add_sub")) == 1, DEADLINE_S, "version 1's worker gone")
    workers = s.worker_pids("add_sub")
    # Editor temporaries and dot-folders change nothing (no reload: the same worker serves); a new
    # model folder loads. The watcher takes the changes in order, and a reload starts its workers
    # at once: once the new model is ready, the others have been seen too.
    (repo / "add_sub" / "config.pbtxt~").write_text("junk")
    (repo / "add_sub" / ".config.pbtxt.swp").write_text("junk")
    (repo / ".hidden").mkdir()
    shutil.copytree(ADD_SUB, tmp_path / "copy")
    cfg = (tmp_path / "copy" / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "twin"')
    (tmp_path / "copy" / "config.pbtxt").write_text(cfg)
    os.rename(tmp_path / "copy", repo / "twin")
    wait_until(lambda: c.is_model_ready("twin"), DEADLINE_S, "the new model ready")
    assert c.get_model_metadata("add_sub")["versions"] == ["2"]
    assert s.worker_pids("add_sub") == workers
    assert ".hidden" not in {m["name"] for m in c.get_model_repository_index()}
    assert add_sub(c, "twin").tolist() == list(range(0, 32, 2))
    # A removed one unloads.
    shutil.rmtree(repo / "twin")
    wait_until(lambda: not c.is_model_ready("twin"), DEADLINE_S, "the removed model unloaded")


def test_poll_mode_failed_reload_keeps_the_versions_unloaded_before(server_factory, repo, tmp_path):
    """As Triton 2.51's index: once version 2 replaced version 1 (UNAVAILABLE "unloaded") and then
    config.pbtxt broke, version 2 serves on and version 1 is still listed as before."""
    s = server_factory.start([repo], ["--model-control-mode", "poll"])
    c = s.client()
    shutil.copytree(repo / "add_sub" / "1", tmp_path / "v2")
    os.rename(tmp_path / "v2", repo / "add_sub" / "2")
    unloaded = {"name": "add_sub", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    wait_until(lambda: unloaded in c.get_model_repository_index(), DEADLINE_S, "version 1 unloaded")
    publish(repo / "add_sub" / "config.pbtxt", "this is not a config\n", tmp_path / "config.staging")
    wait_until(lambda: "reason" in c.get_model_repository_index()[-1], DEADLINE_S, "the failed reload in the index")
    index = c.get_model_repository_index()
    assert index[0] == unloaded, index
    assert (index[1]["version"], index[1]["state"]) == ("2", "READY"), index
    assert index[1]["reason"].startswith("serving the previous version; the last load failed: "), index
    assert add_sub(c).tolist() == list(range(0, 32, 2))


def publish(path: Path, text: str, staging: Path) -> None:
    """Write ``path`` as a publisher should: in full beside it, then one atomic rename."""
    staging.write_text(text)
    os.replace(staging, path)


def test_poll_mode_change_during_a_reload_reloads_again(server_factory, tmp_path):
    """A change that arrives while the model reloads is not lost: another reload follows."""
    repo = tmp_path / "repo"
    model = repo / "gated_load"
    shutil.copytree(GATED_LOAD, model)
    first, second = Gate(tmp_path / "first"), Gate(tmp_path / "second")
    first.open()
    template = (GATED_LOAD / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(template.replace("GATE", first.param))
    s = server_factory.start([repo], ["--model-control-mode", "poll"])
    c = s.client()
    assert c.get_model_metadata("gated_load")["versions"] == ["1"]
    # The new config names a closed gate: its load waits in initialize ...
    publish(model / "config.pbtxt", template.replace("GATE", second.param), tmp_path / "config.staging")
    second.wait_started()
    # ... while version 2 appears. The watcher takes the changes in order: once a model added
    # after it is ready, the broker has seen version 2 too. Then the held load finishes.
    shutil.copytree(model / "1", tmp_path / "v2")
    os.rename(tmp_path / "v2", model / "2")
    shutil.copytree(ADD_SUB, tmp_path / "add_sub")
    os.rename(tmp_path / "add_sub", repo / "add_sub")
    wait_until(lambda: c.is_model_ready("add_sub"), DEADLINE_S, "the model added later ready")
    assert c.get_model_metadata("gated_load")["versions"] == ["1"]
    second.open()
    wait_until(lambda: c.get_model_metadata("gated_load")["versions"] == ["2"], DEADLINE_S, "version 2 serving")
    assert add_sub(c, "gated_load").tolist() == list(range(0, 32, 2))


def test_a_model_loading_for_the_first_time_is_not_at_ready_state_rather_than_unknown(server_factory, tmp_path):
    """While its first load runs (initialize held at a gate), the model is listed LOADING and a
    request for it reads as Triton 2.51 answers one: no available versions (404), or its version
    not at ready state (503); "not found" only for a version it does not load. It said "is not
    found", which reads as a typo in the name."""
    repo = tmp_path / "repo"
    model = repo / "gated_load"
    shutil.copytree(GATED_LOAD, model)
    gate = Gate(tmp_path / "gate")
    (model / "config.pbtxt").write_text((GATED_LOAD / "config.pbtxt").read_text().replace("GATE", gate.param))
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    loading = threading.Thread(target=raw_request, args=(s.port, "POST", "/v2/repository/models/gated_load/load",
                                                         b""), daemon=True)  # (tritonclient's http is not for threads)
    loading.start()
    gate.wait_started()
    try:
        # (once: its loading version was listed twice, as loading and as a version beside those serving)
        assert c.get_model_repository_index() == [{"name": "gated_load", "version": "1", "state": "LOADING"}]
        for version, status, text in (("", "404", "has no available versions"),
                                      ("1", "503", "version 1 is not at ready state"),
                                      ("7", "404", "version 7 is not found")):
            with pytest.raises(InferenceServerException) as e:
                c.get_model_metadata("gated_load", model_version=version)
            assert (e.value.status(), e.value.message()) == (status, f"Request for unknown model: 'gated_load' {text}")
    finally:
        gate.open()
        loading.join(DEADLINE_S)
    assert add_sub(c, "gated_load").tolist() == list(range(0, 32, 2))


def test_poll_mode_scan_finds_what_file_events_miss(server_factory, tmp_path):
    """--repository-poll-secs: a model folder linked into the repository gets no inotify events
    (watchdog does not follow links; NFS and FUSE mounts get none either): the periodic scan
    finds its new version. A change the events report reloads once, not again at the scan."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(ADD_SUB, repo / "add_sub")
    linked = tmp_path / "elsewhere" / "twin"
    shutil.copytree(ADD_SUB, linked)
    cfg = (linked / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "twin"')
    (linked / "config.pbtxt").write_text(cfg)
    (repo / "twin").symlink_to(linked, target_is_directory=True)
    s = server_factory.start([repo], ["--model-control-mode", "poll", "--repository-poll-secs", "1"])
    c = s.client()
    assert c.get_model_metadata("twin")["versions"] == ["1"]
    # A change the events report: one reload.
    shutil.copytree(repo / "add_sub" / "1", tmp_path / "a2")
    os.rename(tmp_path / "a2", repo / "add_sub" / "2")
    wait_until(lambda: c.get_model_metadata("add_sub")["versions"] == ["2"], DEADLINE_S, "add_sub 2 serving")
    wait_until(lambda: len(s.worker_pids("add_sub")) == 1, DEADLINE_S, "add_sub 1's worker gone")
    workers = s.worker_pids("add_sub")
    # A change only the scan sees. The scan that finds it has also looked at add_sub since its
    # change: a second reload of add_sub would have started its worker by then.
    shutil.copytree(linked / "1", tmp_path / "t2")
    os.rename(tmp_path / "t2", linked / "2")
    wait_until(lambda: c.get_model_metadata("twin")["versions"] == ["2"], DEADLINE_S, "twin 2 serving")
    assert add_sub(c, "twin").tolist() == list(range(0, 32, 2))
    assert s.worker_pids("add_sub") == workers



NEEDS_MARKER = '''import json
import os


class TritonPythonModel:
    """Loads once the file its config names (outside the model's folder) exists."""

    def initialize(self, args):
        marker = json.loads(args["model_config"])["parameters"]["marker"]["string_value"]
        if not os.path.exists(marker):
            raise RuntimeError("not yet")

    def execute(self, requests):
        return []
'''


def test_poll_mode_tries_a_failed_load_again_at_each_poll(server_factory, tmp_path):
    """As Triton 2.51's polling (a failed load puts the model's timestamp back, so each poll finds
    it modified): a model whose load failed is loaded again at each --repository-poll-secs, its
    folder unchanged, and serves once what it lacked is there."""
    repo, marker = _flaky_repo(tmp_path)
    s = server_factory.start([repo], ["--model-control-mode", "poll", "--repository-poll-secs", "1",
                                      "--exit-on-error", "false"], wait=False)
    c = s.client()
    s.wait_until(lambda: _flaky_failures(s) >= 2, "the failed load tried again", timeout=DEADLINE_S)
    assert not c.is_model_ready("flaky")
    marker.write_text("")
    wait_until(lambda: c.is_model_ready("flaky"), DEADLINE_S, "the model serving at a later poll")
    assert c.is_server_ready()


def test_poll_mode_tries_no_failed_load_again_once_its_folder_is_gone(server_factory, tmp_path):
    """A model whose load failed and whose folder was then removed is unloaded and forgotten: it
    was "loaded again" at every poll for the server's life, each time found gone."""
    repo, _ = _flaky_repo(tmp_path)
    s = server_factory.start([repo], ["--model-control-mode", "poll", "--repository-poll-secs", "1",
                                      "--exit-on-error", "false"], wait=False)
    s.wait_until(lambda: _flaky_failures(s) >= 1, "the load failed", timeout=DEADLINE_S)
    shutil.rmtree(repo / "flaky")
    s.wait_until(lambda: "'flaky' was removed" in s.log(), "the removal seen", timeout=DEADLINE_S)
    said = len(s.log())
    time.sleep(3.5)  # (three polls)
    assert "'flaky'" not in s.log()[said:], s.log()[said:]
    assert "flaky" not in [m["name"] for m in s.client().get_model_repository_index()]


def _flaky_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose model 'flaky' fails to load until the marker file exists."""
    repo = tmp_path / "repo"
    (repo / "flaky" / "1").mkdir(parents=True)
    marker = tmp_path / "marker"
    (repo / "flaky" / "config.pbtxt").write_text(
        'name: "flaky"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "A" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "B" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        f'parameters {{ key: "marker" value {{ string_value: "{marker}" }} }}\n')
    (repo / "flaky" / "1" / "model.py").write_text(NEEDS_MARKER)
    return repo, marker


def _flaky_failures(s) -> int:
    """The broker's lines saying flaky's load failed (the worker's say it too)."""
    return sum("lifecycle.py" in line and "failed to load 'flaky' version 1: RuntimeError: not yet" in line
               for line in s.log().splitlines())

def test_warmup_runs_before_ready_and_a_failing_sample_fails_the_load(server_factory):
    repo = Path(__file__).parent / "models" / "warmup"
    s = server_factory.start([repo], ["--exit-on-error=false"], wait=False)
    s.wait_until(lambda: s.http_status("/v2/models/warm_probe/ready") == 200, "warm_probe ready")
    c = s.client()
    x = httpclient.InferInput("X", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    result = c.infer("warm_probe", [x])
    # zeros x2, random x1, file x1: four warm-up executions before the first real request.
    assert result.as_numpy("SEEN").tolist() == [4, 4]
    assert result.as_numpy("LAST_SUM").tolist() == [10.0]  # the file sample (1+2+3+4) ran last
    # A sample reaches the model in the config's reshape, as Triton 2.51 gives it (measured).
    s.wait_until(lambda: s.http_status("/v2/models/warm_reshaped/ready") == 200, "warm_reshaped ready")
    assert c.infer("warm_reshaped", [x]).as_numpy("WARM_SHAPE").tolist() == [2, 2]
    # warm_broken fails in its own worker, on its own time: wait for the broker to hear of it.
    s.wait_until(lambda: {m["name"]: m for m in c.get_model_repository_index()}["warm_broken"].get("state")
                 == "UNAVAILABLE", "warm_broken reported UNAVAILABLE", timeout=DEADLINE_S)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert "warmup sample 'file' failed" in index["warm_broken"]["reason"] or \
        "missing.bin" in index["warm_broken"]["reason"]
    assert index["warm_broken"]["version"] == "1"  # the version the load tried, as Triton lists it
    # A sample lacking an input the model requires is refused as such a request is, in Triton's
    # words, before the model's execute could fail on the missing input.
    s.wait_until(lambda: {m["name"]: m for m in c.get_model_repository_index()}["warm_lacking"].get("state")
                 == "UNAVAILABLE", "warm_lacking reported UNAVAILABLE", timeout=DEADLINE_S)
    reason = {m["name"]: m for m in c.get_model_repository_index()}["warm_lacking"]["reason"]
    assert reason.endswith("warmup sample 'only_x': [request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'warm_lacking'. "
                           "Got input(s) ['X'], but missing required input(s) ['Y']. Please provide all required "
                           "input(s)."), reason
    # A sample input that says nothing of its data is refused in Triton's words (not run on zeros).
    s.wait_until(lambda: {m["name"]: m for m in c.get_model_repository_index()}["warm_unsourced"].get("state")
                 == "UNAVAILABLE", "warm_unsourced reported UNAVAILABLE", timeout=DEADLINE_S)
    reason = {m["name"]: m for m in c.get_model_repository_index()}["warm_unsourced"]["reason"]
    assert reason.endswith("[request id: <id_unknown>] warmup setting expects input 'Y' to have input_data_type "
                           "set"), reason
    # Triton 2.51's answers for a model whose load failed: the latest and an unknown version are
    # not found (404), the version that failed is not ready (503).
    for version, status, text in (("", "404", "has no available versions"), ("7", "404", "version 7 is not found"),
                                  ("1", "503", "version 1 is not at ready state")):
        with pytest.raises(InferenceServerException) as e:
            c.infer("warm_broken", [x], model_version=version)
        assert e.value.status() == status
        assert e.value.message() == f"Request for unknown model: 'warm_broken' {text}"
        # ... even with a body it cannot parse: Triton looks the model up first
        raw = raw_request(s.port, "POST", f"/v2/models/warm_broken{'/versions/' + version if version else ''}/infer",
                          b"{not json")
        assert raw.status == int(status), raw
        assert raw.json() == {"error": f"Request for unknown model: 'warm_broken' {text}"}


@pytest.mark.parametrize("policy,expected", [
    ("", ["3"]),
    ("version_policy { latest { num_versions: 2 } }", ["2", "3"]),
    ("version_policy { all { } }", ["1", "2", "3"]),
    ("version_policy { specific { versions: [ 1, 3 ] } }", ["1", "3"]),
])
def test_version_policies(server_factory, tmp_path, policy, expected):
    repo = tmp_path / "repo"
    model = repo / "add_sub"
    shutil.copytree(ADD_SUB, model)
    for v in ("2", "3"):
        shutil.copytree(model / "1", model / v)
    (model / "config.pbtxt").write_text((ADD_SUB / "config.pbtxt").read_text() + "\n" + policy + "\n")
    s = server_factory.start([repo])
    c = s.client()
    assert c.get_model_metadata("add_sub")["versions"] == expected
    # Unversioned requests go to the highest ready version.
    assert add_sub_result(c).get_response()["model_version"] == expected[-1]
    for v in expected:
        assert add_sub_result(c, version=v).get_response()["model_version"] == v
        assert c.get_model_metadata("add_sub", v)["versions"] == [v]  # one version's: that one, as Triton
    for v in {"1", "2", "3"} - set(expected):
        with pytest.raises(InferenceServerException, match="Request for unknown model"):
            add_sub_result(c, version=v)


def test_rollback_to_an_older_version_in_one_call_loses_no_request(server_factory, repo):
    """Versions 1 and 2 on disk, 2 serving; one load call whose config pins version 1 moves the
    traffic back, while clients keep sending."""
    shutil.copytree(repo / "add_sub" / "1", repo / "add_sub" / "2")
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    c = s.client()
    assert c.get_model_metadata("add_sub")["versions"] == ["2"]
    pinned = json.loads(config())
    pinned["version_policy"] = {"specific": {"versions": [1]}}
    with Load(s.url) as load:
        load.wait_more()
        c.load_model("add_sub", config=json.dumps(pinned))
        load.wait_more()  # served by version 1 now
    assert c.get_model_metadata("add_sub")["versions"] == ["1"]
    assert load.errors == [] and load.ok > 0
    # Version 2 stays listed, UNAVAILABLE "unloaded" once drained, and is "not at ready state", as in Triton
    wait_until(lambda: {e.get("version"): e.get("state") for e in c.get_model_repository_index()
                        if e["name"] == "add_sub"} == {"1": "READY", "2": "UNAVAILABLE"}, DEADLINE_S, "v2 drained")
    assert [e for e in c.get_model_repository_index() if e["name"] == "add_sub"][1]["reason"] == "unloaded"
    with pytest.raises(InferenceServerException, match="version 2 is not at ready state"):
        add_sub_result(c, version="2")


def test_a_new_version_loading_or_failed_beside_one_that_serves_is_listed_and_not_at_ready_state(server_factory,
                                                                                                  tmp_path):
    """As Triton 2.51: while version 2 loads beside version 1 the index lists it LOADING, and
    once its load failed UNAVAILABLE with the reason; a request for it meanwhile is 503 "not at
    ready state" (gRPC UNAVAILABLE: retry), not 404 "not found" (final), which a client pinned to
    the new version read as "it does not exist" (it did: the folder was there, loading)."""
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    shutil.copytree(SLOW_START / "slow_start", repo / "slow_start")
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "slow_start"])
    c = s.client()
    g = grpcclient.InferenceServerClient(s.grpc_url)
    x = np.ones([1], np.float32)

    def refusals(version: str) -> list[tuple[str, str]]:
        """(status, text) of an HTTP and a gRPC request for ``version``."""
        out = []
        for client, mod in ((c, httpclient), (g, grpcclient)):
            t = mod.InferInput("X", [1], "FP32")
            t.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as e:
                client.infer("slow_start", [t], model_version=version)
            out.append((str(e.value.status()), e.value.message()))
        return out

    def listed() -> list[dict]:
        return [e for e in c.get_model_repository_index() if e["name"] == "slow_start"]

    def served() -> str:
        t = httpclient.InferInput("X", [1], "FP32")
        t.set_data_from_numpy(x)
        return c.infer("slow_start", [t]).get_response()["model_version"]

    shutil.copytree(repo / "slow_start" / "1", repo / "slow_start" / "2")
    not_ready = "Request for unknown model: 'slow_start' version 2 is not at ready state"
    gate = Gate(tmp_path / "gate")
    load = LoadCall(s.url, "slow_start", slow_start_config(gate=gate))
    try:
        gate.wait_started()
        assert listed() == [{"name": "slow_start", "version": "1", "state": "READY"},
                            {"name": "slow_start", "version": "2", "state": "LOADING"}]
        assert refusals("2") == [("503", not_ready), ("StatusCode.UNAVAILABLE", not_ready)]
        assert served() == "1" and not c.is_model_ready("slow_start", "2")
    finally:
        gate.open()
    assert load.outcome() is None
    assert served() == "2"

    # A version 3 whose initialize raises: version 2 serves on, 3 is listed with why, and "not at ready state".
    (repo / "slow_start" / "3").mkdir()
    (repo / "slow_start" / "3" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('boom v3')\n")
    with pytest.raises(InferenceServerException, match="boom v3"):
        c.load_model("slow_start")
    why = "failed to load 'slow_start' version 3: RuntimeError: boom v3"
    entries = {e["version"]: e for e in listed()}
    assert entries["3"] == {"name": "slow_start", "version": "3", "state": "UNAVAILABLE", "reason": why}
    assert entries["2"]["state"] == "READY" and entries["1"]["state"] in ("UNLOADING", "UNAVAILABLE")
    not_ready = not_ready.replace("version 2", "version 3")
    assert refusals("3") == [("503", not_ready), ("StatusCode.UNAVAILABLE", not_ready)]
    assert served() == "2"
    # A version no load ever tried is still "not found".
    assert refusals("4")[0] == ("404", "Request for unknown model: 'slow_start' version 4 is not found")
    g.close()


SLOW_START = Path(__file__).resolve().parent / "models" / "lifecycle"


def slow_start_config(count: int = 1, gate: Gate | None = None) -> str:
    """slow_start's config; with a gate, every instance's initialize() waits until it opens."""
    cfg: dict = {"name": "slow_start", "backend": "python", "max_batch_size": 0,
                 "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                 "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}],
                 "instance_group": [{"count": count, "kind": "KIND_CPU"}]}
    if gate is not None:
        cfg["parameters"] = {"gate": {"string_value": gate.param}}
    return json.dumps(cfg)


class LoadCall(threading.Thread):
    """One load request on its own thread (it is answered only when the load is over): its
    outcome is None (loaded) or the server's error."""

    def __init__(self, url: str, model: str, cfg: str) -> None:
        super().__init__()
        self.url, self.model, self.cfg = url, model, cfg
        self.error: InferenceServerException | None = None
        self.start()

    def run(self) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=2 * DEADLINE_S)
        try:
            client.load_model(self.model, config=self.cfg)
        except InferenceServerException as e:
            self.error = e
        finally:
            client.close()

    def outcome(self) -> InferenceServerException | None:
        self.join(DEADLINE_S)
        assert not self.is_alive(), "the load request was never answered"
        return self.error


def test_unload_during_a_load_cancels_it(server_factory, tmp_path):
    """The last request wins: a model unloaded while it loads (first load or reload) stays
    unloaded when its initialize() would have finished, and the load's caller is told why."""
    s = server_factory.start([SLOW_START], ["--model-control-mode", "explicit"])
    c = s.client()
    for attempt, serving in enumerate((False, True)):
        if serving:
            c.load_model("slow_start")
            assert c.is_model_ready("slow_start")
        gate = Gate(tmp_path / f"gate{attempt}")
        load = LoadCall(s.url, "slow_start", slow_start_config(gate=gate))
        try:
            gate.wait_started()
            c.unload_model("slow_start")
        finally:
            gate.open()  # what the cancelled load would have done next, had it not been stopped
        error = load.outcome()
        assert error is not None, "the load went on after the unload"
        assert error.message() == "failed to load 'slow_start', the model was unloaded before the load completed"
        assert error.status() == "409"
        assert not c.is_model_ready("slow_start")
        # Triton finishes the load before it unloads, so a first load too leaves its version listed
        # UNAVAILABLE "unloaded", and the model is one the server had: "no available versions".
        entry = {"name": "slow_start", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
        s.wait_until(lambda: entry in c.get_model_repository_index(), "the version listed as unloaded",
                     timeout=DEADLINE_S)
        for path, status, text in (("/v2/models/slow_start", 404, "has no available versions"),
                                   ("/v2/models/slow_start/versions/1", 503, "version 1 is not at ready state")):
            r = raw_request(s.port, "GET", path)
            assert (r.status, r.json()) == (status, {"error": f"Request for unknown model: 'slow_start' {text}"})
    c.load_model("slow_start")  # a load after all that works
    assert c.is_model_ready("slow_start") and c.is_server_ready()
    assert "did not stop within" not in s.log()  # (the cancelled loads' workers were killed at once, rightly)



def test_the_server_is_not_ready_while_a_model_loads_for_the_first_time(server_factory, tmp_path):
    """As Triton 2.51's --strict-readiness (every version READY or "unloaded"): a model loading
    through the API with nothing of it serving keeps the server not ready until it serves; its
    reload beside the version that serves does not."""
    s = server_factory.start([SLOW_START], ["--model-control-mode", "explicit"])
    c = s.client()
    assert c.is_server_ready()
    for serving in (False, True):
        gate = Gate(tmp_path / f"gate{int(serving)}")
        load = LoadCall(s.url, "slow_start", slow_start_config(count=1 + serving, gate=gate))
        try:
            gate.wait_started()
            assert c.is_server_ready() is serving
        finally:
            gate.open()
        assert load.outcome() is None
        assert c.is_server_ready()

def test_a_second_load_during_a_load_replaces_it(server_factory, tmp_path):
    """The last request wins: a load with another config while a load is in progress stops the
    first one (its caller is told so) and the model serves with the second config."""
    s = server_factory.start([SLOW_START], ["--model-control-mode", "explicit"])
    c = s.client()
    gate = Gate(tmp_path / "gate")
    first = LoadCall(s.url, "slow_start", slow_start_config(count=1, gate=gate))
    try:
        gate.wait_started()
        second = LoadCall(s.url, "slow_start", slow_start_config(count=2))
        assert second.outcome() is None
    finally:
        gate.open()
    error = first.outcome()
    assert error is not None, "the first load was not replaced"
    assert error.message() == "failed to load 'slow_start', a later load of the model replaced this one"
    assert error.status() == "409"
    assert c.get_model_config("slow_start")["instance_group"][0]["count"] == 2
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([3.0], np.float32))
    assert c.infer("slow_start", [x]).as_numpy("Y").tolist() == [3.0]
    # The same load again while one is in progress joins it: both callers are answered once it serves.
    gate2 = Gate(tmp_path / "gate2")
    same = slow_start_config(gate=gate2)
    loads = [LoadCall(s.url, "slow_start", same)]
    try:
        gate2.wait_started()
        loads.append(LoadCall(s.url, "slow_start", same))
        s.wait_until(lambda: "joining the load in progress" in s.log(), "the second load joined the first",
                     timeout=DEADLINE_S)
    finally:
        gate2.open()
    assert [call.outcome() for call in loads] == [None, None]
    assert len(gate2.started()) == 1  # one load ran, not two
    assert c.get_model_config("slow_start")["instance_group"][0]["count"] == 1


def test_version_zero_is_a_version_its_answers_name(server_factory, repo: Path):
    """A version folder "0" is a version like any other, as in Triton: the answers to a request
    that names no version say "0" over HTTP, gRPC and the local client (not "", which says none)."""
    import tritonclient.grpc as grpcclient
    from shmserve import Client

    (repo / "add_sub" / "1").rename(repo / "add_sub" / "0")
    (repo / "add_sub" / "notes").mkdir()  # not a version: passed over with Triton's warning
    srv = server_factory.start([repo])
    assert "model 'add_sub': ignore version directory 'notes' which fails to convert to integral number" in srv.log()
    client = srv.client()
    assert add_sub_result(client).get_response()["model_version"] == "0"
    assert add_sub_result(client, version="0").get_response()["model_version"] == "0"
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        ins = []
        for name in ("INPUT0", "INPUT1"):
            t = grpcclient.InferInput(name, [16], "INT32")
            t.set_data_from_numpy(np.arange(16, dtype=np.int32))
            ins.append(t)
        assert g.infer("add_sub", ins).get_response().model_version == "0"
    finally:
        g.close()
    with Client(srv.id) as local:
        a = np.arange(16, dtype=np.int32)
        assert local.infer("add_sub", {"INPUT0": a, "INPUT1": a}).model_version == "0"


def test_a_load_whose_frontend_died_meanwhile_is_finished_by_the_same_broker(server_factory, tmp_path):
    """The HTTP frontend that forwarded a load is killed while the model initializes: the load
    completes with nobody left to answer, and the broker lives on (it wrote its answer into the
    dead frontend's closed segment and died of it)."""
    s = server_factory.start([SLOW_START], ["--model-control-mode", "explicit"])
    titles = s.titles()
    broker = next(pid for pid, t in titles.items() if t.startswith("shmserve broker "))
    frontend = next(pid for pid, t in titles.items() if t.startswith("shmserve frontend "))
    gate = Gate(tmp_path / "gate")
    outcome: list[BaseException] = []

    def load_call() -> None:  # (its connection is cut with the frontend)
        try:
            httpclient.InferenceServerClient(s.url, network_timeout=DEADLINE_S).load_model(
                "slow_start", config=slow_start_config(gate=gate))
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    load = threading.Thread(target=load_call)
    load.start()
    try:
        gate.wait_started()
        os.kill(frontend, signal.SIGKILL)
        wait_until(lambda: "died; reclaiming its channel" in s.log(), DEADLINE_S, "the broker reclaiming the frontend")
    finally:
        gate.open()
    load.join(DEADLINE_S)
    assert outcome, "the load was answered through a frontend that was killed"

    def ready() -> bool:
        try:
            return s.client().is_model_ready("slow_start")
        except Exception:  # noqa: BLE001 - the frontend is restarting
            return False

    wait_until(ready, DEADLINE_S, "the model loaded")
    assert broker in s.titles(), s.log_tail()
    assert "Traceback" not in s.log(), s.log_tail()


HANGING_FINALIZE = """import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]

    def finalize(self):
        time.sleep(3600)
"""


def test_an_unload_kills_a_worker_whose_finalize_does_not_return(server_factory, tmp_path):
    """The unload asks the worker to stop; one still there --exit-timeout-secs later is killed,
    the unload is answered and the model is unloaded, not UNLOADING for good."""
    model = tmp_path / "hanging"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(HANGING_FINALIZE)
    (model / "config.pbtxt").write_text('name: "hanging"\nbackend: "python"\nmax_batch_size: 0\n'
                                        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                                        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    s = server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "hanging",
                                          "--exit-timeout-secs", "2"])
    worker = s.worker_pids("hanging")
    assert len(worker) == 1
    client = httpclient.InferenceServerClient(s.url, network_timeout=DEADLINE_S)
    started = time.monotonic()
    client.unload_model("hanging")  # answered once the worker is gone
    assert time.monotonic() - started < DEADLINE_S / 2
    assert s.worker_pids("hanging") == []
    assert {"name": "hanging", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} \
        in client.get_model_repository_index()
    assert "did not stop within 2 s of being asked" in s.log()
    client.load_model("hanging")  # and it loads again
    assert client.is_model_ready("hanging")


def test_the_start_logs_a_table_of_the_models_and_whether_the_server_is_ready(server_factory, tmp_path):
    """Once the loads at start are over, the log shows every model with its version and status
    (a failure with its reason), as Triton's table does, and its last word agrees with
    /v2/health/ready: with a model that failed under --strict-readiness, not ready."""
    repo = tmp_path / "repo"
    shutil.copytree(Path(__file__).parent.parent / "model_repository" / "add_sub", repo / "add_sub")
    (repo / "typo" / "1").mkdir(parents=True)
    (repo / "typo" / "config.pbtxt").write_text('backend: "python"\nmax_bach_size: 0\n')
    s = server_factory.start([repo], ["--exit-on-error=false"], wait=False)
    s.wait_until(lambda: "server is not ready" in s.log(), "the start's last word")
    log = s.log()
    table = log[log.index("| Model "):]
    assert "| Model   | Version | Status" in table, table
    assert "| add_sub | 1       | READY " in table, table
    assert "| typo    | -       | UNAVAILABLE: failed to load 'typo'" in table and "max_bach_size" in table, table
    assert "1 model version(s) serving, 1 model(s) failed to load (typo)" in log
    assert "server is ready" not in log
    assert s.http_status("/v2/health/ready") == 400
    assert f"starting shmserve {shmserve.__version__} as '{s.id}' (pid {s.pid}), repositories: {repo}" in log


def test_loads_that_end_during_a_stop_say_nothing_of_readiness(server_factory, tmp_path):
    """A stop begun while a model still loaded at start: the load ends during the drain (a request
    held in flight), and the log says nothing about the server being ready or not (it is stopping;
    readiness says no for that), where it once warned 'not ready (--strict-readiness)'."""
    repo = tmp_path / "repo"
    shutil.copytree(GATED_LOAD, repo / "gated_load")
    shutil.copytree(Path(__file__).parent / "models" / "batching" / "probe_unbatched", repo / "probe_unbatched")
    load_gate, run_gate = Gate(tmp_path / "load"), Gate(tmp_path / "run")
    config = repo / "gated_load" / "config.pbtxt"
    config.write_text(config.read_text().replace("GATE", load_gate.param))
    s = server_factory.start([repo], ["--strict-readiness=false"], wait=False)
    load_gate.wait_started()
    s.wait_until(lambda: s.http_status("/v2/models/probe_unbatched/ready") == 200, "probe_unbatched ready")
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}],
                       "parameters": {"gate": run_gate.param}}).encode()
    held = threading.Thread(target=raw_request, args=(s.port, "POST", "/v2/models/probe_unbatched/infer", body),
                            daemon=True)
    held.start()
    try:
        run_gate.wait_started()
        s.proc.send_signal(signal.SIGTERM)
        s.wait_until(lambda: "draining" in s.log(), "the drain began")
        load_gate.open()
        s.wait_until(lambda: "successfully loaded 'gated_load'" in s.log(), "the load ended during the drain")
    finally:
        load_gate.open()
        run_gate.open()
        held.join(DEADLINE_S)
    assert s.wait_exit(60) == 0
    log = s.log()
    assert "server is not ready" not in log and "server is ready" not in log, s.log_tail()
