"""The broker's part in Triton's response cache: the models that may not use it, the models that
ask for it on a server without one, and the store the broker creates for the whole server.

The cache itself lives in shared memory (``shm/response_cache.py``) and is used by the workers
(``workers/response_cache.py``) for their models' requests, and by the broker for requests to
ensembles (``ensemble_cache.py``); the broker creates it, keeps its lock from staying with a dead
process, removes it at exit, and reports its counters per model.
"""
from __future__ import annotations

import logging
from typing import Any

from shmserve.shm.response_cache import CacheStore

from .models import ModelVersion

log = logging.getLogger("shmserve.broker")


def refusal(config: Any) -> str | None:
    """Triton's refusal of ``response_cache`` for models it cannot cache (model_config_utils.cc)."""
    if not config.response_cache.enable:
        return None
    if config.HasField("sequence_batching"):
        return (f"Response Cache does not currently support model {config.name} with sequence batching "
                f"scheduler. Please disable the response cache.")
    if config.model_transaction_policy.decoupled:
        return (f"Response Cache does not currently support model {config.name} with 'decoupled' "
                f"transaction policy. Please disable the response cache.")
    return None


def ensemble_refusal(config: Any, reached: dict[str, Any]) -> str | None:
    """Triton's refusal of ``response_cache`` for an ensemble that is decoupled because a model it
    reaches through its steps is (Triton marks such an ensemble decoupled, then refuses it as any
    decoupled model). ``reached`` maps each model the steps reach, nested ensembles' steps
    included, to its config."""
    if not config.response_cache.enable or config.model_transaction_policy.decoupled:
        return None  # (a decoupled ensemble's own config is refused by ``refusal``)
    if any(c.model_transaction_policy.decoupled for c in reached.values()):
        return (f"Response Cache does not currently support model {config.name} with 'decoupled' "
                f"transaction policy. Please disable the response cache.")
    return None


def load_note(config: Any, cache_bytes: int) -> str | None:
    """What a load says about a model's ``response_cache`` that has no effect: Triton loads such
    a model and caches nothing, without a word."""
    if config.response_cache.enable and not cache_bytes:
        return (f"model '{config.name}': response_cache is enabled but the server has no response cache "
                f"(--cache-config local,size=<bytes>): its responses are not cached")
    return None


def enabled(config_dict: dict[str, Any], cache_bytes: int) -> bool:
    """Whether a version's responses are cached (its workers, or for an ensemble the broker, look
    requests up)."""
    return bool(cache_bytes) and bool((config_dict.get("response_cache") or {}).get("enable"))


def load_key(mv: ModelVersion) -> int:
    """The load's part of the cache key: a reloaded version never answers with its predecessor's
    outputs."""
    return int(mv.created * 1e9)


def create_store(server_id: str, cache_bytes: int) -> CacheStore | None:
    """The server's cache (``--cache-config local,size=``), or None without one."""
    if not cache_bytes:
        return None
    store = CacheStore.create(server_id, cache_bytes)
    log.info("response cache 'local': %d bytes (%d for entries), shared by every process of the server",
             cache_bytes, store.capacity)
    return store
