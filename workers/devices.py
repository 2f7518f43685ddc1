"""Device detection and GPU pinning without importing torch (the broker must start fast and stay small).

CUDA is present when the driver library loads and reports devices. The driver honours the server's
``CUDA_VISIBLE_DEVICES`` itself, so ``cuda_device_count`` counts only the devices that mask allows:
KIND_AUTO becomes GPU, and a KIND_GPU group without ``gpus`` gets one instance per GPU, over those
devices alone, and a ``gpus`` entry is an index into them (as in Triton).
"""
from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    try:
        if lib.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except AttributeError:
        return 0


def visible_devices(mask: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, in order, whatever their form (indices,
    ``GPU-`` UUIDs, ``MIG-`` ids). The driver reads the list up to its first unusable entry, so an
    empty entry ends it here too; an empty value means no device."""
    entries = []
    for entry in mask.split(","):
        entry = entry.strip()
        if not entry:
            break
        entries.append(entry)
    return entries


def pinned_mask(parent_mask: str | None, index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a worker for the server's GPU ``index``.

    ``index`` counts the devices the server sees (an ``instance_group`` ``gpus`` entry), so it
    composes with the server's own mask: the worker sees exactly the ``index``-th entry of
    ``parent_mask``, or device ``index`` when the server has no mask. The worker's model then
    sees its GPU as ``cuda:0``, which is the id it is given (``model_instance_device_id``): a
    Triton model that uses ``cuda:<that id>`` lands on its own GPU, and nothing the worker does
    touches another GPU. Keeping the server's whole mask and giving the model ``index`` would suit
    ``cuda:<id>`` too, but not pin the worker: ``.cuda()`` without an index, torch's first context and
    other CUDA libraries would all land on the server's GPU 0.
    """
    if parent_mask is None:
        return str(index)
    entries = visible_devices(parent_mask)
    if not 0 <= index < len(entries):
        raise ValueError(f"GPU {index} is not visible to the server: its CUDA_VISIBLE_DEVICES="
                         f"{parent_mask!r} allows {len(entries)} device(s)")
    return entries[index]
