"""The memory the gRPC frontend's receive slots are sized from (shmserve/host_limits.py): the host's,
or the lowest cgroup limit on the path of this process's cgroup, read under a root laid out
as this process's own cgroup files name it (v2's ``memory.max``, v1's ``memory.limit_in_bytes``)."""
from __future__ import annotations

import os

from shmserve.host_limits import cgroup_memory_limits, usable_cores, usable_memory


def _memory_cgroups() -> list[tuple[str, str, str]]:
    """(hierarchy's folder under the root, the process's folder in it, file name) of each cgroup
    line of this process that can hold a memory limit."""
    with open("/proc/self/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    found = []
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and not controllers:
            found.append(("", path.strip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            found.append(("memory", path.strip("/"), "memory.limit_in_bytes"))
    return found


def test_the_lowest_limit_on_the_cgroups_path_counts(tmp_path):
    """No limit on the process's own cgroup, 2 GiB at its hierarchy's root: 2 GiB."""
    cgroups = _memory_cgroups()
    assert cgroups, "no cgroup line of this process can hold a memory limit"
    for hierarchy, own, name in cgroups:
        folder = tmp_path / hierarchy / own
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("max\n" if name == "memory.max" else "9223372036854771712\n")
        (tmp_path / hierarchy / name).write_text("2147483648\n")  # (the same file where own is the root)
    assert min(cgroup_memory_limits(str(tmp_path))) == 2 << 30


def test_no_cgroup_files_leave_the_hosts_memory(tmp_path):
    assert cgroup_memory_limits(str(tmp_path)) == []
    assert usable_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_cpu_quota_above_the_process_cgroup_lowers_its_cores(tmp_path):
    """cpu.max "150000 100000" at the v2 root (2 cores, rounded up) under "max" on the process's own."""
    with open("/proc/self/cgroup") as f:
        v2 = [line.split(":", 2)[2].strip("/") for line in f.read().splitlines() if line.startswith("0::")]
    if not v2:
        assert usable_cores(str(tmp_path)) == len(os.sched_getaffinity(0))  # no v2 line: the affinity
        return
    own = tmp_path / v2[0]
    own.mkdir(parents=True, exist_ok=True)
    (own / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # (the same file where own is the root)
    assert usable_cores(str(tmp_path)) == min(2, len(os.sched_getaffinity(0)))
