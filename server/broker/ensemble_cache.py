"""The response cache for ensembles, as Triton caches a request to an ensemble whose own config
says ``response_cache { enable: true }``.

The broker runs ensembles (``ensemble.py``), so it is the broker that looks such a request up
before the first step and stores the final answer after the last one. It uses the server's one
cache (``shm/response_cache.py``, the segment the broker created and the workers attach) and the
key and layout every worker uses (``shm/cache_entry.py``), here for the ensemble's name, version
and load, and the loads of the versions its steps reach (nested ensembles' steps too): after a
step's model is reloaded, or a new version of it serves, the ensemble's answers of before are no
longer hits (Triton's key has the ensemble's name and version only, and serves them). A hit is
answered without running any step. The composing models' caches are independent of the
ensemble's: a step's request is looked up by its model's worker where that model's own config
enables the cache, whether or not the ensemble's does.
"""
from __future__ import annotations

import logging

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm import cache_entry
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.segment import SegmentCache
from shmserve.signature import InvalidRequest

from .catalog import Catalog
from .models import ModelVersion
from .response_cache import load_key

log = logging.getLogger("shmserve.broker")


class EnsembleCache:
    def __init__(self, store: CacheStore, segments: SegmentCache) -> None:
        self.store = store
        self.segments = segments  # where the requests' inputs lie (clients' arenas and regions, step outputs)
        self._too_large_said: set[str] = set()

    @staticmethod
    def applies_to(mv: ModelVersion) -> bool:
        """Whether the ensemble's own config enables the cache."""
        return bool(mv.config.response_cache.enable)

    def key(self, mv: ModelVersion, entry: BatchEntry, catalog: Catalog) -> bytes | None:
        """The digest of a request to the ensemble ``mv``; None when it is not cacheable (inputs
        in CUDA regions, a streamed request, a step whose model does not serve now)."""
        loads = reached_loads(mv, catalog)
        if loads is None:
            return None
        keys = cache_entry.RequestKeys(mv.name, mv.version, loads, mv.ensemble.outputs)
        return keys.key(entry, self.segments)

    def forget_client(self, name: str) -> None:
        """Unmap a departed client's arena, which keys were read from: its memory is freed, and a
        later client of the same name is read anew."""
        self.segments.drop(name)

    def lookup(self, key: bytes, names: list[str]) -> list[cache_entry.Output] | None:
        """The stored outputs in the order of ``names`` (requests that name the same outputs in
        another order share the key), as views of a copy of the entry; None on a miss. An output
        the answer left out (absent: its step did not return it) is left out again, as Triton's
        cached response does."""
        payload = self.store.lookup(key, wait=0)  # the broker's loop serves everyone: a taken lock is a miss
        if payload is None:
            return None
        entry = cache_entry.unpack(payload)
        if entry is None:  # not an answer (the cache lies in memory every worker writes): a miss
            self.store.forget(key, wait=0)
            return None
        stored = {output[0]: output for output in entry[0]}
        return [stored[name] for name in names if name in stored] if stored.keys() <= set(names) else None

    def insert(self, mv: ModelVersion, key: bytes, outputs: list[cache_entry.Output]) -> None:
        """Store an ensemble's final outputs (an ensemble answer has no response parameters)."""
        parts, n = cache_entry.pack(outputs, None)
        if not self.store.fits(n):
            if mv.name not in self._too_large_said:  # (Triton logs an error for each one)
                self._too_large_said.add(mv.name)
                log.warning("an answer of ensemble '%s' of %d bytes does not fit in the response cache (%d bytes "
                            "for entries): such answers are not cached", mv.name, n, self.store.capacity)
            return
        self.store.insert(key, parts, n, wait=0)  # (a taken lock: not stored this time)


def reached_loads(mv: ModelVersion, catalog: Catalog, depth: int = 0) -> list[int] | None:
    """The load of the ensemble ``mv`` and of each version its steps go to now (nested
    ensembles' steps followed down): what its answers depend on. None when a step's model does
    not serve (its run fails as it would uncached), or when an unversioned step's model splits
    its traffic with a canary: the step's version is drawn per call (``Ensembles._send``), so
    the key could not say which version's answer it holds, and one a canary made would be
    served on after a rollback."""
    loads = [load_key(mv)]
    if depth > 64:  # (load_plan refuses cycles: only a very deep nest gets here)
        return None
    for step in mv.ensemble.steps:
        if step.version in (None, "", -1, "-1"):
            split = catalog.split(step.model)
            if split is not None and split.canary is not None and split.fraction > 0:
                return None
        try:
            step_mv = catalog.find_version(step.model, step.version)
        except InvalidRequest:
            return None
        if step_mv.ensemble is not None:
            nested = reached_loads(step_mv, catalog, depth + 1)
            if nested is None:
                return None
            loads += nested
        else:
            loads.append(load_key(step_mv))
    return loads
