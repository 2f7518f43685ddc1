"""Which NVML lookups report the GPUs the server's CUDA_VISIBLE_DEVICES allows: NVML sees every
physical device, so the mask decides (an index entry by index, a GPU- entry by UUID, MIG entries
apart), read up to the first entry the CUDA driver could not use. Pure: no GPU or NVML needed."""
from __future__ import annotations

import pytest

from shmserve.server.broker.gpu_metrics import FAMILIES, device_lookups

UUID_A = "GPU-5f3c2a10-9d2e-4b8e-a0c1-1b2c3d4e5f60"
UUID_B = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
MIG = "MIG-8c6e8f3a-1f2b-5c4d-9e8f-0a1b2c3d4e5f"


@pytest.mark.parametrize("mask, count, lookups, mig", [
    (None, 0, [], []),
    (None, 2, [("index", 0), ("index", 1)], []),
    ("", 2, [], []),
    ("1", 2, [("index", 1)], []),
    ("1,0", 2, [("index", 1), ("index", 0)], []),
    (" 1 , 0 ", 2, [("index", 1), ("index", 0)], []),
    (UUID_A, 1, [("uuid", UUID_A)], []),
    (f"0,{UUID_B}", 2, [("index", 0), ("uuid", UUID_B)], []),
    (MIG, 1, [], [MIG]),
    (f"{MIG},0", 1, [("index", 0)], [MIG]),
    ("0,2,1", 2, [("index", 0)], []),  # index 2 does not exist: the driver stops there
    ("0,-1,1", 2, [("index", 0)], []),  # -1 hides the rest
    ("1,abc,0", 2, [("index", 1)], []),
    ("0,,1", 2, [("index", 0)], []),  # an empty entry ends the list
])
def test_mask_entries_map_to_nvml_lookups(mask, count, lookups, mig):
    assert device_lookups(mask, count) == (lookups, mig)


def test_families_are_tritons():
    kinds = {name: kind for name, _, kind in FAMILIES}
    assert kinds == {"nv_gpu_utilization": "gauge", "nv_gpu_memory_total_bytes": "gauge",
                     "nv_gpu_memory_used_bytes": "gauge", "nv_gpu_power_usage": "gauge",
                     "nv_gpu_power_limit": "gauge", "nv_energy_consumption": "counter"}
