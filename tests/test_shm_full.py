"""A /dev/shm that another program fills while the server runs: each request that needed a new
page is refused with a clear error (503), no process of the server or its local client dies of
SIGBUS, and everything works again once the room is back (shm/segment.py, shm/arena.py).

The server runs in a mount namespace of its own (``unshare -m``) with a small tmpfs on /dev/shm,
so the test fills that and never the host's; the filler writes through ``/proc/<pid>/root``,
and the local client joins the namespace with ``nsenter``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from as_nobody import NOBODY, start_as
from blob_models import infer, write_repo
from shm_filler import FILL
from conftest import PYTHON, ROOT, Server

MIB = 1 << 20
TMPFS_MB = 256

# The local client, inside the server's mount namespace: it connects, says so, then per line it
# reads sends one request (the input's size, the answer's, the byte) or makes a region ("region
# SIZE"), and prints what came back.
LOCAL_CLIENT = textwrap.dedent('''
    import json, sys
    import numpy as np
    from shmserve import Client
    try:
        client = Client(sys.argv[1], arena_bytes=16 << 20)
    except Exception as e:
        print(json.dumps({"connect_error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"connected": True}), flush=True)
    for line in sys.stdin:
        if line.startswith("region "):
            try:
                client.create_region("r", int(line.split()[1]))
                print(json.dumps({"ok": True}), flush=True)
            except Exception as e:
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        size, n, fill = (int(x) for x in line.split())
        try:
            out = client.infer("blob", {"IN": np.full(size, fill, dtype=np.uint8), "N": np.array([n], dtype=np.int64)})
            got = out["OUT"]
            print(json.dumps({"ok": bool(got.size == n and (got == fill).all())}), flush=True)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
''')


class NamespacedServer(Server):
    """The server in a mount namespace of its own, with a tmpfs of ``TMPFS_MB`` on /dev/shm."""

    def command(self) -> list[str]:
        mount = f'mount -t tmpfs -o size={TMPFS_MB}m tmpfs /dev/shm && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", *super().command()]

    @property
    def shm(self) -> Path:
        """Its /dev/shm, seen from outside the namespace."""
        return Path(f"/proc/{self.pid}/root/dev/shm")


class Filler:
    """A file that takes every page left in the server's /dev/shm, until removed."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "someone-elses-file"

    def fill(self) -> int:
        written = 0
        chunk = b"\xa5" * MIB
        with open(self.path, "ab", buffering=0) as f:
            while True:
                try:
                    written += f.write(chunk)
                except OSError:
                    break
            for size in (64 << 10, 4096):  # the last pages too
                while True:
                    try:
                        written += f.write(chunk[:size])
                    except OSError:
                        break
        return written

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _refused(client: httpclient.InferenceServerClient, model: str, size: int, n: int, fill: int) -> str:
    with pytest.raises(InferenceServerException) as e:
        infer(client, model, size, n, fill)
    assert e.value.status() == "503", e.value
    return e.value.message()


def _counts(client: httpclient.InferenceServerClient, model: str) -> tuple[int, int]:
    """The model's (successes, failures) in its statistics."""
    stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    return int(stats["success"]["count"]), int(stats["fail"]["count"])


@pytest.fixture
def full_server(tmp_path):
    server = NamespacedServer([write_repo(tmp_path / "repo", cache=True)], tmp_path,
                              ["--frontend-arena-mb", "32", "--worker-arena-mb", "16",
                               "--cache-config", f"local,size={16 * MIB}", "--allow-grpc", "false"])
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_a_full_dev_shm_is_a_503_where_a_page_was_wanted_and_no_process_dies(full_server):
    server = full_server
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    # Pages taken before the filler comes: the worker's answers up to 2 MiB (and the cache's log),
    # the first of the broker's arenas (an ensemble's batches and answers).
    assert (infer(client, "blob", 16, 16, 1) == 1).all()
    assert (infer(client, "blob_ensemble", 16, 16, 1) == 1).all()
    assert (infer(client, "blob", 16, 2 * MIB, 2) == 2).all()
    local = subprocess.Popen(["nsenter", "-t", str(server.pid), "-m", "--", PYTHON, "-c", LOCAL_CLIENT, server.id],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    filler = Filler(server.shm)
    try:
        assert json.loads(local.stdout.readline()) == {"connected": True}
        processes = sorted(server.tree())
        assert filler.fill() > 0

        # Small requests still go: their pages were taken before.
        assert (infer(client, "blob", 16, 16, 3) == 3).all()
        assert (infer(client, "blob_ensemble", 16, 16, 4) == 4).all()
        # The worker's answer past the pages it took (extent 0 is 4 MiB): a 503 naming /dev/shm,
        # which its statistics count as a failure, not a success.
        before = _counts(client, "blob")
        assert "/dev/shm" in _refused(client, "blob", 16, 3 * MIB + MIB // 2, 5)
        assert _counts(client, "blob") == (before[0], before[1] + 1)
        # A 12 MiB body in the frontend's arena, past the pages steady traffic keeps: a 503.
        assert "/dev/shm is full" in _refused(client, "blob", 12 * MIB, 16, 6)
        # An ensemble's answer in the broker's arena, past the pages its small answers took (and
        # no room to grow the arena either).
        refused = _refused(client, "blob_ensemble", 16, 2 * MIB, 7)
        block = 2 * MIB + 192  # the answer's descriptor (with the sequence parameters) and its block header
        assert refused.startswith(f"no room for the {block}-byte response of ensemble 'blob_ensemble': Failed to "
                                  "increase the shared memory pool size of the broker"), refused
        assert "no room in /dev/shm" in refused, refused
        # A new answer the cache cannot take a page for is answered, and not stored.
        assert (infer(client, "blob", 16, 2 * MIB, 8) == 8).all()
        # The local client: its input past its arena's first pages; a new client cannot even start.
        local.stdin.write(f"{8 * MIB} 16 9\n")
        local.stdin.flush()
        answer = json.loads(local.stdout.readline())
        assert "/dev/shm is full" in answer.get("error", ""), answer
        local.stdin.write(f"region {MIB}\n")  # a region it makes takes its pages then, or is refused
        local.stdin.flush()
        answer = json.loads(local.stdout.readline())
        assert "NoRoom: /dev/shm is full: region 'r'" in answer.get("error", ""), answer
        second = subprocess.run(["nsenter", "-t", str(server.pid), "-m", "--", PYTHON, "-c", LOCAL_CLIENT, server.id],
                                cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, (second.returncode, second.stderr[-2000:])
        assert "/dev/shm is full" in json.loads(second.stdout.splitlines()[-1])["connect_error"]

        assert sorted(server.tree()) == processes, server.log_tail()
        filler.remove()

        # With the room back, the same requests are answered, by the same processes.
        assert (infer(client, "blob", 16, 3 * MIB + MIB // 2, 5) == 5).all()
        assert (infer(client, "blob", 12 * MIB, 16, 6) == 6).all()
        assert (infer(client, "blob_ensemble", 16, 2 * MIB, 7) == 7).all()
        assert (infer(client, "blob", 16, 2 * MIB, 8) == 8).all()  # (not a wrong answer from the cache)
        local.stdin.write(f"{8 * MIB} 16 9\n")
        local.stdin.flush()
        assert json.loads(local.stdout.readline()) == {"ok": True}
        assert sorted(server.tree()) == processes
        assert "SIGBUS" not in server.log() and "died" not in server.log(), server.log_tail()
    finally:
        filler.remove()
        local.stdin.close()
        local.wait(30)


def test_processes_that_never_served_before_dev_shm_filled_still_answer_small_requests(full_server):
    """Every arena's first pages are taken when its segment is made, where the room was checked:
    a model first called after /dev/shm filled (its worker, the frontend's and the broker's
    arenas never written yet) answers small requests, and an error its model raises, instead of
    a 503 for want of the pages the start counted."""
    server = full_server
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    filler = Filler(server.shm)
    try:
        processes = sorted(server.tree())
        assert filler.fill() > 0
        assert (infer(client, "blob", 16, 16, 3) == 3).all()
        assert (infer(client, "blob_ensemble", 16, 16, 4) == 4).all()
        with pytest.raises(InferenceServerException) as e:
            infer(client, "blob", 16, -1, 5)  # (a negative length: the model's own error)
        assert e.value.status() != "503" and "/dev/shm" not in e.value.message(), e.value
        assert sorted(server.tree()) == processes, server.log_tail()
    finally:
        filler.remove()


def test_a_broker_restarted_while_dev_shm_is_full_says_so_and_comes_back_with_the_room(full_server):
    """A broker that dies while /dev/shm is full cannot make its objects: it says so in one line
    (no traceback), the launcher tries again with its back-off, and the server serves once the
    room is back."""
    server = full_server
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    assert (infer(client, "blob", 16, 16, 1) == 1).all()
    broker = next(pid for pid, title in server.titles().items() if title.startswith("shmserve broker "))
    filler = Filler(server.shm)
    try:
        assert filler.fill() > 0
        os.kill(broker, signal.SIGKILL)

        def refused() -> bool:
            filler.fill()  # (the pages the dead broker's objects free go to the filler too)
            return "cannot start: /dev/shm is full" in server.log()

        server.wait_until(refused, "the new broker refusing to start")
    finally:
        filler.remove()
    server.wait_ready()
    assert (infer(client, "blob", 16, 16, 2) == 2).all()
    assert "Traceback" not in server.log(), server.log_tail()


# A local client of a named user inside the server's mount namespace: "cut" truncates every object
# it may write (its own segment, broker.0, its lanes beside each worker's segment, the extents of
# its answers) and
# fills /dev/shm; "free" removes its file; "ask" connects a new client and sends one request.
CUT_AND_FILL = FILL + r"""
import time
from shmserve.shm.connection import Connection
sid = args["server"]
filler = "/dev/shm/nobodys-file"
def ask(fill):
    c = Client(sid)
    got = c.infer("blob", {"IN": np.full(16, fill, np.uint8), "N": np.array([16], np.int64)})["OUT"]
    c.close()
    return bool(got.size == 16 and (got == fill).all())
assert ask(1)
conn = Connection(sid, loop_driven=True)  # a segment of its own, which the server maps
for line in sys.stdin:
    if line.strip() == "cut":
        targets = ["/dev/shm" + conn.name, f"/dev/shm/shmserve.{sid}.broker.0"]
        targets += sorted("/dev/shm/" + n for n in os.listdir("/dev/shm")
                          if n.startswith(f"shmserve.{sid}.worker.") and not n.endswith(".fifo")
                          and os.access("/dev/shm/" + n, os.W_OK))
        for path in targets:
            os.truncate(path, 0)
        fill(filler)
        # The broker grows broker.0 back within a second and writes its header again, maybe before
        # the fill took the last page: cut it again once full, and take the pages that gave back,
        # so that its next write there finds no room (its sleeping flag, which it wrote at every
        # sleep, lies where this user cannot cut it now: shm/channel.py).
        time.sleep(1.5)
        os.truncate(f"/dev/shm/shmserve.{sid}.broker.0", 0)
        fill(filler)
        print("FULL " + json.dumps(sorted(os.path.basename(p) for p in targets)), flush=True)
    elif line.strip() == "free":
        os.unlink(filler)
        print("FREE", flush=True)
    elif line.strip() == "ask":
        print("ASKED " + json.dumps(ask(2)), flush=True)
os._exit(0)
"""


def test_a_named_user_who_truncates_and_then_fills_dev_shm_kills_no_server_process(tmp_path):
    """A truncation gives an object's pages back to /dev/shm, and grown back they are taken again
    only when touched: a client of a --local-client-users user that truncates what it may write
    and then fills /dev/shm left pages no touch could have, and the broker or a worker that
    touched one died of SIGBUS. Such a page is now replaced by a private zero page of the process
    (shm/truncation_guard.py), which says so, and put back once there is room: every process
    lives on, and serves again as soon as the room is back."""
    server = NamespacedServer([write_repo(tmp_path / "repo")], tmp_path,
                              ["--local-client-users=nobody", "--frontend-arena-mb", "32", "--worker-arena-mb", "16",
                               "--allow-grpc", "false"])
    server.start()
    attacker = None
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.url, network_timeout=30)
        assert (infer(client, "blob", 16, 16, 1) == 1).all()
        processes = sorted(server.tree())
        attacker = start_as(NOBODY.pw_uid, NOBODY.pw_gid, CUT_AND_FILL, {"server": server.id},
                            prefix=["nsenter", "-t", str(server.pid), "-m", "--"])
        attacker.stdin.write("cut\n")
        attacker.stdin.flush()
        full = attacker.stdout.readline()
        assert full.startswith("FULL "), (full, attacker.stderr.read() if attacker.poll() is not None else "")
        cut = json.loads(full[5:])
        assert {name.split(".")[2] for name in cut} == {"broker", "worker", "client"}, cut

        during = httpclient.InferenceServerClient(server.url, network_timeout=5)

        def replaced() -> bool:  # while full, requests may fail or wait: the point is what survives
            try:
                infer(during, "blob", 16, 16, 3)
            except Exception:  # noqa: BLE001 - a 503, or a timeout
                pass
            return "replaced by private zero pages" in server.log()

        server.wait_until(replaced, "a server process replacing a page /dev/shm has no room for")
        assert sorted(server.tree()) == processes, server.log_tail()
        attacker.stdin.write("free\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().strip() == "FREE"

        def served() -> bool:  # (a request sent before its worker's pages were put back may be lost)
            try:
                return bool((infer(during, "blob", 16, 16, 4) == 4).all())
            except Exception:  # noqa: BLE001 - a 503, or a timeout
                return False

        server.wait_until(served, "HTTP served again once the room is back", 60)
        server.wait_until(lambda: "put back" in server.log(), "the replaced pages put back")
        for fill in range(5, 25):
            assert (infer(client, "blob", 16, 64 << 10, fill) == fill).all()
        attacker.stdin.write("ask\n")  # a new local client of the named user is served too
        attacker.stdin.flush()
        assert attacker.stdout.readline().strip() == "ASKED true"
        assert sorted(server.tree()) == processes, "no server process died or was restarted"
        assert "SIGBUS" not in server.log() and "died" not in server.log(), server.log_tail()
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.communicate(timeout=30)
        server.stop()


def test_an_output_into_a_region_dev_shm_has_no_room_for_is_a_503_and_lands_once_there_is_room(full_server):
    """A client makes its region with ftruncate, which takes no page of /dev/shm. With /dev/shm
    full, the worker (or the broker, for an ensemble) cannot take the pages an output needs there:
    the request is a 503 naming /dev/shm and the region, never a 200 whose output was lost; with the
    room back, the same request writes its output into the region."""
    server = full_server
    n = 2 * MIB
    path = server.shm / f"out_region_{server.id}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    filler = Filler(server.shm)
    try:
        os.ftruncate(fd, n)
        client.register_system_shared_memory("outs", f"/out_region_{server.id}", n)

        def ask(model: str, fill: int) -> None:
            inputs = [httpclient.InferInput("IN", [16], "UINT8"), httpclient.InferInput("N", [1], "INT64")]
            inputs[0].set_data_from_numpy(np.full(16, fill, dtype=np.uint8))
            inputs[1].set_data_from_numpy(np.array([n], dtype=np.int64))
            out = httpclient.InferRequestedOutput("OUT")
            out.set_shared_memory("outs", n)
            client.infer(model, inputs, outputs=[out])

        # Pages taken before the filler comes: the worker's for answers up to n (an ensemble step's).
        assert (infer(client, "blob", 16, n, 1) == 1).all()
        assert (infer(client, "blob_ensemble", 16, 16, 1) == 1).all()
        assert filler.fill() > 0
        for model in ("blob", "blob_ensemble"):
            with pytest.raises(InferenceServerException) as e:
                ask(model, 3)
            assert e.value.status() == "503", e.value
            assert "/dev/shm is full" in e.value.message() and "'outs'" in e.value.message(), e.value.message()
        assert os.pread(fd, 16, 0) == bytes(16)
        filler.remove()
        for model, fill in (("blob", 5), ("blob_ensemble", 6)):
            ask(model, fill)
            assert os.pread(fd, n, 0) == bytes([fill]) * n
    finally:
        filler.remove()
        os.close(fd)
        try:
            client.unregister_system_shared_memory("outs")
        finally:
            path.unlink(missing_ok=True)


# A model that answers each request with an error response of its own (not an execute that
# raised), whose message is N bytes long: an answer as large as the caller asks, with no outputs.
ERROR_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("e" * n)))
        return responses
'''


def test_a_models_own_error_that_finds_no_room_is_a_503_counted_as_a_failure(tmp_path):
    """An error response the model returned itself counts as a success, as Triton counts it (the
    backend ran the request). When that error finds no room in the worker's arena, because
    /dev/shm is full, the client gets a 503 instead, and that is a failure: the worker must not
    count the answer it meant to give (``Worker._answer_ran``, from ``_answer``'s pair of
    statuses)."""
    from blob_models import BLOB_CONFIG

    repo = write_repo(tmp_path / "repo")
    (repo / "blob_error" / "1").mkdir(parents=True)
    (repo / "blob_error" / "config.pbtxt").write_text(  # blob's inputs and output, no response cache
        BLOB_CONFIG.replace('name: "blob"', 'name: "blob_error"').replace("response_cache { enable: true }\n", ""))
    (repo / "blob_error" / "1" / "model.py").write_text(ERROR_MODEL)
    server = NamespacedServer([repo], tmp_path, ["--frontend-arena-mb", "32", "--worker-arena-mb", "16",
                                                 "--allow-grpc", "false"])
    server.start()
    filler = Filler(server.shm)
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)

        def error_answer(n: int) -> tuple[str, str]:
            with pytest.raises(InferenceServerException) as e:
                infer(client, "blob_error", 16, n, 1)
            return e.value.status(), e.value.message()

        # Before the filler: the model's error comes back as it said it, counted as a success.
        status, message = error_answer(16)
        assert status != "503" and message == "e" * 16, (status, message)
        assert _counts(client, "blob_error") == (1, 0)
        processes = sorted(server.tree())
        assert filler.fill() > 0

        # A small error still fits in the pages its worker took before.
        assert error_answer(16) == (status, "e" * 16)
        assert _counts(client, "blob_error") == (2, 0)
        # An error past those pages (extent 0 is 4 MiB, its pages taken a MiB at a time): a 503
        # naming /dev/shm, and a failure in the statistics.
        refused_status, refused = error_answer(3 * MIB + MIB // 2)
        assert refused_status == "503" and "/dev/shm" in refused, (refused_status, refused[:500])
        assert _counts(client, "blob_error") == (2, 1), "an error answer that found no room was counted"
        assert sorted(server.tree()) == processes, server.log_tail()
        filler.remove()

        # With the room back, the same error is answered whole, and counted as a success again.
        assert error_answer(3 * MIB + MIB // 2) == (status, "e" * (3 * MIB + MIB // 2))
        assert _counts(client, "blob_error") == (3, 1)
        assert sorted(server.tree()) == processes
        assert "SIGBUS" not in server.log() and "died" not in server.log(), server.log_tail()
    finally:
        filler.remove()
        server.stop()


# A local client of a named user inside the server's mount namespace that connects, says so, then
# per line it reads sends one small request and prints what came back.
ASK_PER_LINE = r"""
c = Client(args["server"])
print("CONNECTED", flush=True)
for line in sys.stdin:
    try:
        got = c.infer("blob", {"IN": np.full(16, 7, np.uint8), "N": np.array([16], np.int64)})["OUT"]
        print("ANSWER " + json.dumps(bool(got.size == 16 and (got == 7).all())), flush=True)
    except InferenceServerError as e:
        print("ERROR " + json.dumps([e.status, e.message]), flush=True)
c.close()
os._exit(0)
"""


def test_a_first_answer_of_a_named_users_client_while_dev_shm_is_full_says_so(tmp_path):
    """Under --local-client-users no answer lies in a worker's first extent: each user's first
    answer makes that user's home extent. Where /dev/shm is full then, not even the error fits
    anywhere its client may read, and the answer came without a block: the client read "the
    server had no room in its shared-memory arena" (the arena was empty) and nothing said that
    /dev/shm was full. The completion now says why, for a named user's client and for the server's
    user's (the HTTP frontend's) alike."""
    server = NamespacedServer([write_repo(tmp_path / "repo")], tmp_path,
                              ["--local-client-users=nobody", "--frontend-arena-mb", "32", "--worker-arena-mb", "16",
                               "--allow-grpc", "false"])
    server.start()
    asker = None
    filler = Filler(server.shm)
    try:
        server.wait_ready()
        asker = start_as(NOBODY.pw_uid, NOBODY.pw_gid, ASK_PER_LINE, {"server": server.id},
                         prefix=["nsenter", "-t", str(server.pid), "-m", "--"])
        assert asker.stdout.readline().strip() == "CONNECTED", asker.stderr.read() if asker.poll() is not None else ""
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)
        processes = sorted(server.tree())
        assert filler.fill() > 0
        asker.stdin.write("ask\n")
        asker.stdin.flush()
        said = asker.stdout.readline()
        assert said.startswith("ERROR "), said
        status, message = json.loads(said[6:])
        assert status == 503 and "/dev/shm is full" in message, message
        assert "/dev/shm is full" in _refused(client, "blob", 16, 16, 1)
        assert sorted(server.tree()) == processes, server.log_tail()
        filler.remove()
        asker.stdin.write("ask\n")
        asker.stdin.flush()
        assert asker.stdout.readline().strip() == "ANSWER true"
        assert (infer(client, "blob", 16, 16, 2) == 2).all()
    finally:
        filler.remove()
        if asker is not None:
            asker.stdin.close()
            asker.wait(30)
        server.stop()
