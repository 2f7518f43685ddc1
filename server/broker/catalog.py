"""What the broker knows about models: the versions that serve, load, retire or failed, and which
version a request gets.

The catalog holds state and answers lookups; it changes nothing by itself. ``lifecycle.py``
changes it (loads, swaps, retirement), ``routes.py`` publishes it to clients, and every request
and control operation looks a version up here (``find_version``), with Triton's texts and
statuses for a model or version that does not serve.
"""
from __future__ import annotations

import collections
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from shmserve.signature import UnknownModel, VersionNotReady

from .canary import Canary, CanaryPolicy, Split
from .load_times import LoadTimes
from .models import ModelVersion, State


@dataclasses.dataclass
class LoadJob:
    """A load in progress: its new versions get ready beside what serves (see lifecycle.py)."""

    name: str
    versions: dict[int, ModelVersion]
    waiters: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (client, slot) to answer
    canary_policy: CanaryPolicy = dataclasses.field(default_factory=CanaryPolicy)  # from its config.pbtxt
    # What was asked for (the folder and the config before any auto-completion): a later load
    # that asks for the same joins this one; one that asks for something else replaces it.
    model_dir: str = ""
    config: Any = None  # ModelConfig message
    override: str | None = None  # the config JSON the load API was given, kept for a broker restart
    retries: int = 0  # how many times this load was started again after it failed (--model-load-retry-count)

    def same_request(self, model_dir: Path, config: Any) -> bool:
        return self.model_dir == str(model_dir) and self.config == config

    def failed(self) -> ModelVersion | None:
        return next((mv for mv in self.versions.values() if mv.state == State.UNAVAILABLE), None)

    def ready(self) -> bool:
        return all(mv.state == State.READY for mv in self.versions.values())


@dataclasses.dataclass
class Retiring:
    """A version that no longer serves: it drains, then its workers stop (see lifecycle.py)."""

    version: ModelVersion
    since: float = dataclasses.field(default_factory=time.monotonic)
    stopping: bool = False
    # when its workers were asked to stop (still there past --exit-timeout-secs: killed); an
    # abandoned load's are killed at once
    stop_asked: float = dataclasses.field(default_factory=time.monotonic)
    killed: bool = False  # its workers that did not stop in time were killed
    abandoned: bool = False  # a load that failed or was cancelled: it never served
    waiters: list[tuple[Any, int]] = dataclasses.field(default_factory=list)


class Catalog:
    def __init__(self) -> None:
        self.models: dict[str, dict[int, ModelVersion]] = {}  # what serves
        self.loading: dict[str, LoadJob] = {}  # new versions getting ready beside what serves
        self.retiring: list[Retiring] = []  # old versions draining before their workers stop
        self.load_errors: dict[str, str] = {}  # model -> why its last load failed (cleared when one succeeds)
        # The versions a failed load tried (unknown when its config failed first), each with its
        # reason in the index: its own failure, or "unloaded" for one let go because another
        # failed (as Triton releases them). A version outside them is "not found".
        self.failed_versions: dict[str, dict[int, str]] = {}
        # The versions of a model that was unloaded (until it loads again): Triton keeps them as
        # UNAVAILABLE, so that a request for it has "no available versions" rather than "not found".
        self.unloaded: dict[str, list[int]] = {}
        # Models whose last load failed where Triton's repository poll fails (a config it cannot
        # read): Triton never registered them, so a version of them "is not found" (404, final)
        # rather than "not at ready state" (503, which invites retries).
        self.unpolled: set[str] = set()
        self.load_failures: dict[str, int] = collections.defaultdict(int)  # model -> failed loads
        self.load_times = LoadTimes()  # every successful load's duration (load_times.py)
        self.model_dirs: dict[str, Path] = {}  # model -> its folder in a repository
        self.canaries: dict[str, Canary] = {}  # model -> its canary state (see canary.py)
        # Models loaded by name (a load request, --load-model, a repository poll), not only as an
        # ensemble's steps: unloading an ensemble with unload_dependents keeps them, as Triton does.
        self.explicit: set[str] = set()
        # A restarted broker loads again what its predecessor served: until those loads are over,
        # a model still loading is only late (503, retry), not unknown (404, which reads as final).
        self.restoring = False

    def serving(self) -> list[ModelVersion]:
        return [mv for versions in self.models.values() for mv in versions.values()]

    def serving_and_retiring(self) -> list[ModelVersion]:
        return self.serving() + [r.version for r in self.retiring]

    def in_use(self) -> list[ModelVersion]:
        """Every version that serves, loads or drains (and so may still read its model folder)."""
        users = self.serving_and_retiring()
        return users + [mv for job in self.loading.values() for mv in job.versions.values()]

    def split(self, model: str) -> Split | None:
        """Where unversioned requests for ``model`` go: the newest ready version, or a canary split."""
        versions = self.models.get(model, {})
        ready = [v for v, mv in versions.items() if mv.state == State.READY]
        canary = self.canaries.get(model)
        if canary is None:
            return Split(stable=max(ready)) if ready else None
        return canary.split(ready)

    def failed_reload(self, model: str) -> str:
        """Why the last load of ``model`` failed while older versions of it serve on ("" when its
        last load succeeded, or when nothing of it serves): the index's reason for those versions."""
        if model in self.models and model in self.load_errors:
            return f"serving the previous version; the last load failed: {self.load_errors[model]}"
        return ""

    def pending_versions(self, model: str) -> dict[int, dict[str, str]]:
        """The versions of ``model`` that do not serve but that Triton still lists beside the ones
        that serve (version -> its index state and reason): those a load in progress brings
        (LOADING, or UNAVAILABLE once failed), then those whose last load failed (UNAVAILABLE,
        each with its reason; "unloaded" for one let go because another failed), then those a
        reload's policy dropped or an unload left (UNAVAILABLE "unloaded")."""
        serving = self.models.get(model, {})
        out: dict[int, dict[str, str]] = {}
        job = self.loading.get(model)
        for v, mv in (job.versions.items() if job is not None else ()):
            if v not in serving:
                out[v] = {"state": mv.state.value, "reason": mv.reason}
        if model in self.load_errors:
            for v, why in (self.failed_versions.get(model) or {}).items():
                if v not in serving and v not in out:
                    out[v] = {"state": State.UNAVAILABLE.value, "reason": why}
        for v in self.unloaded.get(model, ()):
            if v not in serving and v not in out:
                out[v] = {"state": State.UNAVAILABLE.value, "reason": "unloaded"}
        return out

    def find_version(self, model: str, version: str | int | None, *, inference: bool = False) -> ModelVersion:
        """The version a request for ``model`` (and ``version``, or the latest) goes to. Only
        inference is split between a canary and the stable version; metadata, config and
        readiness without a version describe the stable version, so that they do not change
        from one call to the next."""
        versions = self.models.get(model)
        latest = version in (None, "", -1, "-1")
        v = 0
        if not latest:
            try:
                v = int(version)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise UnknownModel(f"Request for unknown model: '{model}' version '{version}' is not a "
                                   f"valid version") from None
        # Triton's texts and statuses: a model whose load failed, that was unloaded or that is
        # still loading has "no available versions" (404), and a version that exists but does not
        # serve "is not at ready state" (503).
        if not versions:
            # A model's first load in progress is listed with its versions LOADING, as in Triton.
            job = self.loading.get(model)
            known = list(job.versions) if job is not None else \
                self.failed_versions.get(model) if model in self.load_errors else self.unloaded.get(model)
            if model not in self.load_errors and known is None:
                raise UnknownModel(f"Request for unknown model: '{model}' is not found")
            if job is not None and self.restoring:
                raise VersionNotReady(f"model '{model}' is loading again after the server's broker restarted; "
                                      f"retry shortly")
            if latest:
                raise UnknownModel(f"Request for unknown model: '{model}' has no available versions")
            if known is None and model in self.unpolled:
                raise UnknownModel(f"Request for unknown model: '{model}' is not found")
            if known is not None and v not in known:
                raise UnknownModel(f"Request for unknown model: '{model}' version {v} is not found")
            raise VersionNotReady(f"Request for unknown model: '{model}' version {v} is not at ready state")
        if not latest:
            mv = versions.get(v)
            if mv is None and v in self.pending_versions(model):
                # One a reload's policy dropped, one loading beside what serves, or one whose load
                # failed while the others serve on: Triton lists each (UNAVAILABLE, LOADING) and
                # answers "not at ready state" (503, retry), not "not found" (404, final).
                raise VersionNotReady(f"Request for unknown model: '{model}' version {v} is not at ready state")
            if mv is None:
                raise UnknownModel(f"Request for unknown model: '{model}' version {v} is not found")
            if mv.state != State.READY:
                raise VersionNotReady(f"Request for unknown model: '{model}' version {v} is not at ready state")
            return mv
        split = self.split(model)
        if split is None:
            raise UnknownModel(f"Request for unknown model: '{model}' has no available versions")
        if inference and split.canary is not None and random.random() < split.fraction:
            return versions[split.canary]
        return versions[split.stable]
