"""Ensembles (``platform: "ensemble"``): a DAG of model steps run by the broker.

The broker is itself a client of the step models: it owns a client segment whose slots workers
complete, and it is woken through its own doorbell. A step is submitted as soon as every tensor
it maps in exists, so independent steps run in parallel on their own workers. Intermediate
tensors stay where the producing worker wrote them (its output arena) and the next step's worker
reads them there: they never pass through a frontend, and no byte is copied between steps. The
final outputs are copied once into the broker's answer (or into the client's regions).

A step that names another ensemble (a nested ensemble) has no workers: it runs here as a run of
its own whose client is the broker's own segment. Its answer lies in the broker's arena like any
ensemble answer, completes the step's slot, and the outer run reads its tensors there and frees
it with the other step answers. Ensembles that reach themselves through their steps are refused
at load (``find_cycle``), so a run never starts runs of itself without end.

A request to an ensemble whose own config enables the response cache is looked up before its
first step (``EnsembleCache``, ensemble_cache.py): a hit is answered from the cache and no step
runs; after a miss, the final outputs are stored before they are answered. This holds for a
nested ensemble's run too, as Triton looks up every request an ensemble is sent.

``EnsemblePlan`` is the config's DAG, ``EnsembleRun`` one request through it, and ``Ensembles``
the broker's part that runs them.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any

import orjson
import posix_ipc

from shmserve.batching import Pending
from shmserve.shm.arena import free_block
from shmserve.shm.cache_entry import Output
from shmserve.shm.channel import NOTIFY_BROKER, BrokerSegment, ClientSegment
from shmserve.shm.names import object_name
from shmserve.shm.protocol import (NO_ROOM, ROLE_BROKER, SLOT_DONE, SLOT_FREE, SLOT_PENDING, manifest_room,
                                   read_manifest_with_data, write_manifest)
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.region_io import StaleRegion
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import from_buffer, serialize_bytes
from shmserve.signature import InvalidRequest, ModelSignature
from shmserve.workers.classification import ClassificationError, classify, unsupported_type

from .catalog import Catalog
from .clients import Clients
from .ensemble_cache import EnsembleCache
from .ensemble_shapes import converted_shape
from .instances import Instances
from .models import Client, ModelVersion
from .scheduler import Scheduler

OWN_SLOTS = 4096  # ensemble steps in flight at once
OWN_ARENA_BYTES = 1 << 20  # the broker's own client segment: step descriptors only, tensors stay where they are


@dataclasses.dataclass
class Step:
    index: int
    model: str
    version: str
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor


class EnsemblePlan:
    def __init__(self, config: Any, labels: dict[str, list[str]] | None = None) -> None:
        self.name = config.name
        self.batching = config.max_batch_size > 0
        self.labels = labels or {}  # output -> its label_filename's lines, for classification
        self.steps = [Step(i, s.model_name, str(s.model_version) if s.model_version > 0 else "",
                           dict(s.input_map), dict(s.output_map))
                      for i, s in enumerate(config.ensemble_scheduling.step)]
        self.inputs = [t.name for t in config.input]
        self.outputs = [t.name for t in config.output]

    def dependencies(self) -> list[str]:
        return sorted({s.model for s in self.steps})


def step_models(config: Any) -> list[str]:
    """The models an ensemble's config names as steps."""
    return sorted({s.model_name for s in config.ensemble_scheduling.step})


def find_cycle(start: str, graph: dict[str, list[str]]) -> str | None:
    """Triton's refusal of ensembles that reach themselves through their steps (a run of one
    would start runs of itself without end). ``graph`` maps each ensemble reachable from
    ``start`` to its step models; the answer names the ensemble whose step closes the loop."""
    reached, todo = {start}, [start]
    while todo:
        name = todo.pop()
        for model in graph.get(name, ()):
            if model == start:
                return f"circular dependency between ensembles: {start} -> ... -> {name} -> {start}"
            if model in graph and model not in reached:
                reached.add(model)
                todo.append(model)
    return None


def check_plan(config: Any) -> str | None:
    """Why an ensemble's steps cannot run (a tensor nobody produces, an output never made)."""
    steps = config.ensemble_scheduling.step
    if not steps:
        return "ensemble_scheduling must have at least one step"
    available = {t.name for t in config.input}
    remaining = list(steps)
    while remaining:
        runnable = [s for s in remaining if set(s.input_map.values()) <= available]
        if not runnable:
            missing = sorted(set(remaining[0].input_map.values()) - available)
            return (f"step '{remaining[0].model_name}' needs tensor(s) {missing} that no ensemble input or "
                    f"earlier step provides")
        for s in runnable:
            if not s.model_name:
                return "every step must name a model_name"
            available |= set(s.output_map.values())
            remaining.remove(s)
    unmade = [t.name for t in config.output if t.name not in available]
    if unmade:
        return f"ensemble output(s) {unmade} are not produced by any step"
    return None


class EnsembleRun:
    """One request through an ensemble."""

    def __init__(self, version: ModelVersion, client: Client, slot: int, entry: dict) -> None:
        assert version.ensemble is not None
        self.version = version
        self.plan: EnsemblePlan = version.ensemble
        self.client = client
        self.slot = slot
        self.entry = entry
        self.tensors: dict[str, dict] = {t["name"]: t for t in entry["inputs"]}
        # The batch size each tensor was made with, 0 without batching: Triton converts shapes
        # between batching and non-batching steps by it (ensemble_shapes.py).
        request_batch = next((t["shape"][0] for t in entry["inputs"] if t["shape"]), 1) if self.plan.batching else 0
        self.batch_sizes: dict[str, int] = {name: request_batch for name in self.tensors}
        self.step_batch: dict[int, int] = {}  # step index -> its request's batch size (0: no batching)
        self.started: set[int] = set()
        self.running = 0
        self.blocks: list[tuple[memoryview, int]] = []  # step responses to free when the run ends
        self.failed = False
        self.cache_key: bytes | None = None  # set after a miss: the final answer is stored under it
        self.lookup_ns = 0

    def ready_steps(self) -> list[Step]:
        out = []
        for step in self.plan.steps:
            if step.index not in self.started and set(step.input_map.values()) <= self.tensors.keys():
                out.append(step)
        return out

    def step_request(self, step: Step, signature: ModelSignature) -> dict:
        """The request a step's model gets: its inputs are ensemble tensors, wherever they live,
        shaped for the model's batching."""
        inputs = []
        batching = signature.max_batch_size > 0
        for model_input, tensor in step.input_map.items():
            t = self.tensors[tensor]
            spec = signature.inputs.get(model_input)
            shape = t["shape"] if spec is None else \
                converted_shape(spec.dims, batching, self.batch_sizes[tensor], t["shape"])
            inputs.append({**t, "name": model_input, "shape": shape})
        return {"id": self.entry.get("id", ""), "params": self.entry.get("params"),
                "corr": self.entry.get("corr", 0), "flags": self.entry.get("flags", 0), "inputs": inputs,
                "outputs": [{"name": n} for n in step.output_map]}

    def complete(self) -> bool:
        return all(name in self.tensors for name in self.wanted()) and not self.running

    def wanted(self) -> list[str]:
        outs = self.entry.get("outputs")
        return [o["name"] for o in outs] if outs else list(self.plan.outputs)


class Ensembles:
    """Runs ensemble requests: the broker is itself a client of the step models.

    It owns a client segment (``own``) whose slots the step models' workers complete and which
    rings the broker's doorbell, so a step's answer arrives like any worker message.
    """

    def __init__(self, server_id: str, seg: BrokerSegment, catalog: Catalog, clients: Clients,
                 scheduler: Scheduler, instances: Instances, cache: CacheStore | None) -> None:
        self.seg = seg
        assert seg.arena is not None  # the broker's segment, which it created
        self.arena = seg.arena
        self.catalog = catalog
        self.clients = clients
        self.scheduler = scheduler
        self.instances = instances
        name = object_name(server_id, "client", "broker")
        self.own = Client(name=name, pid=os.getpid(),
                          seg=ClientSegment.create(name, OWN_ARENA_BYTES, slots=OWN_SLOTS, notify=NOTIFY_BROKER))
        clients.by_name[name] = self.own  # answered, dropped and closed like any client
        self.free = collections.deque(range(OWN_SLOTS))
        self.inflight: dict[int, tuple[EnsembleRun, Step]] = {}  # own slot -> the step it runs
        self.segments = SegmentCache()  # where step outputs and the clients' regions lie
        self.cache = EnsembleCache(cache, self.segments) if cache is not None else None

    def start(self, mv: ModelVersion, client: Client, slot: int, entry: dict) -> None:
        self._begin(EnsembleRun(mv, client, slot, entry))

    def _begin(self, run: EnsembleRun) -> None:
        """Answer from the response cache when the ensemble enables it and holds this request's
        answer, without running a step; otherwise start the steps."""
        if self.cache is not None and self.cache.applies_to(run.version):
            looked_up = time.monotonic_ns()
            run.cache_key = self.cache.key(run.version, run.entry)
            stored = self.cache.lookup(run.cache_key, run.wanted()) if run.cache_key is not None else None
            run.lookup_ns = time.monotonic_ns() - looked_up
            if stored is not None:
                if self._reply(run, stored):
                    run.version.stats.cache_hit(run.entry.get("t") or 0, looked_up, run.lookup_ns)
                return
        self._advance(run)

    def _advance(self, run: EnsembleRun) -> None:
        """Submit every step whose inputs exist; answer the client when the outputs are all made."""
        for step in run.ready_steps():
            run.started.add(step.index)
            try:
                mv = self.catalog.find_version(step.model, step.version, inference=True)
                assert mv.signature is not None
                request = run.step_request(step, mv.signature)
                batch = mv.signature.check_inputs(request["inputs"], request.get("id", ""))
                run.step_batch[step.index] = batch if mv.signature.max_batch_size > 0 else 0
            except InvalidRequest as e:
                self._fail_run(run, step, e.status, str(e))
                return
            if not self.free:
                self._fail_run(run, step, 503, "too many ensemble steps in flight; retry later")
                return
            slot = self.free.popleft()
            request.update(client=self.own.name, pid=os.getpid(), slot=slot)
            self.own.seg.set_slot_state(slot, SLOT_PENDING)
            self.inflight[slot] = (run, step)
            run.running += 1
            if mv.ensemble is not None:
                # A nested ensemble has no instances to queue on: it runs here, and its answer
                # (or error) completes this step's slot in our own segment.
                request["t"] = time.monotonic_ns()
                self._begin(EnsembleRun(mv, self.own, slot, request))
            else:
                self.scheduler.enqueue(mv, Pending(self.own, slot, 0, request, batch, time.monotonic()))
        if not run.failed and run.complete():
            self._finish_run(run)

    def has_completions(self) -> bool:
        states = self.own.seg.slot_states
        return any(states[slot] == SLOT_DONE for slot in self.inflight)

    def on_completions(self) -> None:
        """Take the answers of finished steps and advance their runs."""
        states = self.own.seg.slot_states
        for slot in [s for s in self.inflight if states[s] == SLOT_DONE]:
            _, status, role, num, off, _, _ = self.own.seg.read_slot(slot)
            self.own.seg.set_slot_state(slot, SLOT_FREE)
            run, step = self.inflight.pop(slot)
            self.free.append(slot)
            run.running -= 1
            owner = self.seg.seg if role == ROLE_BROKER else self.instances.answer_segment(num, role, self.segments)
            if owner is None:
                self._fail_run(run, step, 500, "the instance that ran this step is gone")
                continue
            if not off:  # answered without a block: its producer had no room even for an error
                self._fail_run(run, step, status, NO_ROOM)
                continue
            doc, data_start = read_manifest_with_data(owner.buf, off)
            run.blocks.append((owner.buf, off))
            if status != 200:
                self._fail_run(run, step, status, doc.get("error", "failed"))
                continue
            if run.failed:
                self._release_run(run)
                continue
            for o in doc.get("outputs", ()):
                name = step.output_map.get(o["name"])
                if name:
                    run.tensors[name] = {"name": name, "datatype": o["datatype"], "shape": o["shape"],
                                         "seg": owner.name, "off": data_start + o["off"], "size": o["size"]}
                    run.batch_sizes[name] = run.step_batch[step.index]
            self._advance(run)

    def _fail_run(self, run: EnsembleRun, step: Step | None, status: int, message: str) -> None:
        """Answer the run's error and free what it holds: named after the ensemble and the step that
        failed, or as it is without a step (a classification refused, in Triton's words as for a model)."""
        if not run.failed:
            run.failed = True
            run.version.stats.fail("BACKEND", 1)
            text = message if step is None else f"in ensemble '{run.plan.name}', step '{step.model}' failed: {message}"
            self.clients.reply(run.client, run.slot, status, {"error": text})
        self._release_run(run)

    @staticmethod
    def _release_run(run: EnsembleRun) -> None:
        """Free the step outputs once no step of the run is still running."""
        if run.running:
            return
        for buf, off in run.blocks:
            free_block(buf, off)
        run.blocks.clear()

    def _finish_run(self, run: EnsembleRun) -> None:
        """Answer the ensemble's outputs (stored in the response cache first, after a miss) and free
        the steps'."""
        outputs: list[Output] = []
        signature = run.version.signature
        assert signature is not None
        try:
            for name in run.wanted():
                t = run.tensors[name]
                spec = signature.outputs.get(name)
                shape = t["shape"] if spec is None else \
                    converted_shape(spec.dims, run.plan.batching, run.batch_sizes[name], t["shape"])
                outputs.append((name, t["datatype"], shape, self._tensor_bytes(t)))
        except (ValueError, OSError, posix_ipc.Error) as e:  # an input in a region its client truncated
            self._fail_run(run, run.plan.steps[-1], 400 if isinstance(e, StaleRegion) else 500, str(e))
            return
        if run.cache_key is not None and self.cache is not None:
            inserting = time.monotonic_ns()
            self.cache.insert(run.version, run.cache_key, outputs)
            run.version.stats.cache_miss(run.lookup_ns + time.monotonic_ns() - inserting)
        if self._reply(run, outputs):
            arrived, now = run.entry.get("t") or 0, time.monotonic_ns()
            run.version.stats.succeed(now - arrived if 0 < arrived <= now else 0)
            self._release_run(run)

    @staticmethod
    def _classified(run: EnsembleRun, outputs: list[Output]) -> list[Output]:
        """The outputs with those the request asked classification of replaced by their top
        classes, as a model's worker answers them (workers/classification.py), labelled by the
        ensemble's own label files as in Triton."""
        classes = {o["name"]: o["class"] for o in run.entry.get("outputs") or () if "class" in o}
        if not classes:
            return outputs
        out: list[Output] = []
        for name, datatype, shape, data in outputs:
            if name in classes:
                if datatype == "BYTES":  # refused before its strings are decoded
                    raise unsupported_type(datatype)
                try:
                    arr = from_buffer(memoryview(data), datatype, shape)
                except (ValueError, KeyError, TypeError) as e:  # a shape its bytes do not fill
                    raise ClassificationError(f"output '{name}': {e}") from None
                top = classify(name, arr, classes[name], run.plan.batching, run.plan.labels.get(name))
                datatype, shape, data = "BYTES", list(top.shape), serialize_bytes(top)
            out.append((name, datatype, shape, data))
        return out

    def _tensor_bytes(self, t: dict) -> Any:
        """A tensor's bytes: a view of a step's output in its worker's arena; a copy of an
        ensemble input that lies in a client's region, which is never mapped here (its client may
        truncate it, and a touched page past its end would kill the broker: ``shm/region_io.py``)."""
        if "ino" in t:
            return memoryview(self.segments.regions.read(t))
        return self.segments.get(t["seg"]).buf[t["off"]:t["off"] + t["size"]]

    def _reply(self, run: EnsembleRun, outputs: list[Output]) -> bool:
        """Copy the outputs into one answer (or the client's regions) and complete the client's
        slot; False when the run failed instead (its error answered)."""
        placed = {o["name"]: o for o in run.entry.get("outputs") or () if "seg" in o}
        try:
            outputs = self._classified(run, outputs)
        except ClassificationError as e:
            self._fail_run(run, None, 400, str(e))
            return False
        outs, chunks, pos = [], [], 0
        for name, datatype, shape, data in outputs:
            size = len(data)
            desc = {"name": name, "datatype": datatype, "shape": shape, "size": size}
            target = placed.get(name)
            if target is not None:
                if size > target["size"]:
                    self._fail_run(run, run.plan.steps[-1], 400, f"shared memory region for output '{name}' is "
                                   f"too small ({target['size']} bytes, {size} needed)")
                    return False
                try:  # through the region's descriptor: never a mapping its client could truncate
                    self.segments.regions.write(target, data)
                except (ValueError, OSError, posix_ipc.Error) as e:
                    self._fail_run(run, run.plan.steps[-1], 400, str(e))
                    return False
                desc["region"] = True
            else:
                desc["off"] = pos
                chunks.append(data)
                pos += size
            outs.append(desc)
        body = orjson.dumps({"version": run.version.version, "outputs": outs})
        room = manifest_room(len(body))
        off = self.arena.alloc(room + pos, run.client.pid)
        if off < 0:
            self._fail_run(run, run.plan.steps[-1], 503, "the broker's arena is full; retry later")
            return False
        at = write_manifest(self.seg.seg.buf, off, body)
        for chunk in chunks:
            self.seg.seg.buf[at:at + len(chunk)] = chunk
            at += len(chunk)
        run.client.seg.complete(run.slot, 200, ROLE_BROKER, 0, off, room + pos)
        run.client.seg.waker.notify()
        return True
