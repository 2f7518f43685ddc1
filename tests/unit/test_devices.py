"""How a ``CUDA_VISIBLE_DEVICES`` value reads: the server counts its GPUs over these entries, and
workers inherit the value unchanged, so a GPU index means the same device in every process."""
from __future__ import annotations

from shmserve.workers.devices import visible_devices

UUID_A = "GPU-5f3c2a10-9d2e-4b8e-a0c1-1b2c3d4e5f60"
MIG = "MIG-8c6e8f3a-1f2b-5c4d-9e8f-0a1b2c3d4e5f"


def test_visible_devices_reads_the_list_as_the_driver_does():
    assert visible_devices("0,1") == ["0", "1"]
    assert visible_devices(f" {MIG} , 4") == [MIG, "4"]
    assert visible_devices(f"{UUID_A},\t2\n") == [UUID_A, "2"]
    assert visible_devices("") == []
    assert visible_devices("1,,2") == ["1"]
