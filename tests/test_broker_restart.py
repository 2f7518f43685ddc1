"""What clients changed through the API outlives a broker crash: the launcher's new broker serves
the models the load API loaded (with their configs and uploaded files) and not those it
unloaded, keeps the regions registered over HTTP, and the log and trace settings posted.

One server for the module: the fixture changes each of these, kills the broker with SIGKILL and
waits for the new one; each test then looks at one of them.
"""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from as_nobody import run_as_nobody
from conftest import DEADLINE_S, PRODUCT_MODELS, TEST_MODELS
from shmserve.shm.client import Client, ServerUnavailable

ADD_SUB_CODE = (PRODUCT_MODELS / "add_sub" / "1" / "model.py").read_bytes()
NB = 16 * 4
LOG_SETTINGS = {"log_verbose_level": 1, "log_format": "ISO8601"}
TRACE_RATE = "7"


def add_sub_config(name: str, count: int) -> str:
    return json.dumps({
        "name": name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                  {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                   {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "instance_group": [{"count": count, "kind": "KIND_CPU"}]})


def add_sub(client: httpclient.InferenceServerClient, model: str) -> list[int]:
    a = np.arange(16, dtype=np.int32)
    ins = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(a)
        ins.append(t)
    return client.infer(model, ins).as_numpy("OUTPUT0").tolist()


def add_sub_through_region(client: httpclient.InferenceServerClient, handle) -> list[int]:
    """INPUT0 and INPUT1 from the region 'restart_io', OUTPUT0 written back into it."""
    a = np.arange(16, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, a])
    ins = []
    for k, name in enumerate(("INPUT0", "INPUT1")):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_shared_memory("restart_io", NB, offset=k * NB)
        ins.append(t)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    out.set_shared_memory("restart_io", NB, offset=2 * NB)
    client.infer("add_sub", ins, outputs=[out])
    return shm.get_contents_as_numpy(handle, np.int32, [16], offset=2 * NB).tolist()


def broker_pid(server) -> int | None:
    return next((pid for pid, t in server.titles().items() if t.startswith("shmserve broker ")), None)


@pytest.fixture(scope="module")
def restarted(module_factory):
    """A server whose broker was killed after the API changed models, regions and settings."""
    server = module_factory.start([PRODUCT_MODELS, TEST_MODELS],
                                  ["--model-control-mode", "explicit", "--load-model", "add_sub",
                                   "--load-model", "raiser", "--allow-model-file-uploads"])
    key = f"/restart_io_{server.id}"
    handle = shm.create_shared_memory_region("restart_io", key, 3 * NB)
    c = server.client()
    local = Client(server.id)
    try:
        local.create_region("local_io", 3 * NB)  # the local client's own: not restored
        c.load_model("add_sub", config=add_sub_config("add_sub", 2))  # an override of a repository model
        c.load_model("uploaded", config=add_sub_config("uploaded", 1), files={"file:1/model.py": ADD_SUB_CODE})
        c.unload_model("raiser")
        c.register_system_shared_memory("restart_io", key, 3 * NB)
        assert add_sub_through_region(c, handle) == list(range(0, 32, 2))
        c.update_log_settings(LOG_SETTINGS)
        c.update_trace_settings(settings={"trace_rate": TRACE_RATE})

        old = broker_pid(server)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 2 * DEADLINE_S
        while broker_pid(server) in (None, old) or server.http_status("/v2/health/ready") != 200:
            assert time.monotonic() < deadline, "the broker did not come back ready"
            time.sleep(0.1)
        assert "the broker died" in server.log()
        yield server, c, handle, local
    finally:
        local.close()
        c.close()
        shm.destroy_shared_memory_region(handle)


def test_models_loaded_through_the_api_are_loaded_again(restarted):
    server, c, _, _ = restarted
    assert c.is_model_ready("add_sub")
    assert c.get_model_config("add_sub")["instance_group"][0]["count"] == 2  # the override, not the folder's
    assert add_sub(c, "add_sub") == list(range(0, 32, 2))
    assert c.is_model_ready("uploaded")  # from the uploaded files
    assert add_sub(c, "uploaded") == list(range(0, 32, 2))


def test_models_unloaded_through_the_api_stay_unloaded(restarted):
    server, c, _, _ = restarted
    assert not c.is_model_ready("raiser")  # although --load-model names it
    index = {e["name"]: e for e in c.get_model_repository_index()}
    assert index["raiser"].get("state") is None  # in the repository, never loaded by this broker


def test_regions_registered_over_http_are_kept(restarted):
    server, c, handle, _ = restarted
    assert [r["name"] for r in c.get_system_shared_memory_status()] == ["restart_io"]
    assert add_sub_through_region(c, handle) == list(range(0, 32, 2))


def test_log_settings_are_kept(restarted):
    server, c, _, _ = restarted
    settings = c.get_log_settings()
    assert {k: settings[k] for k in LOG_SETTINGS} == LOG_SETTINGS


def test_trace_settings_are_kept(restarted):
    server, c, _, _ = restarted
    assert c.get_trace_settings()["trace_rate"] == TRACE_RATE


def test_a_local_client_reconnects_and_registers_its_regions_again(restarted):
    server, c, _, old = restarted
    with pytest.raises(ServerUnavailable):
        old.is_server_ready()
    assert "local_io" not in [r["name"] for r in c.get_system_shared_memory_status()]
    old.close()  # its region's object goes with it, so the name is free for the new client
    new = Client(server.id)
    try:
        new.create_region("local_io", 3 * NB)
        assert "local_io" in [r["name"] for r in c.get_system_shared_memory_status()]
        new.unregister_region("local_io")
    finally:
        new.close()


def test_a_restored_region_keeps_its_owner(restarted):
    """The journal keeps who registered a region: another uid still may not unregister it, and
    its owner (root over HTTP) still may. Last: it unregisters the module's region."""
    server, c, _, _ = restarted
    refused = run_as_nobody("""
c = httpclient.InferenceServerClient(args)
try:
    c.unregister_system_shared_memory("restart_io")
    result = "unregistered"
except InferenceServerException as e:
    result = str(e.status())
""", server.url)
    assert refused == "403"
    assert [r["name"] for r in c.get_system_shared_memory_status()] == ["restart_io"]
    c.unregister_system_shared_memory("restart_io")
    assert c.get_system_shared_memory_status() == []


def test_a_model_loading_again_after_a_broker_restart_is_unavailable_not_unknown(server_factory, tmp_path):
    """While the new broker loads again what the old one served, a request for such a model is
    a 503 to retry (gRPC UNAVAILABLE), never "Request for unknown model" (404, NOT_FOUND), which
    clients take as final."""
    import shutil

    from gates import Gate
    from tritonclient.utils import InferenceServerException

    gate = Gate(tmp_path / "gate")
    repo = tmp_path / "repo"
    shutil.copytree(TEST_MODELS.parent / "lifecycle" / "gated_load", repo / "gated_load")
    config = repo / "gated_load" / "config.pbtxt"
    config.write_text(config.read_text().replace('"GATE"', json.dumps(gate.param)))
    gate.open()
    server = server_factory.start([repo])
    c = server.client()
    assert add_sub(c, "gated_load") == list(range(0, 32, 2))
    (gate.folder / "open").unlink()  # the next load of gated_load waits
    loads = len(gate.started())
    old = broker_pid(server)
    os.kill(old, signal.SIGKILL)
    gate.wait_started(loads + 1, timeout=2 * DEADLINE_S)  # the new broker loads it again
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            with pytest.raises(InferenceServerException) as e:
                add_sub(c, "gated_load")
            assert e.value.status() == "503", e.value  # (never a 404, whatever the frontend knows yet)
            if "went away while the request was in flight" not in e.value.message() or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # (the frontend has not seen the new broker yet: it does within a second)
        assert "loading again after the server's broker restarted" in e.value.message()
    finally:
        gate.open()
    deadline = time.monotonic() + DEADLINE_S
    while server.http_status("/v2/health/ready") != 200:
        assert time.monotonic() < deadline, "the broker did not come back ready"
        time.sleep(0.1)
    assert add_sub(c, "gated_load") == list(range(0, 32, 2))
    c.close()



def test_what_another_user_puts_at_the_journals_names_is_neither_written_through_nor_read(server_factory, tmp_path):
    """/dev/shm is every user's. A user the server does not even name puts a link to an
    operator's file at the temporary name journals were written to: the broker's next journal
    write goes elsewhere (a new file of its own) and the operator's file is untouched. A journal
    that is not the server's alone (here put in place by root for the other user, as a rename of
    that user's temporary file once did) is not read by the broker the launcher starts after a
    crash: it says why, opens no log file the journal names, and serves."""
    from as_nobody import NOBODY

    server = server_factory.start([PRODUCT_MODELS])
    journal = f"/dev/shm/shmserve.{server.id}.state.0"
    victim = tmp_path / "victim.conf"
    victim.write_text("the operator's\n")
    os.symlink(victim, journal + ".tmp")
    os.lchown(journal + ".tmp", NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        with server.client() as c:
            c.update_log_settings({"log_verbose_level": 1})  # a change the journal records
            assert victim.read_text() == "the operator's\n"
            with open(journal, "rb") as f:
                assert json.load(f)["log"]["log_verbose_level"] == 1
            st = os.stat(journal, follow_symlinks=False)
            assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600

            forged_log = tmp_path / "forged.log"
            with open(journal, "w") as f:
                json.dump({"log": {"log_file": str(forged_log)}}, f)
            os.chown(journal, NOBODY.pw_uid, NOBODY.pw_gid)
            old = broker_pid(server)
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 2 * DEADLINE_S
            while broker_pid(server) in (None, old) or server.http_status("/v2/health/ready") != 200:
                assert time.monotonic() < deadline, "the broker did not come back ready"
                time.sleep(0.1)
            assert f"is not the server's own journal (its owner is uid {NOBODY.pw_uid})" in server.log()
            assert not forged_log.exists()
            assert add_sub(c, "add_sub") == list(range(0, 32, 2))
    finally:
        if os.path.lexists(journal + ".tmp"):
            os.unlink(journal + ".tmp")
