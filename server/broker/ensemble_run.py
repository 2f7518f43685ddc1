"""One request through an ensemble, as the broker runs it (ensemble.py).

A decoupled step answers a request with zero or many responses. As in Triton's ensemble
scheduler, each response goes on through the later steps on its own: it starts a *branch*, a
line of descent that sees every tensor its parent had when it began plus what that response and
the steps after it make. The request's own branch is the root. A branch that makes every output
the request wants is one response of the ensemble; at load Triton refuses a step (or the outputs)
taking tensors that descend from different decoupled steps (ensemble_steps.decoupled_flow), so
the tensors a step takes always lie in one branch.

A tensor may be *absent* (None in ``Branch.tensors``): a step answered without an output its
config declares, or the request left out an optional ensemble input. As in Triton's ensemble
scheduler, an absent tensor still counts as made: a step that reads it runs without that input
(its model's own checks, or the model itself, judge that), and an ensemble output that is absent
is left out of the response.

A branch is *busy* while one of its step calls is in flight or waits for the step's limit
(``max_inflight_requests``), and while one of its child branches lives. A branch that is no
longer busy can make nothing more: it ends, and frees the step answers only it read. The run
ends with its root.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from shmserve.shm.answer import AnswerDescriptor, StepTrace, add_step
from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.ring import Ring

from .ensemble_plan import EnsemblePlan, Step

if TYPE_CHECKING:
    from .models import Client, ModelVersion

Block = tuple[memoryview, int]  # a step's answer: the buffer it lies in and its offset there


@dataclasses.dataclass(eq=False)
class Branch:
    tensors: dict[str, dict | None]  # ensemble tensor -> where it lies (None: absent, never returned)
    batch_sizes: dict[str, int]  # the batch size each tensor was made with, 0 without batching
    started: set[int]  # step indices run in this branch (or its parent before it began), or never to run
    parent: "Branch | None" = None
    blocks: list[Block] = dataclasses.field(default_factory=list)  # step answers its tensors lie in
    busy: int = 0
    ended: bool = False  # settled: nothing more happens in it (settling it again changes nothing)

    def child(self) -> "Branch":
        """A branch for one response of a decoupled step run in this one."""
        self.busy += 1
        return Branch(dict(self.tensors), dict(self.batch_sizes), set(self.started), self)

    def ready_steps(self, plan: "EnsemblePlan") -> list["Step"]:
        return [s for s in plan.steps
                if s.index not in self.started and set(s.input_map.values()) <= self.tensors.keys()]


@dataclasses.dataclass(eq=False)
class StepCall:
    """One request of a run to one step model."""

    run: "EnsembleRun"
    branch: Branch
    step: "Step"
    origin: "StepCall | None"  # the decoupled step whose response started ``branch``, if any
    batch: int = 0  # its request's batch size (0: the model does not batch)
    slot: int = -1  # in the broker's own client segment, once sent
    ring: Ring | None = None  # a decoupled step's response ring, in our own segment
    ring_index: int = -1
    received: int = 0  # responses taken from the ring
    sent_ns: int = 0  # when it was sent: its REQUEST_START, when the run is traced
    stalled: int = 0  # calls made from its responses that wait for their step's limit
    last_taken: bool = False  # a decoupled step's response sent with the final flag was taken: no more come

    def taking(self) -> bool:
        """Whether its next response may be taken: no call made from one waits for its step's
        limit, and no response of the run waits for room on the client's ring."""
        return not self.stalled and not (self.run.outbox and not self.run.answered)


class EnsembleRun:
    """One request through an ensemble."""

    def __init__(self, version: "ModelVersion", client: "Client", slot: int, entry: BatchEntry,
                 priority: int = 0) -> None:
        assert version.ensemble is not None
        self.version = version
        self.priority = priority  # the client's, given to every step (Triton's ensembles pass any level on)
        self.plan: EnsemblePlan = version.ensemble
        self.client = client
        self.slot = slot
        self.entry = entry
        self.streaming = "stream" in entry  # answered response by response on the request's ring
        tensors: dict[str, dict | None] = {t["name"]: t for t in entry["inputs"]}
        # Triton converts shapes between batching and non-batching steps by the batch size each
        # tensor was made with (ensemble_shapes.py).
        request_batch = next((t["shape"][0] for t in entry["inputs"] if t["shape"]), 1) if self.plan.batching else 0
        for name in self.plan.optional_inputs:  # left out of the request: absent, as in Triton
            tensors.setdefault(name, None)
        # The steps that make nothing the request wants count as run: they never start.
        self.root = Branch(tensors, {name: request_batch for name in tensors}, set(self.plan.needless(self.wanted())))
        self.batch_size = max(1, request_batch)  # what its success counts (Triton's max(1, batch size))
        self.compute = [0, 0, 0]  # its steps' compute input, infer and output ns, summed (their answers' stamps)
        # Traced (its frontend sampled it, or it is a step of a traced run): its steps' traces go
        # back with its answer, for the frontend to write as children of its own (Triton's parent_id).
        self.traced = "trace_queued_ns" in entry
        self.step_traces: list[StepTrace] = []
        self.calls: set[StepCall] = set()  # sent and not yet finished
        self.answered = False  # the client's slot is completed (an error, a cancel, or the end)
        self.ended = False
        self.ending = False  # done, but responses still wait for room on the client's ring
        self.answer: Branch | None = None  # a single-answer run: the branch whose outputs answer it
        self.kept: list[Block] = []  # the blocks of ``answer``, freed when the run ends
        self.sent = 0  # stream responses
        # (status, extent, offset, length, last) of answers in the broker's output arena; last:
        # the response carries the final flag (nothing was left to run when it was made)
        self.outbox: collections.deque[tuple[int, int, int, int, bool]] = collections.deque()
        self.full_since = 0.0  # since when the client's ring has taken no response that waits
        self.cache_key: bytes | None = None  # set after a miss: the final answer is stored under it
        self.lookup_ns = 0

    def add_compute(self, stamps: tuple[int, ...]) -> None:
        """A step answer's stamps (QUEUE_START, COMPUTE_START, _INPUT_END, _OUTPUT_START, _END):
        its compute phases count in the ensemble's, as Triton's ensemble sums its composing
        models' (their queues not among them)."""
        if len(stamps) >= 5:
            start, input_end, output_start, end = stamps[1:5]
            for i, ns in enumerate((input_end - start, output_start - input_end, end - output_start)):
                self.compute[i] += max(0, ns)

    def add_step_trace(self, call: StepCall, answer: AnswerDescriptor, now: int) -> None:
        """A step's answer came: its trace (REQUEST_START when sent, the model's stamps, REQUEST_END
        now), then those of its own steps when it is a nested ensemble, under it (which began,
        its QUEUE_START, as it was sent, and has no compute stamps of its own, as in Triton)."""
        stamps = answer.trace[:5] if len(answer.trace) >= 5 else (call.sent_ns, 0, 0, 0, 0)
        add_step(self.step_traces, StepTrace(call.step.model, answer.version, -1, (call.sent_ns, *stamps, now)),
                 answer.steps)

    def traces(self) -> tuple[StepTrace, ...]:
        """What its answer carries of its steps' traces (none when it is not traced)."""
        return tuple(self.step_traces) if self.traced else ()

    def quiet(self) -> bool:
        """Whether none of its steps can answer any more: no call in flight but decoupled ones
        whose final response was taken, and none waiting for its step's limit. Triton's count of
        the steps in flight, which decides whether a response carries the final flag."""
        if any(not call.last_taken for call in self.calls):
            return False
        return not any(call.run is self for waiting in self.plan.waiting for call in waiting)

    def wanted(self) -> list[str]:
        outs = self.entry.get("outputs")
        return [o["name"] for o in outs] if outs else list(self.plan.outputs)
