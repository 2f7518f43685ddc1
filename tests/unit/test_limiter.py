"""The rate limiter on its own: pool sizes from the configs or the flags, Triton's load errors,
the turns by priority-weighted counts, the head of the line waiting for its resources, and a BLS
call running on its caller's resources, given back only once neither runs."""
from __future__ import annotations

import re
import types

import pytest

from shmserve.batching import Pending
from shmserve.server.broker.config import instance_devices, parse_config_text
from shmserve.server.broker.models import Client, Instance, ModelVersion
from shmserve.server.broker.rate_limiter import GLOBAL, RateLimiter, needs_of, parse_resource

_nums = iter(range(1000))


def version(name: str, resources: str, priority: int = 0, count: int = 1) -> ModelVersion:
    """A loaded version whose ``count`` CPU instances need ``resources`` (rate_limiter syntax)."""
    text = (f'name: "{name}" backend: "python" instance_group [ {{ count: {count} kind: KIND_CPU '
            f'rate_limiter {{ resources [ {resources} ] priority: {priority} }} }} ]')
    config = parse_config_text(text, name)
    mv = ModelVersion(name=name, version=1, model_dir="", config=config, config_dict={}, backend="python")
    for index in range(count):
        num = next(_nums)
        # The limiter reads an instance's number, index and its worker's pid: no worker is started.
        mv.instances.append(Instance(num, f"{name}_{index}", index, "CPU", 0, None,  # type: ignore[arg-type]
                                     types.SimpleNamespace(pid=100_000 + num), ready=True))
    return mv


def needs(mv: ModelVersion) -> list:
    return [needs_of(group, device) for group in mv.config.instance_group
            for device in instance_devices(group) for _ in range(group.count)]


def limiter(*versions: ModelVersion, flags: list[str] = ()) -> RateLimiter:
    rl = RateLimiter("execution_count", [parse_resource(f) for f in flags])
    for mv in versions:
        rl.check(needs(mv))
        rl.register(mv, needs(mv))
    return rl


def run(rl: RateLimiter, waiting: list[ModelVersion], batch_id: int = 1):
    """Grant the next turn among the first instances of ``waiting``, as the scheduler does."""
    turn = rl.choose([(mv, mv.instances[0]) for mv in waiting])
    if turn is not None:
        rl.acquire(*turn[:2], batch_id, turn[2])
    return turn


def test_pools_are_the_largest_ask_or_what_the_flags_give():
    a, b = version("a", '{ name: "R" count: 2 }'), version("b", '{ name: "R" count: 3 }, { name: "G" global: true count: 1 }')
    assert limiter(a, b).capacity == {(0, "R"): 3, (GLOBAL, "G"): 1}
    assert limiter(a, b, flags=["R:5", "G:4:1"]).capacity == {(0, "R"): 5, (GLOBAL, "G"): 4}
    assert limiter(a, flags=["R:1:1", "R:2"]).capacity == {(0, "R"): 2}  # device 1's count is not device 0's


@pytest.mark.parametrize("flags, loaded, resources, error", [
    (["R:1"], [], '{ name: "R" count: 2 }', 'Resource count for "R" is limited to 1 which will prevent scheduling '
                                             'of one or more model instances, the minimum required count is 2'),
    (["R:4:1"], [], '{ name: "R" count: 1 }', 'Resource count for "R" is limited to 0'),  # only device 1 has R
    (["S:1"], [], '{ name: "R" count: 1 }', 'Resource count for "R" is limited to 0'),
    ([], ['{ name: "R" count: 1 }'], '{ name: "R" global: true count: 1 }',
     'Resource "R" is present as both global and device-specific resource in the model configuration.'),
])
def test_what_the_pools_cannot_serve_is_refused(flags, loaded, resources, error):
    rl = limiter(*(version(f"m{i}", r) for i, r in enumerate(loaded)), flags=flags)
    with pytest.raises(ValueError, match=re.escape(error)):
        rl.check(needs(version("b", resources)))


def test_priority_2_gets_half_the_turns_and_a_newcomer_starts_level():
    p1, p2 = version("p1", '{ name: "R" count: 1 }', 1), version("p2", '{ name: "R" count: 1 }', 2)
    rl = limiter(p1, p2)
    order = []
    for batch_id in range(1, 31):
        mv, inst, _ = run(rl, [p1, p2], batch_id)
        assert run(rl, [p1, p2]) is None  # R is taken: nobody else goes
        order.append(mv.name)
        rl.release(inst, batch_id)
    assert order.count("p1") == 20 and order.count("p2") == 10
    late = version("late", '{ name: "R" count: 1 }', 1)
    rl.register(late, needs(late))
    order = []
    for batch_id in range(31, 43):
        mv, inst, _ = run(rl, [p1, late], batch_id)
        order.append(mv.name)
        rl.release(inst, batch_id)
    assert order.count("late") == 6  # it does not take every turn until it has run 20 times


def test_the_head_of_the_line_waits_for_its_resources_and_nobody_passes_it():
    small, big, other = (version("small", '{ name: "R" count: 1 }'), version("big", '{ name: "R" count: 2 }'),
                         version("other", '{ name: "R" count: 1 }'))
    rl = limiter(small, big, other)
    run(rl, [small])
    run(rl, [other], batch_id=2)  # one copy left for big's two; other ran, so big is first in line
    rl.release(other.instances[0], 2)
    assert run(rl, [big, other]) is None  # one copy is free, but big needs both: other waits behind it
    rl.release(small.instances[0], 1)
    assert run(rl, [big, other], batch_id=3)[0] is big


def test_a_bls_call_runs_on_its_callers_resources_given_back_once_neither_runs():
    parent, child, other = (version(n, '{ name: "R" count: 1 }') for n in ("parent", "child", "other"))
    rl = limiter(parent, child, other)
    run(rl, [parent])
    caller = Client("client.x", 1, None, pid=parent.instances[0].proc.pid)  # type: ignore[arg-type]
    child.queue.append(Pending(caller, 0, 0, {}, 1, 0.0))  # parent's BLS request
    mv, inst, lender = run(rl, [other, child], batch_id=2)
    assert (mv, lender) == (child, rl.running[parent.instances[0].num])  # ahead of other, on parent's copy
    rl.release(parent.instances[0], 1)  # the caller finished first (it did not wait for the call)
    assert run(rl, [other]) is None  # the copy is still the child's
    rl.release(inst, 2)
    assert run(rl, [other], batch_id=3)[0] is other
    assert rl.used[(0, "R")] == 1
