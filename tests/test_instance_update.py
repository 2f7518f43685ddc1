"""Live instance changes against a real server: a config that changes only ``instance_group``
adds and removes instances of the serving model (the other workers keep running, no request
fails), through the load API with a config override and in poll mode; anything else, or a
changed model file, loads the model anew; an added instance that fails to load leaves the model
serving and the load request hears why."""
from __future__ import annotations

import json
import os

import pytest
from tritonclient.utils import InferenceServerException
from conftest import DEADLINE_S
from test_lifecycle import Load, add_sub, config, repo, wait_until  # noqa: F401 - repo: a fixture

# Appended to add_sub's model.py: its second instance fails to start.
FAIL_SECOND = '''

_AddSub = TritonPythonModel


class TritonPythonModel(_AddSub):
    def initialize(self, args):
        if args["model_instance_name"].endswith("_1"):
            raise RuntimeError("this instance does not start")
        if hasattr(_AddSub, "initialize"):
            _AddSub.initialize(self, args)
'''


def explicit(server_factory, repo):
    return server_factory.start([repo], ["--model-control-mode", "explicit", "--load-model", "add_sub"])


def test_load_with_more_or_fewer_instances_keeps_the_running_ones(server_factory, repo):
    s = explicit(server_factory, repo)
    c = s.client()
    first = s.worker_pids("add_sub")
    assert len(first) == 1
    with Load(s.url) as load:
        load.wait_more()
        c.load_model("add_sub", config=config(count=3))  # answered once the two new ones are ready
        assert len(s.worker_pids("add_sub")) == 3 and set(first) <= set(s.worker_pids("add_sub"))
        load.wait_more(30)
        c.load_model("add_sub", config=config(count=1))
        wait_until(lambda: len(s.worker_pids("add_sub")) == 1, DEADLINE_S, "two instances removed")
        load.wait_more()
    assert load.errors == [] and load.ok > 0
    assert s.worker_pids("add_sub") == first  # the first instance served throughout
    assert c.get_model_config("add_sub")["instance_group"][0]["count"] == 1
    assert "instances changed in place (2 added, 0 removed)" in s.log()


def test_loading_the_same_config_again_changes_nothing(server_factory, repo):
    s = explicit(server_factory, repo)
    first = s.worker_pids("add_sub")
    s.client().load_model("add_sub", config=config(count=1))
    s.client().load_model("add_sub")  # the folder's config: the same one
    assert s.worker_pids("add_sub") == first


def test_other_changes_and_changed_files_load_the_model_anew(server_factory, repo):
    s = explicit(server_factory, repo)
    c = s.client()
    first = s.worker_pids("add_sub")
    c.load_model("add_sub", config=config(count=1, generation=1))  # a parameter: not only instances
    wait_until(lambda: s.worker_pids("add_sub") and not set(s.worker_pids("add_sub")) & set(first), DEADLINE_S,
               "a new worker in place of the old one")
    second = s.worker_pids("add_sub")
    model_py = repo / "add_sub" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + "\n# edited\n")
    os.utime(model_py, ns=(1, 1))  # a different modification time whatever the clock's resolution
    c.load_model("add_sub", config=config(count=2, generation=1))
    wait_until(lambda: len(s.worker_pids("add_sub")) == 2, DEADLINE_S, "two workers")
    assert not set(s.worker_pids("add_sub")) & set(second)
    assert add_sub(c).tolist() == list(range(0, 32, 2))


def test_poll_mode_changes_instances_in_place(server_factory, repo):
    s = server_factory.start([repo], ["--model-control-mode", "poll"])
    c = s.client()
    first = s.worker_pids("add_sub")
    cfg = repo / "add_sub" / "config.pbtxt"
    with Load(s.url) as load:
        load.wait_more()
        staging = repo / "add_sub" / ".config.new"
        staging.write_text(cfg.read_text().replace("count: 1", "count: 2"))
        os.replace(staging, cfg)
        wait_until(lambda: len(s.worker_pids("add_sub")) == 2, DEADLINE_S, "a second instance")
        wait_until(lambda: c.get_model_config("add_sub")["instance_group"][0]["count"] == 2, DEADLINE_S,
                   "the config with two instances")
        load.wait_more(20)
    assert load.errors == []
    assert set(first) <= set(s.worker_pids("add_sub"))


def test_an_added_instance_that_fails_leaves_the_model_serving(server_factory, repo):
    model_py = repo / "add_sub" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + FAIL_SECOND)
    s = explicit(server_factory, repo)
    c = s.client()
    first = s.worker_pids("add_sub")
    with Load(s.url) as load:
        load.wait_more()
        with pytest.raises(InferenceServerException, match="this instance does not start") as e:
            c.load_model("add_sub", config=config(count=2))
        assert e.value.status() == "400"
        load.wait_more()
    assert load.errors == []
    wait_until(lambda: s.worker_pids("add_sub") == first, DEADLINE_S, "the failed instance gone")
    assert c.is_model_ready("add_sub")
    assert json.loads(json.dumps(c.get_model_repository_index()))[0]["state"] == "READY"
    # the same change from the folder: each load by name tries it again (the folder is not what serves)
    config_file = repo / "add_sub" / "config.pbtxt"
    config_file.write_text(config_file.read_text().replace("count: 1", "count: 2"))
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="this instance does not start"):
            c.load_model("add_sub")
    wait_until(lambda: s.worker_pids("add_sub") == first, DEADLINE_S, "the failed instance gone")
