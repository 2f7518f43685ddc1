"""Triton's rate limiter (``--rate-limit=execution_count``): which waiting instance of a
rate-limited model executes next, and the resources each execution holds until its batch is done.

An instance group's ``rate_limiter { resources [ { name count global } ] priority }`` says what
each of its instances needs to execute: ``count`` copies of each named resource, from the pool of
the instance's device (CPU instances count as device 0) or, with ``global: true``, from one pool
for the whole server. Resources are shared by name across models. How many copies a pool has:
what the ``--rate-limit-resource=<name>:<count>[:<device>]`` flags say when any is given (a flag
without a device gives every device that count; a resource no flag names has none, so a model
that needs it fails to load, as in Triton); without flags, the most any loaded instance asks for,
so that every instance can run.

An execution starts only when all its resources are free. Among the waiting instances, the one
with the lowest priority-weighted count of executions goes first: an instance of priority 2 gets
half the turns of one of priority 1 (Triton's ``execution_count``; priority 0 counts as 1).
Nothing passes it while it waits for its resources, so an instance that needs many copies is not
starved by ones that need few. Triton counts executions from an instance's load, so an instance
loaded (or idle) later would take every turn until it caught up; here the count of an instance
that was not waiting starts level with the least-served waiting one.

A BLS call runs on its caller's resources: the request comes on the BLS connection of a worker
whose execution holds resources (the connection's process is that worker), and an instance of
the called model may execute on what the caller holds, before the waiting line, taking from the
pools only what the caller does not hold. Without this, a caller holding the only copy of R while
its callee waits for R would wait forever (Triton's known pitfall). A caller that does not wait
for its call (``async_exec`` left running) computes beside it on the same copies.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from .models import Instance, ModelVersion

log = logging.getLogger("shmserve.broker")

MODES = ("off", "execution_count")
GLOBAL = "global"  # the scope of global resources; a device number is the scope of per-device ones
Key = tuple[Any, str]  # (GLOBAL or a device number, resource name)


def parse_mode(value: str) -> str:
    """``--rate-limit``, case-insensitive as Triton's; ValueError with what is accepted."""
    mode = value.strip().lower()
    if mode not in MODES:
        raise ValueError(f"invalid argument for --rate-limit: '{value}' (expected 'execution_count' or 'off')")
    return mode


def parse_resource(item: str) -> tuple[str, int, int | None]:
    """One ``--rate-limit-resource`` value: (name, count, device; None: every device)."""
    form = ("--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
            f"'<resource_name>:<count>'. Got {item}")
    parts = item.split(":")
    if len(parts) not in (2, 3) or not parts[0].strip():
        raise ValueError(form)
    try:
        numbers = [int(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"{form} (count and device must be integers)") from None
    if min(numbers) < 0:
        raise ValueError(f"{form} (count and device must be 0 or more)")
    return parts[0].strip(), numbers[0], numbers[1] if len(numbers) == 2 else None


@dataclasses.dataclass(frozen=True)
class Needs:
    """What one instance needs to execute."""

    resources: tuple[tuple[Key, int], ...] = ()
    priority: int = 1


def needs_of(group: Any, device: int) -> Needs:
    """What an instance of the instance group ``group`` on ``device`` needs to execute."""
    rl = group.rate_limiter
    resources = tuple(((GLOBAL if getattr(r, "global") else device, r.name), r.count) for r in rl.resources)
    return Needs(resources, max(rl.priority, 1))


@dataclasses.dataclass(eq=False)
class Grant:
    """The resources one execution holds: taken from the pools, or borrowed from the execution
    whose BLS call it serves (``lender``). They go back once the execution is done and no
    execution it lent to still runs."""

    inst: Instance
    batch_id: int
    lender: "Grant | None"
    taken: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    borrowed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lent: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    borrowers: int = 0
    done: bool = False

    def spare(self, key: Key) -> int:
        """Copies of ``key`` this execution holds and has not lent."""
        return self.taken[key] + self.borrowed[key] - self.lent[key]


class RateLimiter:
    def __init__(self, mode: str, resources: list[tuple[str, int, int | None]]) -> None:
        self.on = mode == "execution_count"
        self.explicit: dict[int | None, dict[str, int]] = {}  # device (None: every device) -> name -> count
        for name, count, device in resources:
            self.explicit.setdefault(device, {})[name] = count  # the last flag for a name and device wins
        self.versions: dict[int, tuple[ModelVersion, list[Needs]]] = {}  # id(version) -> it, needs by index
        self.capacity: dict[Key, int] = {}
        self.used: collections.Counter = collections.Counter()  # copies taken from each pool
        self.running: dict[int, Grant] = {}  # instance number -> the grant of its execution
        self.score: dict[int, int] = {}  # instance number -> priority-weighted executions
        self.floor = 0  # the score of the last turn the line gave: where a newcomer starts
        self.turns: dict[int, int] = {}  # instance number -> when it last had a turn (ties: longest ago first)
        self.turn = 0

    # -- loading --------------------------------------------------------------------------------
    def applies_to(self, config: Any) -> bool:
        """Whether a version of ``config`` executes under the limiter (then never on direct lanes)."""
        return self.on and any(group.HasField("rate_limiter") for group in config.instance_group)

    def check(self, needs_by_instance: list[Needs]) -> None:
        """Refuse a version whose instances could never execute: ValueError with Triton's load
        error."""
        wanted: dict[Key, int] = {}
        for needs in needs_by_instance:
            for key, n in needs.resources:
                wanted[key] = max(wanted.get(key, 0), n)
        if self.explicit:
            for key, n in wanted.items():
                limit = self._explicit(key)
                if limit < n:
                    raise ValueError(f'Resource count for "{key[1]}" is limited to {limit} which will prevent '
                                      f'scheduling of one or more model instances, the minimum required count is {n}')
        scopes: dict[str, set[bool]] = collections.defaultdict(set)
        for key in [*wanted, *self.capacity]:
            scopes[key[1]].add(key[0] == GLOBAL)
        for name, kinds in scopes.items():
            if len(kinds) == 2:
                raise ValueError(f'Resource "{name}" is present as both global and device-specific resource in '
                                  f'the model configuration.')

    def register(self, mv: ModelVersion, needs_by_instance: list[Needs]) -> None:
        """``mv`` executes under the limiter from now until ``unregister`` (its workers are gone);
        ``needs_by_instance`` by instance index."""
        self.versions[id(mv)] = (mv, needs_by_instance)
        self._size_pools()
        log.info("'%s' version %d executes under the rate limiter; resources now: %s", mv.name, mv.version,
                 self.describe())

    def unregister(self, mv: ModelVersion) -> None:
        if self.versions.pop(id(mv), None) is not None:
            for inst in mv.instances:
                self.forget(inst)
            self._size_pools()

    def limited(self) -> list[ModelVersion]:
        return [mv for mv, _ in self.versions.values()]

    def _explicit(self, key: Key) -> int:
        """The flags' count for ``key``: a global resource takes the largest given for its name."""
        scope, name = key
        if scope == GLOBAL:
            return max((per.get(name, 0) for per in self.explicit.values()), default=0)
        return max(self.explicit.get(scope, {}).get(name, 0), self.explicit.get(None, {}).get(name, 0))

    def _size_pools(self) -> None:
        capacity: dict[Key, int] = {}
        for _, needs in self.versions.values():
            for need in needs:
                for key, n in need.resources:
                    capacity[key] = max(capacity.get(key, 0), n)
        self.capacity = {key: self._explicit(key) for key in capacity} if self.explicit else capacity

    # -- executions -----------------------------------------------------------------------------
    def needs(self, mv: ModelVersion, inst: Instance) -> Needs:
        needs = self.versions[id(mv)][1]
        return needs[inst.index] if inst.index < len(needs) else Needs()

    def choose(self, waiting: list[tuple[ModelVersion, Instance]]) -> tuple[ModelVersion, Instance, Grant | None] | None:
        """The idle instance (with work queued) that executes next, and the execution it borrows
        from; None while the first in line waits for its resources."""
        if not waiting:
            return None
        callers = {grant.inst.proc.pid: grant for grant in self.running.values()}
        if callers:
            lenders: dict[int, Grant | None] = {}
            for mv, inst in waiting:
                if id(mv) not in lenders:
                    lenders[id(mv)] = self._caller(mv, callers)
                lender = lenders[id(mv)]
                if lender is not None and self._fits(self.needs(mv, inst), lender):
                    return mv, inst, lender
        mv, inst = min(waiting, key=lambda c: (max(self.score.get(c[1].num, 0), self.floor),
                                               self.turns.get(c[1].num, -1)))
        return (mv, inst, None) if self._fits(self.needs(mv, inst), None) else None

    @staticmethod
    def _caller(mv: ModelVersion, callers: dict[int, Grant]) -> Grant | None:
        """The execution holding resources that waits for a request queued for ``mv`` (a BLS call)."""
        for pend in mv.queued():
            grant = callers.get(getattr(pend.client, "pid", None))
            if grant is not None:
                return grant
        return None

    def _fits(self, needs: Needs, lender: Grant | None) -> bool:
        return all(n <= self.capacity.get(key, 0) - self.used[key] + (lender.spare(key) if lender else 0)
                   for key, n in needs.resources)

    def acquire(self, mv: ModelVersion, inst: Instance, batch_id: int, lender: Grant | None) -> None:
        """``inst`` executes batch ``batch_id`` (chosen by ``choose``): take its resources."""
        needs = self.needs(mv, inst)
        grant = Grant(inst, batch_id, lender)
        for key, n in needs.resources:
            borrowed = min(n, lender.spare(key)) if lender is not None else 0
            grant.borrowed[key] = borrowed
            grant.taken[key] = n - borrowed
            self.used[key] += n - borrowed
            if lender is not None:
                lender.lent[key] += borrowed
        if lender is not None:
            lender.borrowers += 1
        self.running[inst.num] = grant
        start = max(self.score.get(inst.num, 0), self.floor)
        if lender is None:
            self.floor = start  # the line's turn went to the least-served
        self.score[inst.num] = start + needs.priority
        self.turn += 1
        self.turns[inst.num] = self.turn

    def release(self, inst: Instance, batch_id: int) -> None:
        """``inst`` finished batch ``batch_id``: its resources go back (if it held any)."""
        grant = self.running.get(inst.num)
        if grant is not None and grant.batch_id == batch_id:
            del self.running[inst.num]
            grant.done = True
            self._give_back(grant)

    def forget(self, inst: Instance) -> None:
        """``inst``'s worker is gone: what its execution held goes back, and so does its count."""
        grant = self.running.pop(inst.num, None)
        if grant is not None:
            grant.done = True
            self._give_back(grant)
        self.score.pop(inst.num, None)
        self.turns.pop(inst.num, None)

    def _give_back(self, grant: Grant | None) -> None:
        while grant is not None and grant.done and not grant.borrowers:
            for key, n in grant.taken.items():
                self.used[key] -= n
            lender = grant.lender
            if lender is not None:
                lender.lent.subtract(grant.borrowed)
                lender.borrowers -= 1
            grant = lender

    def holders(self) -> list[Instance]:
        """Instances executing on resources: their finish may let a waiting instance go."""
        return [grant.inst for grant in self.running.values()]

    def describe(self) -> str:
        """The pools, for the log."""
        pools = ", ".join(f"{name} ({'global' if scope == GLOBAL else f'device {scope}'}): {n}"
                          for (scope, name), n in sorted(self.capacity.items(), key=str))
        return pools or "none"
