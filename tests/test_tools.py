"""The benchmark tools against a real server: they must measure what they say, or the README's
figures mean nothing."""
from __future__ import annotations

import json
import math
import os
import subprocess

from conftest import PYTHON, ROOT


def test_paired_alternates_targets_and_reports_ratios(server, tmp_path):
    out = tmp_path / "paired.json"
    run = subprocess.run(
        [PYTHON, "-m", "tools.paired", "--model", "add_sub", "--clients", "2", "--pairs", "2",
         "--slice", "0.3", "--warmup", "0.05", "--target", f"http={server.url}",
         "--target", f"local=local:{server.id}", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    # A B B A: the order alternates so that a drifting host weighs on both alike.
    assert [s["target"] for s in result["slices"]] == ["http", "local", "local", "http"]
    for s in result["slices"]:
        assert s["rps"] > 0 and s["p50_us"] > 0 and s["p99_us"] >= s["p50_us"], s
        assert s["client_cpu_us"] > 0, s  # a closed loop of calls costs its process CPU
    summary = result["vs_baseline"]["local"]
    assert summary["pairs"] == 2
    assert math.isfinite(summary["rps_ratio_median"]) and summary["rps_ratio_median"] > 0
    assert summary["rps_ratio_min"] <= summary["rps_ratio_median"] <= summary["rps_ratio_max"]
    assert "local / http: throughput" in run.stdout


def test_paired_refuses_bad_targets():
    run = subprocess.run([PYTHON, "-m", "tools.paired", "--model", "add_sub", "--target", "nameless",
                          "--target", "b=127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "bad --target 'nameless'" in run.stderr
    run = subprocess.run([PYTHON, "-m", "tools.paired", "--model", "add_sub", "--target", "a=127.0.0.1:1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "needs two targets" in run.stderr


def test_paired_stops_with_an_error_when_a_target_is_gone(server):
    run = subprocess.run([PYTHON, "-m", "tools.paired", "--model", "add_sub", "--pairs", "1", "--slice", "0.1",
                          "--target", f"up=local:{server.id}", "--target", "gone=local:no_such_server"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "no shmserve server with id 'no_such_server'" in run.stderr


def test_paired_through_shared_memory_regions_leaves_none_behind(server, tmp_path):
    """--shm system: HTTP targets get tritonclient's registered regions, the local client a region
    of its own; every region is gone afterwards."""
    out = tmp_path / "paired-shm.json"
    run = subprocess.run(
        [PYTHON, "-m", "tools.paired", "--model", "add_sub", "--pairs", "1", "--slice", "0.3", "--warmup", "0.05",
         "--shm", "system", "--target", f"http={server.url}", "--target", f"local=local:{server.id}",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["shm"] is True
    assert all(s["rps"] > 0 for s in result["slices"]), result["slices"]
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith("shmbench_paired")]
    assert not leftovers, leftovers
    client = server.client()
    assert client.get_system_shared_memory_status() == [], "the tool's regions are still registered"
    client.close()
