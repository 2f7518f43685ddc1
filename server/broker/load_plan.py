"""What a load asks for, read and checked before anything starts: the config (the override the
repository API was given, or the folder's), the versions its policy selects, its parameters, and
what Triton refuses at this point (an invalid config, resources the rate limiter cannot give, a
loop of ensembles, the response cache on an ensemble that reaches a decoupled model, an
ensemble allowing larger batches than a batching step or passing tensors its steps do not take,
a label file it cannot read). Warnings
about fields shmserve does not act on are logged here too.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from shmserve.config_view import to_dict
from shmserve.shm import latency_histograms
from shmserve.workers.classification import load_labels

from . import config as cfgmod
from . import response_cache, unsupported
from .canary import CanaryPolicy, unknown_parameters
from .catalog import Catalog
from .ensemble_plan import find_cycle, step_models
from .ensemble_steps import decoupled_flow, steps_refusal
from .options import BrokerOptions
from .rate_limiter import Needs, RateLimiter, needs_of

log = logging.getLogger("shmserve.broker")


def instance_needs(config: Any) -> list[Needs]:
    """What each instance ``Lifecycle._start_instances`` starts needs from the rate limiter, by index."""
    return [needs_of(group, device) for group in config.instance_group
            for device in cfgmod.instance_devices(group) for _ in range(group.count)]


class Unpolled(cfgmod.ConfigError):
    """A config Triton refuses when it polls the folder (unreadable, invalid JSON override, a
    name that is not the folder's, none under --strict-model-config): Triton never registers
    the model, so each version of it "is not found", not "not at ready state"."""


class NoVersion(cfgmod.ConfigError):
    """A policy that selects no version folder: Triton registers the model with no version, so a
    request for a version of it "is not found"."""


@dataclasses.dataclass
class LoadPlan:
    config: Any  # ModelConfig message, as asked for (before the backend completes it)
    versions: list[int]
    canary_policy: CanaryPolicy
    exec_timeout_s: float


class LoadPlanner:
    def __init__(self, opts: BrokerOptions, backends: set[str], limiter: RateLimiter, catalog: Catalog) -> None:
        self.opts = opts
        self.backends = backends
        self.limiter = limiter
        self.catalog = catalog

    def plan(self, name: str, model_dir: Path, override_json: str | None) -> LoadPlan:
        """The plan of a load of ``name`` from ``model_dir``; raises ``ConfigError`` with the reason."""
        try:
            config = cfgmod.load_config(model_dir, self.opts.strict_config, override_json, self.opts.config_name)
        except cfgmod.ConfigError as e:
            raise Unpolled(str(e)) from None
        available = cfgmod.version_dirs(model_dir)
        for folder in cfgmod.non_version_dirs(model_dir):
            why = "contains leading zeros in its directory name" if folder.isdigit() else \
                "fails to convert to integral number"
            log.warning("model '%s': ignore version directory '%s' which %s", name, folder, why)  # Triton's words
        versions = cfgmod.select_versions(config, available)
        if config.version_policy.WhichOneof("policy_choice") == "specific":
            for missing in sorted(set(config.version_policy.specific.versions) - set(available)):
                log.error("version %d is specified for model '%s', but the version directory is not present",
                          missing, name)  # Triton's words
        if not versions:
            raise NoVersion(f"at least one version must be available under the version policy of model "
                                     f"'{name}' (its version folders: {available})")  # Triton's words, then ours
        cfgmod.validate(config, model_dir, self.backends, versions, completed_later=not self.opts.strict_config)
        for warning in unsupported.warnings(config, cfgmod.backend_of(config)):
            log.warning("%s", warning)
        for step_model in sorted({s.model_name for s in config.ensemble_scheduling.step if s.model_version == 0}):
            log.warning("ensemble '%s': step '%s' has model_version 0 (or none): Triton 2.51 would need a "
                        "version 0 of it and refuse the load; shmserve uses its latest version (set "
                        "model_version: -1 to say so)", name, step_model)
        for warning in latency_histograms.resolve(cfgmod.model_metrics(config))[1]:
            log.warning("model '%s': %s", name, warning)
        note = response_cache.load_note(config, self.opts.response_cache_bytes)
        if note:
            log.warning("%s", note)
        if self.limiter.applies_to(config):
            try:
                self.limiter.check(instance_needs(config))
            except ValueError as e:
                raise cfgmod.ConfigError(str(e)) from None
        if config.platform == "ensemble":
            reached = self.reached_configs(config)
            graph = {n: step_models(c) for n, c in reached.items() if c.platform == "ensemble"}
            cycle = find_cycle(name, {**graph, name: step_models(config)})
            if cycle:
                raise cfgmod.ConfigError(cycle)
            why = response_cache.ensemble_refusal(config, reached) or steps_refusal(config, reached)
            decoupled, flow_refusal = decoupled_flow(config, reached)
            if why or flow_refusal:
                raise cfgmod.ConfigError(why or flow_refusal)
            # As Triton fills it in: decoupled when a decoupled step's responses flow through it.
            config.model_transaction_policy.decoupled = decoupled
            try:
                load_labels(to_dict(config), model_dir)  # the ensemble's own, for classification
            except ValueError as e:
                raise cfgmod.ConfigError(f"model '{name}': {e}") from None
        try:
            parameters = cfgmod.string_parameters(config)
            canary = CanaryPolicy.from_parameters(parameters)
            plan = LoadPlan(config, versions, canary, cfgmod.execution_timeout(parameters))
        except ValueError as e:
            raise cfgmod.ConfigError(f"model '{name}': parameters: {e}") from None
        for warning in unknown_parameters(parameters):
            log.warning("model '%s': %s", name, warning)
        if canary.fraction > 0 and len(versions) < 2:
            log.warning("model '%s': canary_fraction %g has no effect while its version policy loads %d version(s): "
                        "a canary needs two loaded (version_policy { latest { num_versions: 2 } }, or all, or "
                        "specific)", name, canary.fraction, len(versions))
        return plan

    def reached_configs(self, config: Any) -> dict[str, Any]:
        """The config of every model the ensemble ``config`` reaches through its steps, nested
        ensembles' steps included: the config that serves or loads, else the one in its repository
        folder (a model with neither is left out: it fails its own load)."""
        catalog = self.catalog
        reached: dict[str, Any] = {}
        seen, todo = {config.name}, step_models(config)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            job = catalog.loading.get(name)
            held = job.versions if job is not None else catalog.models.get(name)
            if held:
                dep = next(iter(held.values())).config
            elif name in catalog.model_dirs:
                try:
                    dep = cfgmod.load_config(catalog.model_dirs[name], self.opts.strict_config, config_name=self.opts.config_name)
                except (cfgmod.ConfigError, OSError):
                    continue  # it fails its own load; no loop passes through it
            else:
                continue
            reached[name] = dep
            if dep.platform == "ensemble":
                todo.extend(step_models(dep))
        return reached
