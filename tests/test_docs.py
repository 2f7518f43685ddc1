"""The commands of README.md and docs/tools.md, run as written against a real server: what a new
user types after `make serve` has to work (the venv prefix or its activation included).

Each ```sh and ```python block is run as it stands, in a folder laid out like the checkout (the
venv, model_repository/, tools/), with three kinds of change only: the server's addresses and
--id are the test server's, shmserve-perf and shmserve-analyzer get flags appended that shorten
their windows and bound the analyzer's search, and blocks that cannot run here are listed in
NOT_RUN with the reason. The README's function example is saved as app.py and served by
`.venv/bin/python app.py`, and its curl call is sent to it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, free_port, free_ports, new_server_id, remove_shm_entries, shm_entries

VENV = Path(PYTHON).parent.parent
DOCS = ("README.md", "docs/tools.md", "docs/local_client.md", "docs/binding.md")
# First words of a block that is not run here, and why.
NOT_RUN = {
    "make serve": "the server under test is the one `make serve` starts (tests/conftest.py)",
    "docker build": "needs Docker and a network; tests/test_container.py builds the image with podman",
    "git clone": "Triton's programs need a network; tests/test_triton_examples.py and test_grpc_examples.py "
                 "check what they rely on",
}
# Lines that are not run: `pip install` of an extra, which `make test` has done (checked in
# test_the_extras_the_docs_name_are_installed).
# The checkout's parts the commands use, linked into the folder they run in.
CHECKOUT = ("model_repository", "tools", "examples")
# What a block's output shows when it worked, by a piece of its text.
EXPECTED = {
    "/v2/health/ready": "200",
    "/v2/models/add_sub/infer": '"OUTPUT0"',
    "nv_inference_request_success": "nv_inference_request_success{",
    "client.infer(\"add_sub\", inputs)": "[ 1  2  3  4",  # a + b, a - b
    '{"INPUT0": a, "INPUT1": b}': "[ 1  2  3  4",
    'client.stream("word_stream"': "world",
    "shmserve-perf -m add_sub -u": "Throughput:",
    "shmserve-perf -m word_stream": "Avg time to first response",
    "shmserve-analyzer": "Report: ",
}
QUICK_PERF = "-p 300 -r 4 --warmup 0 -q"
QUICK_ANALYZER = ("-p 300 -r 3 -q --run-config-search-max-instance-count 1 --run-config-search-max-model-batch-size 1 "
                  "--run-config-search-max-preferred-batch-size 1 --queue-delays 0 "
                  "--run-config-search-max-concurrency 1")


@dataclass
class Block:
    doc: str
    index: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}#{self.index}:{self.text.split(chr(10))[0][:40]}"


def blocks(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text()
    return [Block(doc, i, m.group(1), m.group(2))
            for i, m in enumerate(re.finditer(r"^```(sh|python)\n(.*?)^```", text, re.M | re.S))]


def inline_commands(doc: str) -> list[str]:
    """Commands quoted in a doc's prose and tables: `curl ...` and `.venv/bin/...` spans."""
    text = (ROOT / doc).read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).replace("\n", " ")
    return [c for c in re.findall(r"`([^`]+)`", text)
            if c.startswith("curl ") or (c.startswith(".venv/bin/") and " " in c and " install " not in c)]


def skipped_because(text: str) -> str | None:
    first = text.strip().split("\n")[0]
    return next((why for start, why in NOT_RUN.items() if first.startswith(start)), None)


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
FUNCTION_EXAMPLES = [b for b in ALL_BLOCKS if "shmserve.serve(" in b.text]  # a script serving functions
RUN_BLOCKS = [b for b in ALL_BLOCKS if b not in FUNCTION_EXAMPLES and not skipped_because(b.text)]


def for_server(text: str, url: str, grpc_url: str, metrics: str, server_id: str) -> str:
    """The doc's default addresses and --id, made the test server's."""
    text = re.sub(r"\b(localhost|127\.0\.0\.1):(8000|18000|18600)\b", url, text)
    text = re.sub(r"\b(localhost|127\.0\.0\.1):8001\b", grpc_url, text)
    text = re.sub(r"\b(localhost|127\.0\.0\.1):8002\b", metrics, text)
    text = text.replace('Client("shmserve")', f'Client("{server_id}")')
    return re.sub(r"-u shmserve\b", f"-u {server_id}", text)


def shortened(text: str, server_url: str, server_id: str) -> str:
    """Short windows for the measuring tools; the example clients pointed at the server."""
    text = text.replace("\\\n", " ")
    lines = []
    for line in text.split("\n"):
        command, comment = re.match(r"(.*?)(\s+#.*)?$", line).groups()  # type: ignore[union-attr]
        words = command.split()
        tool = Path(words[0]).name if words else ""
        if tool == "shmserve-perf":
            command += f" {QUICK_PERF}" + (" --pairs 1" if "--compare" in command else "")
            if " -u " not in command and " -i grpc" not in command:
                command += f" -u {server_url}"
        elif tool == "shmserve-analyzer":  # (and a goal this loaded host meets)
            command += f" {QUICK_ANALYZER}" + (" --min-throughput 1" if "--min-throughput" in command else "")
        elif tool == "pip" and words[1:2] == ["install"]:
            command = ": " + command
        elif words[:2] in ([".venv/bin/python", "tools/examples.py"], [".venv/bin/python", "tools/digits_client.py"]):
            command += f" --url {server_url}" + (f" --id {server_id}" if "examples.py" in command else "")
        lines.append(command + (comment or ""))
    return "\n".join(lines)


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A folder laid out like the checkout, for the commands' relative paths and their output files."""
    root = tmp_path / "checkout"
    root.mkdir()
    (root / ".venv").symlink_to(VENV)
    for part in CHECKOUT:
        (root / part).symlink_to(ROOT / part)
    (tmp_path / "home").mkdir()
    return root


def user_env(checkout: Path) -> dict[str, str]:
    """A user's shell: the venv not active (the docs say how), its own home."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "XDG_DATA_HOME", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(VENV)))
    env["HOME"] = str(checkout.parent / "home")
    return env


def activations(block: Block) -> str:
    """The `source .venv/bin/activate` lines of the doc's earlier blocks: the user's shell keeps them."""
    earlier = [b for b in ALL_BLOCKS if b.doc == block.doc and b.index < block.index]
    return "\n".join(line.split("#")[0] for b in earlier for line in b.text.split("\n")
                     if line.startswith("source .venv/bin/activate"))


def run_shell(script: str, cwd: Path, timeout: float = 280) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=cwd, env=user_env(cwd),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def check_output(text: str, run: subprocess.CompletedProcess) -> None:
    shown = f"--- command\n{text}\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    assert run.returncode == 0, shown
    assert "Traceback" not in run.stdout + run.stderr, shown
    assert '{"error"' not in run.stdout, shown
    for piece, expected in EXPECTED.items():
        if piece in text:
            assert expected in run.stdout, f"expected {expected!r}\n{shown}"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.id)
def test_doc_block_runs_as_written(block: Block, server, checkout):
    text = for_server(block.text, server.url, server.grpc_url, f"127.0.0.1:{server.metrics_port}", server.id)
    if block.lang == "python":
        script = checkout / "snippet.py"
        script.write_text(text)
        run = subprocess.run([".venv/bin/python", script.name], cwd=checkout, env=user_env(checkout),
                             capture_output=True, text=True, timeout=120)
    else:
        run = run_shell(activations(block) + "\n" + shortened(text, server.url, server.id), checkout)
    check_output(text, run)
    if "shmserve-analyzer" in text:
        # The report lands outside the checkout unless -e says where.
        assert not (checkout / "analyzer_results").exists()
        if " -e " not in text:
            assert (checkout.parent / "home" / ".local" / "share" / "shmserve-analyzer" / "digits" / "report.html").is_file()


@pytest.mark.parametrize("command", [c for c in inline_commands("README.md") if "/models/scale/" not in c
                                     and "app.py" not in c])
def test_readme_inline_command_runs_as_written(command: str, server, checkout):
    text = for_server(command, server.url, server.grpc_url, f"127.0.0.1:{server.metrics_port}", server.id)
    check_output(text, run_shell(shortened(text, server.url, server.id), checkout))


@pytest.mark.parametrize("block", FUNCTION_EXAMPLES, ids=lambda b: b.id)
def test_a_function_example_serves_and_answers(block: Block, checkout):
    """`.venv/bin/python app.py` with the doc's code: every function it declares is served, and
    the doc's own curl call to one (the README's) answers."""
    http, grpc, metrics = free_ports(3)
    server_id = new_server_id()
    code = block.text.replace(
        "http_port=8000", f"http_port={http}, grpc_port={grpc}, metrics_port={metrics}, id={server_id!r}")
    assert code != block.text, "the example no longer serves on port 8000"
    (checkout / "app.py").write_text(code)
    assert "python app.py" in (ROOT / block.doc).read_text()
    models = re.findall(r"^def (\w+)\(", block.text, re.M)
    calls = [c for c in inline_commands(block.doc) if any(f"/v2/models/{m}/" in c for m in models)]
    log = checkout.parent / "app.log"
    with log.open("wb") as out:
        app = subprocess.Popen([".venv/bin/python", "app.py"], cwd=checkout, env=user_env(checkout),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for model in models:
            ready = f"curl -s -o /dev/null -w '%{{http_code}}' 127.0.0.1:{http}/v2/models/{model}/ready"
            deadline = time.monotonic() + 120
            while (run := run_shell(ready + " || true", checkout, timeout=30)).stdout != "200":
                assert app.poll() is None and time.monotonic() < deadline, f"{model}: {log.read_text()[-3000:]}"
                time.sleep(0.5)
        for call in calls:
            run = run_shell(for_server(call, f"127.0.0.1:{http}", "", "", server_id), checkout, timeout=30)
            assert '"outputs"' in run.stdout, f"{run.stdout}\n{run.stderr}\n{log.read_text()[-3000:]}"
            if "/models/scale/" in call:
                assert '"data":[2.0,4.0,6.0]' in run.stdout.replace(" ", ""), run.stdout
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGTERM)
            try:
                app.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(app.pid, signal.SIGKILL)
                app.wait()
        left = shm_entries(server_id)
        remove_shm_entries(server_id)
    assert not left, left
    assert block.doc != "README.md" or calls, "the README's call to its function example"


@pytest.mark.parametrize("command", [".venv/bin/python tools/examples.py pipeline",
                                     ".venv/bin/python tools/digits_client.py"])
def test_an_example_client_with_no_server_says_how_to_start_one(command: str, checkout):
    """The README's example clients run before `make serve` (or against another port): one line
    that names the address and `make serve`, exit 1, no traceback."""
    port = free_port()
    run = run_shell(f"{command} --url 127.0.0.1:{port}", checkout, timeout=120)
    assert run.returncode == 1, run
    assert "Traceback" not in run.stderr, run.stderr
    assert f"no server answers at 127.0.0.1:{port} (" in run.stderr, run.stderr
    assert "start one with `make serve` in another shell, or pass --url" in run.stderr, run.stderr


def test_the_local_example_with_no_server_says_which_id_it_tried(checkout):
    server_id = new_server_id()
    run = run_shell(f".venv/bin/python tools/examples.py local --id {server_id}", checkout, timeout=120)
    assert run.returncode == 1, run
    assert "Traceback" not in run.stderr, run.stderr
    assert f"examples.py local: no shmserve server with id '{server_id}' is running on this host" in run.stderr, \
        run.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this host")
def test_make_serve_takes_other_ports_from_serve_flags():
    """The README's `make serve SERVE_FLAGS=...`, for a host where another server holds 8000-8002:
    the flags given win over the Makefile's own, the models serve there, and Ctrl-C stops it all.
    (-o: the venv is this one, not installed again.)"""
    http, grpc, metrics = free_ports(3)
    server_id = new_server_id()
    flags = f"--http-port {http} --grpc-port {grpc} --metrics-port {metrics} --id {server_id}"
    make = subprocess.Popen(["make", "-s", "-C", str(ROOT), f"VENV={VENV}", "-o", f"{VENV}/.installed-serve", "serve",
                             f"SERVE_FLAGS={flags}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while (run := subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                      f"127.0.0.1:{http}/v2/models/add_sub/ready"],
                                     capture_output=True, text=True)).stdout != "200":
            assert make.poll() is None and time.monotonic() < deadline, make.stdout.read() if make.poll() else ""
            time.sleep(0.5)
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the shell that ran it
        out, _ = make.communicate(timeout=60)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        left = shm_entries(server_id)
        remove_shm_entries(server_id)
    assert "unless SERVE_FLAGS says otherwise" in out, out
    assert f"serving HTTP on 0.0.0.0:{http}" in out and f"serving gRPC on 0.0.0.0:{grpc}" in out, out
    assert f"serving metrics on 0.0.0.0:{metrics}" in out, out
    assert "its shared-memory objects are removed" in out, out
    assert not left, left


def test_the_extras_the_docs_name_are_installed():
    """The blocks not run above install extras; `make test` installs them, so what they bring is here."""
    import importlib.util

    pyproject = (ROOT / "pyproject.toml").read_text()
    named = [extra for doc in DOCS
             for extra in re.findall(r"pip install\s+-e\s+'\.\[([\w-]+)\]'", (ROOT / doc).read_text())]
    assert {"plots", "s3"} <= set(named), named
    for extra in named:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    assert importlib.util.find_spec("matplotlib") and importlib.util.find_spec("plotly")
