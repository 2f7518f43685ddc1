"""GPU pinning: a worker for the server's GPU k sees the k-th device of the server's own
CUDA_VISIBLE_DEVICES (indices, GPU UUIDs, MIG ids) or device k when the server has no mask. The
worker-process test runs the real ``python -m shmserve.workers`` entry point, which needs no GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from shmserve.workers.devices import pinned_mask, visible_devices

UUID_A = "GPU-5f3c2a10-9d2e-4b8e-a0c1-1b2c3d4e5f60"
UUID_B = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
MIG = "MIG-8c6e8f3a-1f2b-5c4d-9e8f-0a1b2c3d4e5f"


@pytest.mark.parametrize("parent, index, expected", [
    (None, 0, "0"),
    (None, 3, "3"),
    ("2,3", 0, "2"),
    ("2,3", 1, "3"),
    ("3,1,2", 2, "2"),
    (f"{UUID_A},{UUID_B}", 1, UUID_B),
    (f"{MIG}", 0, MIG),
    (f"1,{UUID_A},{MIG}", 2, MIG),
    (" 2 , 3 ", 1, "3"),
    (f" {UUID_A} ,\t{UUID_B}\n", 0, UUID_A),
])
def test_a_worker_sees_the_kth_device_of_the_servers_mask(parent, index, expected):
    assert pinned_mask(parent, index) == expected


@pytest.mark.parametrize("parent, index, allowed", [
    ("2,3", 2, 2),
    ("", 0, 0),
    (" ", 0, 0),
    (UUID_A, 1, 1),
    ("2,,3", 1, 1),  # the driver stops at the empty entry: only device 2 is visible
    ("2,3", -1, 2),
])
def test_a_gpu_outside_the_servers_mask_is_a_clear_error(parent, index, allowed):
    with pytest.raises(ValueError) as e:
        pinned_mask(parent, index)
    assert str(e.value) == (f"GPU {index} is not visible to the server: its CUDA_VISIBLE_DEVICES="
                            f"{parent!r} allows {allowed} device(s)")


def test_visible_devices_reads_the_list_as_the_driver_does():
    assert visible_devices("0,1") == ["0", "1"]
    assert visible_devices(f" {MIG} , 4") == [MIG, "4"]
    assert visible_devices("") == []
    assert visible_devices("1,,2") == ["1"]


def _worker(spec: dict, parent_mask: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if parent_mask is not None:
        env["CUDA_VISIBLE_DEVICES"] = parent_mask
    return subprocess.run([sys.executable, "-m", "shmserve.workers", orjson.dumps(spec).decode()],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_worker_process_refuses_a_gpu_its_server_does_not_see():
    spec = {"broker_pid": os.getpid(), "kind": "GPU", "device_id": 2, "model": "m", "version": 1,
            "instance_index": 0}
    done = _worker(spec, f"{UUID_A},{UUID_B}")
    assert done.returncode == 1
    assert done.stderr.strip() == (f"shmserve worker for 'm': GPU 2 is not visible to the server: its "
                                   f"CUDA_VISIBLE_DEVICES='{UUID_A},{UUID_B}' allows 2 device(s)")
