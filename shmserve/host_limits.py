"""What this process may use of the host: its cores and its memory, lowered by the limits of its
cgroup and every cgroup above it (a container's ``--cpus``/``--memory``, a pod's limits, systemd's
``CPUQuota``/``MemoryMax``), which neither the CPU affinity nor /proc/meminfo shows.

One reader of cgroup files for both: ``cgroup_values`` walks the process's own cgroup path
(``/proc/self/cgroup``; "/" inside a cgroup namespace, whose root is its own) up to the root.
"""
from __future__ import annotations

import os
from typing import Iterator


def cgroup_values(v2_file: str, v1_controller: str, v1_file: str, root: str = "/sys/fs/cgroup") -> Iterator[str]:
    """The contents of ``v2_file`` in each cgroup v2 folder from the process's own up to the root,
    and of ``v1_file`` in each folder of its ``v1_controller`` hierarchy likewise; files that
    cannot be read are passed over."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            base, name = root, v2_file
        elif v1_controller in controllers.split(","):
            base, name = os.path.join(root, v1_controller), v1_file
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    yield f.read().strip()
            except OSError:
                continue


def cgroup_memory_limits(root: str = "/sys/fs/cgroup") -> list[int]:
    """The memory limits set along the process's cgroup path (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``; "max" is none)."""
    return [int(v) for v in cgroup_values("memory.max", "memory", "memory.limit_in_bytes", root) if v.isdigit()]


def usable_memory() -> int:
    """Bytes of memory this process may use: the host's, or the lowest cgroup limit where lower."""
    return min([os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), *cgroup_memory_limits()])


def usable_cores(root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on (its affinity), fewer under a CPU quota along its cgroup
    path (v2 ``cpu.max``: "QUOTA PERIOD", or "max PERIOD" for none)."""
    cores = len(os.sched_getaffinity(0))
    for value in cgroup_values("cpu.max", "cpu", "cpu.max", root):
        quota, _, period = value.partition(" ")
        if quota.isdigit() and period.isdigit() and int(period):
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    return cores
