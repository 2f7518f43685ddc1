"""Triton-style logging: the --log-* flags, line formats, worker prefixes, pb_utils.Logger, --log-file,
and the logging extension (GET/POST /v2/logging) changing every process at run time."""
from __future__ import annotations

import datetime
import json
import re
import subprocess
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PYTHON, ROOT, TESTS, raw_request

LOG_MODELS = TESTS / "models" / "logging"
# Triton's formats: "I1122 06:31:41.123456 1234 file.py:123] msg" and "2026-11-22T06:31:41Z I 1234 file.py:123] msg"
DEFAULT_RE = re.compile(r"^([IWEV])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) (\d+) ([\w.]+):(\d+)\] (.*)$")
ISO_RE = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)Z ([IWEV]) (\d+) ([\w.]+):(\d+)\] (.*)$")
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
            "log_format": "default"}
# What log_probe writes per request, in order (see tests/models/logging/log_probe/1/model.py).
PROBE_LINES = [("V", "method verbose"), ("E", "method error"), ("W", "method warning"), ("V", "enum verbose"),
               ("E", "enum error"), ("W", "enum warning"), ("I", "enum info"), ("I", "method info")]


def infer(server, request_id: str) -> None:
    """One request to log_probe; when it returns, the worker has written all of its lines."""
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    result = server.client().infer("log_probe", [x], request_id=request_id)
    assert result.as_numpy("Y").tolist() == [1, 2]


def whole_lines(text: str) -> list[str]:
    """Non-empty lines, without a last one another process may still be writing."""
    lines = text.split("\n")
    return [line for line in lines[:-1] if line.strip()]


def parsed(text: str, pattern: re.Pattern = DEFAULT_RE) -> list[dict]:
    """Log lines as dicts (level, pid, file, line, msg); lines of another shape are skipped."""
    out = []
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            g = m.groups()
            level = g[0] if pattern is DEFAULT_RE else g[6]
            out.append({"level": level, "pid": int(g[7]), "file": g[8], "line": int(g[9]), "msg": g[10],
                        "raw": line})
    return out


def probe_lines(text: str, request_id: str, pattern: re.Pattern = DEFAULT_RE) -> dict[str, dict]:
    """log_probe's lines for one request, by marker ("method info", ...)."""
    out = {}
    for rec in parsed(text, pattern):
        m = re.match(r"^\[log_probe v1 #\d\] (\w+ \w+) " + re.escape(request_id) + "$", rec["msg"])
        if m:
            out[m.group(1)] = rec
    return out


def pids_by_role(server) -> dict[str, list[int]]:
    roles: dict[str, list[int]] = {"launcher": [server.pid]}
    for pid, title in server.titles().items():
        for role in ("broker", "frontend", "worker"):
            if title.startswith(f"shmserve {role} "):
                roles.setdefault(role, []).append(pid)
    return roles


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def srv(module_factory):
    """Default flags, two HTTP frontends, log_probe with two instances."""
    return module_factory.start([LOG_MODELS], ["--http-workers", "2"])


# -- formats and flags ----------------------------------------------------------------------------


def test_default_format_on_every_line(server_factory):
    s = server_factory.start([LOG_MODELS])
    infer(s, "fmt-1")
    lines = whole_lines(s.log())
    assert lines
    bad = [line for line in lines if not DEFAULT_RE.match(line)]
    assert not bad, f"lines not in Triton's default format: {bad}"
    now = datetime.datetime.now(datetime.timezone.utc)
    for rec in parsed(s.log()):
        m = DEFAULT_RE.match(rec["raw"])
        assert m is not None
        month, day, hh, mm, ss = (int(v) for v in m.groups()[1:6])
        stamp = datetime.datetime(now.year, month, day, hh, mm, ss, tzinfo=datetime.timezone.utc)
        assert abs((now - stamp).total_seconds()) < 600, rec["raw"]  # UTC, as Triton logs
    roles = pids_by_role(s)
    recs = parsed(s.log())
    ready = [r for r in recs if r["msg"].startswith("server is ready")]
    assert ready and ready[0]["pid"] in roles["broker"] and ready[0]["file"] == "lifecycle.py"
    assert not any(r["level"] == "V" for r in recs)  # --log-verbose 0
    s.stop()  # (the launcher's own lines: what it stopped)
    recs = parsed(s.log())
    assert any(r["pid"] == s.pid and r["file"] == "launcher.py" for r in recs)
    assert not [line for line in whole_lines(s.log()) if not DEFAULT_RE.match(line)]


def test_iso8601_and_level_flags(server_factory):
    s = server_factory.start([LOG_MODELS], ["--log-format", "ISO8601", "--log-verbose", "1", "--log-info", "false",
                                            "--log-warning", "false"])
    infer(s, "iso-1")
    lines = whole_lines(s.log())
    bad = [line for line in lines if not ISO_RE.match(line)]
    assert not bad, f"lines not in Triton's ISO8601 format: {bad}"
    recs = parsed(s.log(), ISO_RE)
    assert {r["level"] for r in recs} == {"V", "E"}  # no INFO, no WARNING lines from any process
    probe = probe_lines(s.log(), "iso-1", ISO_RE)
    assert set(probe) == {"method verbose", "enum verbose", "method error", "enum error"}
    assert all(rec["file"] == "model.py" for rec in probe.values())
    # Verbose level 1 says what the server does, as Triton's does: each execution, here log_probe's
    # request; not other libraries' debug chatter (grpc's event loop, the repository watcher's
    # file events: level 2), nor each process's first settings.
    verbose = [r for r in recs if r["level"] == "V"]
    assert any(r["msg"].endswith("model log_probe, instance log_probe_0_0, executing 1 requests") for r in verbose), \
        verbose
    assert {r["file"] for r in verbose} <= {"model.py", "worker.py", "clients.py"}, {r["file"] for r in verbose}
    assert not any(r["msg"].startswith("log settings:") for r in recs)
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = datetime.datetime.strptime(probe["method error"]["raw"][:20], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((now - stamp.replace(tzinfo=datetime.timezone.utc)).total_seconds()) < 600


def test_bad_flags_are_one_line_errors(tmp_path):
    for args, needle in [(["--log-format", "json"], "--log-format"), (["--log-info", "maybe"], "--log-info"),
                         (["--log-verbose", "-1"], "--log-verbose"),
                         (["--log-file", str(tmp_path / "missing" / "x.log")], "cannot open --log-file")]:
        r = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(tmp_path), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, (args, r.stderr)


# -- worker lines and pb_utils.Logger -----------------------------------------------------------------


def test_worker_lines_name_model_version_instance(srv):
    roles = pids_by_role(srv)
    recs = parsed(srv.log())
    for index in (0, 1):
        init = [r for r in recs if r["msg"] == f"[log_probe v1 #{index}] log_probe initialized as log_probe_0_{index}"]
        assert len(init) == 1, recs
        assert init[0]["level"] == "I" and init[0]["file"] == "model.py" and init[0]["line"] == 14
        assert init[0]["pid"] in roles["worker"]
    # Every line a worker wrote carries its prefix.
    for r in recs:
        if r["pid"] in roles["worker"]:
            assert re.match(r"^\[log_probe v1 #[01]\] ", r["msg"]), r["raw"]


def test_pb_utils_logger_levels(srv):
    infer(srv, "lvl-1")
    probe = probe_lines(srv.log(), "lvl-1")
    expected = {marker: level for level, marker in PROBE_LINES if level != "V"}  # verbose is off
    assert {m: r["level"] for m, r in probe.items()} == expected
    lines = [r["line"] for r in probe.values()]
    assert all(r["file"] == "model.py" for r in probe.values())
    assert lines == sorted(lines) and len(set(lines)) == len(lines)  # each call's own line in model.py


# -- --log-file ------------------------------------------------------------------------------------------


def test_log_file_gets_lines_from_every_process(server_factory, tmp_path):
    path = tmp_path / "shmserve.log"
    path.write_text("kept from before\n")
    s = server_factory.start([LOG_MODELS], ["--log-file", str(path), "--http-workers", "2"])
    infer(s, "file-1")
    roles = pids_by_role(s)
    assert len(roles["frontend"]) == 2
    # Ready means one frontend answers; the other may still be starting.
    wait_for(lambda: set(roles["frontend"]) <= {r["pid"] for r in parsed(path.read_text())},
             "both frontends' first line in the log file")
    text = path.read_text()
    assert text.startswith("kept from before\n")  # appended, not truncated
    recs = parsed(text)
    pids = {r["pid"] for r in recs}
    assert set(roles["broker"]) <= pids, "no broker line"
    assert set(roles["frontend"]) <= pids, "a frontend wrote no line"
    assert len(roles["worker"]) == 2 and set(roles["worker"]) <= pids, "a worker wrote no line"
    assert "method info" in probe_lines(text, "file-1")
    assert all(line == "kept from before" or DEFAULT_RE.match(line) for line in whole_lines(text))
    # Nothing went to stderr instead.
    assert not any(DEFAULT_RE.match(line) for line in s.log().splitlines()), s.log_tail()
    s.stop()  # the launcher's own lines say what it stopped
    assert s.pid in {r["pid"] for r in parsed(path.read_text())}, "no launcher line"


# -- the logging extension --------------------------------------------------------------------------------


def test_logging_extension_is_advertised(srv):
    assert "logging" in srv.client().get_server_metadata()["extensions"]


def test_get_log_settings(srv):
    assert srv.client().get_log_settings() == DEFAULTS
    raw = raw_request(srv.port, "GET", "/v2/logging")
    assert raw.status == 200 and raw.headers["content-type"].startswith("application/json")
    assert raw.json() == DEFAULTS


def test_runtime_verbosity_reaches_every_process(srv):
    client = srv.client()
    infer(srv, "rt-before")
    assert "method verbose" not in probe_lines(srv.log(), "rt-before")
    mark = len(srv.log())
    try:
        answer = client.update_log_settings({"log_verbose_level": 1})
        assert answer == {**DEFAULTS, "log_verbose_level": 1}
        assert client.get_log_settings() == answer
        # Each process logs the change at verbose level 1 once it applies it.
        roles = pids_by_role(srv)

        def applied() -> set[int]:
            return {r["pid"] for r in parsed(srv.log()[mark:]) if r["level"] == "V"
                    and r["msg"].endswith('"log_verbose_level":1,"log_format":"default"}')}

        others = {srv.pid, *roles["broker"], *roles["frontend"]}
        wait_for(lambda: others <= applied(), "the launcher, broker and both frontends to apply the settings")
        infer(srv, "rt-on")
        probe = probe_lines(srv.log(), "rt-on")
        assert probe["method verbose"]["level"] == "V" and probe["enum verbose"]["level"] == "V"
        assert probe["method verbose"]["pid"] in applied() & set(roles["worker"])
    finally:
        answer = client.update_log_settings({"log_verbose_level": 0})
    assert answer == DEFAULTS
    infer(srv, "rt-off")
    probe = probe_lines(srv.log(), "rt-off")
    assert "method info" in probe and "method verbose" not in probe and "enum verbose" not in probe


def test_runtime_format_and_levels(srv):
    client = srv.client()
    try:
        answer = client.update_log_settings({"log_format": "ISO8601", "log_info": False})
        assert answer == {**DEFAULTS, "log_format": "ISO8601", "log_info": False}
        infer(srv, "iso-rt")
        probe = probe_lines(srv.log(), "iso-rt", ISO_RE)
        assert set(probe) == {"method error", "method warning", "enum error", "enum warning"}
    finally:
        assert client.update_log_settings({"log_format": "default", "log_info": True}) == DEFAULTS
    infer(srv, "back-rt")
    assert "method info" in probe_lines(srv.log(), "back-rt")


@pytest.mark.parametrize("body, needle", [
    ({"log_verbose_level": -1}, "'log_verbose_level' must be an integer >= 0"),
    ({"log_verbose_level": "2"}, "'log_verbose_level' must be an integer >= 0"),
    ({"log_verbose_level": True}, "'log_verbose_level' must be an integer >= 0"),
    ({"log_info": "yes"}, "'log_info' must be a boolean"),
    ({"log_error": 1}, "'log_error' must be a boolean"),
    ({"log_format": "json"}, "'log_format' must be 'default' or 'ISO8601'"),
    ({"log_colour": True}, "unknown log setting 'log_colour'"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_log_settings_are_400(srv, body, needle):
    raw = raw_request(srv.port, "POST", "/v2/logging", json.dumps(body).encode())
    assert raw.status == 400, raw
    assert needle in raw.json()["error"]
    if isinstance(body, dict):
        with pytest.raises(InferenceServerException) as e:
            srv.client().update_log_settings(body)
        assert e.value.status() == "400" and needle in e.value.message()
    assert srv.client().get_log_settings() == DEFAULTS  # nothing changed


def test_the_log_file_cannot_be_changed_over_the_network(srv):
    """Triton's refusal, over HTTP (501) and gRPC (UNIMPLEMENTED): a client that could name the
    file could make the server append to any file its user may write."""
    import tritonclient.grpc as grpcclient

    text = "log file location can not be updated through network protocol"
    for value in ("/tmp/elsewhere.log", ""):  # the current value too, as Triton refuses it
        raw = raw_request(srv.port, "POST", "/v2/logging", json.dumps({"log_file": value}).encode())
        assert (raw.status, raw.json()) == (501, {"error": text})
    with grpcclient.InferenceServerClient(srv.wait_grpc_ready().grpc_url) as g:
        with pytest.raises(InferenceServerException) as e:
            g.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert (e.value.status(), e.value.message()) == ("StatusCode.UNIMPLEMENTED", text)
    assert srv.client().get_log_settings() == DEFAULTS


def test_a_null_setting_changes_nothing(srv):
    """As Triton: a key given null is passed over (log_file too, which any value would change)."""
    body = {key: None for key in DEFAULTS}
    raw = raw_request(srv.port, "POST", "/v2/logging", json.dumps(body).encode())
    assert (raw.status, raw.json()) == (200, DEFAULTS)


def test_a_relative_log_file_is_shown_as_given(server_factory, tmp_path):
    """As Triton: the logging API shows the file as the flag named it (over HTTP and gRPC); every
    process writes where it points from the directory the server started in."""
    import os

    import tritonclient.grpc as grpcclient

    path = tmp_path / "relative.log"
    given = os.path.relpath(path, ROOT)  # (the servers start in ROOT)
    s = server_factory.start([LOG_MODELS], ["--log-file", given])
    assert s.client().get_log_settings()["log_file"] == given
    with grpcclient.InferenceServerClient(s.wait_grpc_ready().grpc_url) as g:
        assert g.get_log_settings(as_json=True)["settings"]["log_file"]["string_param"] == given
    infer(s, "relative-1")
    wait_for(lambda: "relative-1" in path.read_text(), "the request's lines in the log file")


def test_a_frontend_keeps_the_log_file_it_opened_when_it_follows_a_change(server_factory, tmp_path):
    """The frontend that forwarded a POST /v2/logging applies the broker's answer at once
    (``logs.follow``), and that answer names the file as the flag did (relative here): it must
    take every setting but the file, and keep writing to the file it opened. Once, it reopened
    the file by that shown name. The file is renamed (as a rotation would) before the POST, so a
    reopen by any name shows as a new file at the old name holding the frontend's lines."""
    import os

    import tritonclient.grpc as grpcclient

    path = tmp_path / "following.log"
    rotated = tmp_path / "following.log.1"
    given = os.path.relpath(path, ROOT)  # (the servers start in ROOT)
    s = server_factory.start([LOG_MODELS], ["--log-file", given])
    roles = pids_by_role(s)
    [frontend] = roles["frontend"]
    grpc_pids = [pid for pid, title in s.titles().items() if title.startswith("shmserve grpc ")]
    assert len(grpc_pids) == 1, s.titles()
    wait_for(lambda: {frontend, *grpc_pids} <= {r["pid"] for r in parsed(path.read_text())},
             "the frontends' first lines in the log file")
    assert not [r for r in parsed(path.read_text()) if r["level"] == "V"], "a verbose line before any change"

    def changes(pid: int, level: int) -> list[dict]:
        """The lines in which ``pid`` says it applied log_verbose_level ``level`` (its first
        line at that level: a process logs each change at verbose level 1)."""
        return [r for r in parsed(rotated.read_text()) if r["pid"] == pid and r["level"] == "V"
                and r["msg"].startswith("log settings: ") and f'"log_verbose_level":{level},' in r["msg"]]

    os.rename(path, rotated)
    answer = s.client().update_log_settings({"log_verbose_level": 1})  # through the one HTTP frontend
    assert answer == {**DEFAULTS, "log_file": given, "log_verbose_level": 1}
    # (A frontend applies the answer before it sends it on: any reopen has happened by now.)
    assert not path.exists(), f"the HTTP frontend reopened the log file by name: {path.read_text()!r}"
    wait_for(lambda: changes(frontend, 1), "the HTTP frontend's verbose line in the file it opened")
    with grpcclient.InferenceServerClient(s.wait_grpc_ready().grpc_url) as g:  # the gRPC frontend follows too
        g.update_log_settings({"log_verbose_level": 2})
    assert not path.exists(), f"the gRPC frontend reopened the log file by name: {path.read_text()!r}"
    wait_for(lambda: changes(grpc_pids[0], 2), "the gRPC frontend's verbose line in the file it opened")
    infer(s, "following-1")  # a request through the HTTP frontend, lines from the worker
    wait_for(lambda: "method verbose" in probe_lines(rotated.read_text(), "following-1"),
             "the worker's verbose line in the file it opened")
    assert not path.exists(), f"a process reopened the log file by name: {path.read_text()!r}"
    s.stop()
    assert s.pid in {r["pid"] for r in parsed(rotated.read_text())}, "no launcher line"
    assert not path.exists(), f"a process reopened the log file by name: {path.read_text()!r}"
    assert not any(DEFAULT_RE.match(line) for line in s.log().splitlines()), s.log_tail()  # none went to stderr


def test_unparsable_body_is_400(srv):
    raw = raw_request(srv.port, "POST", "/v2/logging", b"{not json")
    assert raw.status == 400 and "failed to parse the request JSON" in raw.json()["error"]


def test_empty_post_changes_nothing(srv):
    raw = raw_request(srv.port, "POST", "/v2/logging", b"{}")
    assert raw.status == 200 and raw.json() == DEFAULTS


def test_the_start_says_only_what_is_true(server_factory):
    """model_repository/ as `make serve` starts it: no step of its ensemble is "asked for again",
    the digits model's few kilobytes of shared weights are not "0.0 MB", and no line says HTTP is
    served while the frontend is not serving yet (held stopped here until the models are loaded)."""
    import os
    import signal

    from conftest import PRODUCT_MODELS

    s = server_factory.create([PRODUCT_MODELS]).start()
    deadline = time.monotonic() + 120
    frontend = None
    while frontend is None and time.monotonic() < deadline:
        frontend = next((pid for pid, title in s.titles().items()
                         if title.startswith(f"shmserve frontend {s.id} #0")), None)
        time.sleep(0.01)
    assert frontend is not None, s.log_tail()
    os.kill(frontend, signal.SIGSTOP)
    try:
        s.wait_until(lambda: "server is ready" in s.log(), "the models loaded")
        time.sleep(1.0)  # (the launcher's supervision loop has run meanwhile)
        assert "serving HTTP" not in s.log(), s.log_tail()
    finally:
        os.kill(frontend, signal.SIGCONT)
    s.wait_ready()
    s.wait_until(lambda: "serving HTTP on" in s.log(), "the frontend's line")
    log = s.log()
    assert re.search(rf"\] frontend #0 serving HTTP on 127\.0\.0\.1:{s.port} \(at most \d+ connections\)", log), log
    # Each endpoint said once, by the process that serves it (as Triton's "Started ... at" lines).
    assert log.count(f"serving gRPC on 127.0.0.1:{s.grpc_port}") == 1, log
    assert log.count(f"serving metrics on 127.0.0.1:{s.metrics_port}") == 1, log
    assert "asked for again" not in log, log
    sizes = re.findall(r"'digits' instance '\w+': ([\d.]+) (kB|MB) of weights in one shared copy", log)
    assert sizes and all(float(n) > 0 for n, _ in sizes), sizes
