"""tools/body_rate.py: docs/performance.md's "Large bodies" command runs as written (with short
windows), and what the tool counts is what a server served."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

from conftest import PYTHON, ROOT

from shmserve.tools.body_rate import main as body_rate


def documented_command() -> str:
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text[text.index("## Large bodies"):]
    return re.search(r"^```sh\n(.*?)\n```", section, re.M | re.S).group(1)


def test_the_documented_command_runs(tmp_path):
    out = tmp_path / "rate.json"
    words = shlex.split(documented_command())
    assert words[:3] == [".venv/bin/python", "-m", "shmserve.tools.body_rate"], words
    # Later flags win: one round of short windows, two shmservers instead of three.
    run = subprocess.run([PYTHON, *words[1:], "--rounds", "1", "--seconds", "0.3", "--frontends", "1", "2",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["body_bytes"] == 600_171 and result["memcpy_gb_s"] > 0
    names = [t["target"] for t in result["targets"]]
    assert names == ["shmserve-1", "shmserve-2", "floor-asgi", "floor-starlette"], names
    for t in result["targets"]:
        (w,) = t["windows"]
        assert w["rps"] > 0 and w["server_cpu_us"] > 0 and w["client_cpu_us"] > 0, t
        assert abs(w["gb_s"] - w["rps"] * 600_171 / 1e9) < 0.002, t
    assert "shmserve-2" in run.stdout and "floor-asgi" in run.stdout
    assert not [n for n in os.listdir("/dev/shm") if "shmserve.bodyrate" in n]


def success_count(server, model: str) -> int:
    with server.client() as c:
        return int(c.get_inference_statistics(model)["model_stats"][0]["inference_stats"]["success"]["count"])


def test_what_it_counts_the_server_served(server_factory, tmp_path, capsys):
    """Against a running server (``--url``, the repository it writes): the requests it counts in
    its windows were served, and no more than the server counted (its warm-up is not counted)."""
    repo = tmp_path / "repo"
    assert body_rate(["--repository", str(repo)]) == 0
    s = server_factory.start([repo])
    before = success_count(s, "body_sink")
    out = tmp_path / "rate.json"
    assert body_rate(["--url", s.url, "--floors", "--rounds", "2", "--seconds", "0.5", "--clients", "2",
                      "--json", str(out)]) == 0
    served = success_count(s, "body_sink") - before
    (target,) = json.loads(out.read_text())["targets"]
    counted = sum(w["requests"] for w in target["windows"])
    assert 0 < counted <= served, (counted, served)
    assert s.url in capsys.readouterr().out
