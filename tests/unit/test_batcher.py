"""The dynamic batcher on its own: which requests form a batch and when, with the clock passed in
as ``now`` (the batcher reads no clock itself), so every delay and timeout is exact."""
from __future__ import annotations

import pytest

from shmserve.config_view import to_dict
from shmserve.server.broker import config as cfgmod
from shmserve.batching import DynamicBatcher, QueueFull, QueuePolicy, batches_on_worker
from shmserve.batching import Pending
from shmserve.server.broker.models import Client

DELAY_US = 100_000  # 0.1 s
DELAY_S = DELAY_US / 1e6


def request(slot: int, arrived: float = 0.0, batch: int = 1, width: int = 3, priority: int = 0,
            timeout_us: int = 0, client: Client | None = None) -> Pending:
    """A queued request with one FP32 input of shape [batch, width]."""
    entry = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [batch, width]}]}
    return Pending(client, slot, 0, entry, batch, arrived, priority=priority, timeout_us=timeout_us)


def batcher(max_batch_size: int = 8, **dynamic_batching) -> DynamicBatcher:
    dynamic_batching.setdefault("max_queue_delay_microseconds", DELAY_US)
    return DynamicBatcher({"max_batch_size": max_batch_size, "dynamic_batching": dynamic_batching})


def slots(batch: list[Pending] | None) -> list[int] | None:
    return None if batch is None else [p.slot for p in batch]


def fill(b: DynamicBatcher, n: int, arrived: float = 0.0, **kw) -> list[Pending]:
    out = [request(i, arrived, **kw) for i in range(n)]
    for p in out:
        b.enqueue(p, arrived)
    return out


# -- sizes and the delay ----------------------------------------------------------------------


def test_preferred_sizes_are_sorted_and_those_outside_1_to_max_batch_size_ignored():
    assert batcher(8, preferred_batch_size=[8, 0, 4, 16]).preferred == [4, 8]
    assert batcher(8).preferred == [8]  # none configured: the batch aims for max_batch_size
    assert batcher(8, preferred_batch_size=[16]).preferred == [8]


def test_an_empty_batcher_has_no_batch_and_no_timer():
    b = batcher(preferred_batch_size=[4])
    assert len(b) == 0 and b.next_batch(0.0) is None and b.next_timer(0.0) is None


def test_a_preferred_size_goes_at_once():
    b = batcher(preferred_batch_size=[4])
    fill(b, 4)
    assert slots(b.next_batch(0.0)) == [0, 1, 2, 3]
    assert len(b) == 0 and b.next_timer(0.0) is None


def test_a_partial_batch_waits_out_the_delay_of_its_oldest_request():
    b = batcher(preferred_batch_size=[4])
    b.enqueue(request(0, 0.0), 0.0)
    b.enqueue(request(1, 0.06), 0.06)
    assert b.next_batch(0.06) is None
    assert b.next_timer(0.06) == pytest.approx(DELAY_S - 0.06)  # counted from the oldest, not the newest
    assert b.next_batch(DELAY_S - 1e-6) is None
    assert slots(b.next_batch(DELAY_S)) == [0, 1]
    assert len(b) == 0


def test_without_a_delay_whatever_waits_goes_at_once():
    b = batcher(8, max_queue_delay_microseconds=0, preferred_batch_size=[4])
    fill(b, 2)
    assert slots(b.next_batch(0.0)) == [0, 1]


def test_batch_dimensions_add_up_to_a_preferred_size():
    b = batcher(preferred_batch_size=[4])
    b.enqueue(request(0, batch=3), 0.0)
    b.enqueue(request(1, batch=1), 0.0)
    batch = b.next_batch(0.0)
    assert slots(batch) == [0, 1] and sum(p.batch for p in batch) == 4


def test_the_largest_preferred_size_that_can_be_filled_goes_at_once():
    """Five wait, preferred sizes 4 and 8: a batch of 4 goes now (Triton's rule, and the module's
    own: 'the largest one it can fill'); the fifth waits for more or for the delay."""
    b = batcher(8, preferred_batch_size=[4, 8])
    fill(b, 5)
    assert slots(b.next_batch(0.0)) == [0, 1, 2, 3]
    assert len(b) == 1
    assert b.next_batch(0.0) is None
    assert slots(b.next_batch(DELAY_S)) == [4]


def test_a_batch_that_cannot_grow_goes_at_once():
    """The next request would pass max_batch_size: waiting could add nothing to this batch."""
    b = batcher(4)
    b.enqueue(request(0, batch=3), 0.0)
    b.enqueue(request(1, batch=3), 0.0)
    assert slots(b.next_batch(0.0)) == [0]
    assert b.next_batch(0.0) is None  # the second alone can still grow: it waits
    assert slots(b.next_batch(DELAY_S)) == [1]


def test_a_batch_that_cannot_grow_still_prefers_a_preferred_size():
    b = batcher(8, preferred_batch_size=[4, 8])
    fill(b, 5)
    b.enqueue(request(5, batch=4), 0.0)  # 5 + 4 > 8
    assert slots(b.next_batch(0.0)) == [0, 1, 2, 3]


def test_a_request_larger_than_every_preferred_size_goes_alone_at_once():
    """Never an empty batch: a worker batching its own lanes loops while its queue holds requests,
    and an empty batch would leave it spinning there for good."""
    b = batcher(4, preferred_batch_size=[2])
    b.enqueue(request(0, batch=3), 0.0)
    assert slots(b.next_batch(0.0)) == [0]
    assert len(b) == 0


def test_before_the_delay_a_batch_stops_short_of_the_request_that_passes_the_largest_preferred_size():
    b = batcher(8, preferred_batch_size=[4])
    b.enqueue(request(0, batch=3), 0.0)
    b.enqueue(request(1, batch=2), 0.0)  # 3 + 2 passes 4 (not 8): the older one goes first, alone
    assert slots(b.next_batch(0.0)) == [0]
    assert b.next_batch(0.0) is None
    b.enqueue(request(2, batch=3), 0.0)
    b.enqueue(request(3, batch=3), 0.0)
    # After the delay a batch goes as it stands: 2 + 3 passes 4, so it ends there.
    assert slots(b.next_batch(DELAY_S)) == [1, 2]
    assert slots(b.next_batch(DELAY_S)) == [3]


def drain(b: DynamicBatcher, now: float) -> list[list[int]]:
    """Every batch due at ``now``, as a worker batching its own lanes takes them."""
    out = []
    while len(b):
        batch = b.next_batch(now)
        if batch is None:
            break
        assert batch, "an empty batch removes nothing: the loop would never end"
        out.append(slots(batch))
    return out


@pytest.mark.parametrize("preferred", [[], [1], [2], [3], [2, 3], [1, 4], [4]])
@pytest.mark.parametrize("sizes", [[1], [3], [4], [1, 3], [3, 1], [2, 2, 2], [1, 1, 1, 1, 1], [4, 1, 3, 2]])
def test_every_queue_drains_in_batches_within_max_batch_size(preferred, sizes):
    b = batcher(4, preferred_batch_size=preferred)
    for i, n in enumerate(sizes):
        b.enqueue(request(i, batch=n), 0.0)
    batches = drain(b, 0.0) + drain(b, DELAY_S)
    assert sorted(s for batch in batches for s in batch) == list(range(len(sizes)))
    assert all(sum(sizes[s] for s in batch) <= 4 for batch in batches)
    assert len(b) == 0


def test_a_batch_never_passes_max_batch_size_even_after_the_delay():
    b = batcher(4)
    fill(b, 6)
    first = b.next_batch(0.0)  # 4 = max_batch_size, the target without preferred sizes
    assert slots(first) == [0, 1, 2, 3]
    assert slots(b.next_batch(DELAY_S)) == [4, 5]


def test_requests_of_another_shape_wait_for_a_batch_of_their_own():
    b = batcher(8, preferred_batch_size=[2])
    b.enqueue(request(0, width=3), 0.0)
    b.enqueue(request(1, width=5), 0.0)
    b.enqueue(request(2, width=3), 0.0)
    assert slots(b.next_batch(0.0)) == [0, 2]
    assert slots(b.next_batch(0.0)) is None  # one of width 5: not a preferred size yet
    assert slots(b.next_batch(DELAY_S)) == [1]


def test_a_ragged_input_batches_whatever_its_shape_and_the_others_still_must_match():
    """``allow_ragged_batch`` lifts the shape rule for that input only (Triton's rule)."""
    b = DynamicBatcher({"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [3]},
                        "input": [{"name": "INPUT0", "allow_ragged_batch": True}, {"name": "MASK"}]})

    def ragged(slot: int, width: int, mask: int) -> Pending:
        entry = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, width]},
                            {"name": "MASK", "datatype": "FP32", "shape": [1, mask]}]}
        return Pending(None, slot, 0, entry, 1, 0.0)

    for slot, (width, mask) in enumerate([(3, 2), (5, 2), (4, 7), (9, 2)]):
        b.enqueue(ragged(slot, width, mask), 0.0)
    assert slots(b.next_batch(0.0)) == [0, 1, 3]  # widths 3, 5, 9 together; MASK [1, 7] waits
    assert slots(b.next_batch(DELAY_S)) == [2]


def test_the_delay_is_skipped_once_the_traffic_of_one_delay_waits_again():
    b = batcher(16)
    fill(b, 3)
    assert b.next_batch(0.0) is None
    assert slots(b.next_batch(DELAY_S)) == [0, 1, 2]  # waited the whole delay: 3 gathered
    fill(b, 3, arrived=1.0)
    assert slots(b.next_batch(1.0)) == [0, 1, 2]  # as many as one delay gathers: at once
    fill(b, 2, arrived=2.0)
    assert b.next_batch(2.0) is None  # fewer: the full delay again, and the size adapts
    assert slots(b.next_batch(2.0 + DELAY_S)) == [0, 1]
    fill(b, 2, arrived=3.0)
    assert slots(b.next_batch(3.0)) == [0, 1]


def test_next_timer_is_the_earliest_of_the_delay_and_the_queue_timeouts():
    b = batcher(8, preferred_batch_size=[4], default_queue_policy={"default_timeout_microseconds": 30_000})
    b.enqueue(request(0, 0.0), 0.0)
    assert b.next_timer(0.0) == pytest.approx(0.03)
    assert b.next_timer(0.05) == 0.0  # past due: never negative


def test_what_was_due_when_the_caller_last_looked_sets_no_timer():
    """A batch due when the broker last asked (and had no free instance) waits for an instance's
    finish, which wakes the broker: a timer for it would make the broker spin."""
    b = batcher(8, preferred_batch_size=[4], default_queue_policy={"default_timeout_microseconds": 300_000})
    b.enqueue(request(0, 0.0), 0.0)
    assert b.next_timer(0.15, looked=0.15) == pytest.approx(0.15)  # the delay passed; its timeout has not
    assert b.next_timer(0.05, looked=0.0) == pytest.approx(0.05)  # looked before the delay ended: it still counts
    assert b.next_timer(0.4, looked=0.35) is None  # both were due when it looked


# -- priorities and queue policies ------------------------------------------------------------


def test_higher_priority_goes_first_and_out_of_range_priorities_take_the_default_level():
    b = batcher(1, priority_levels=3, default_priority_level=2)
    low, high, default, odd = request(0, priority=3), request(1, priority=1), request(2), request(3, priority=9)
    for p in (low, default, odd, high):
        b.enqueue(p, 0.0)
    assert (low.level, high.level, default.level, odd.level) == (3, 1, 2, 2)
    order = [slots(b.next_batch(0.0)) for _ in range(4)]
    assert order == [[1], [2], [3], [0]]


def test_a_batch_is_formed_from_the_highest_priority_request_onwards():
    b = batcher(4, priority_levels=2, default_priority_level=2, preferred_batch_size=[2])
    b.enqueue(request(0, priority=2), 0.0)
    b.enqueue(request(1, priority=1), 0.0)
    assert slots(b.next_batch(0.0)) == [1, 0]


def test_a_full_queue_refuses_with_503_and_takes_requests_again_once_one_left():
    b = batcher(1, priority_levels=2, default_priority_level=2,
                priority_queue_policy={"1": {"max_queue_size": 1}}, default_queue_policy={"max_queue_size": 2})
    b.enqueue(request(0, priority=1), 0.0)
    with pytest.raises(QueueFull) as e:
        b.enqueue(request(1, priority=1), 0.0)
    assert e.value.status == 503
    assert str(e.value) == "Exceeds maximum queue size"  # Triton's words, nothing added
    b.enqueue(request(2, priority=2), 0.0)  # each level has its own bound
    b.enqueue(request(3, priority=2), 0.0)
    with pytest.raises(QueueFull):
        b.enqueue(request(4, priority=2), 0.0)
    assert len(b) == 3
    assert slots(b.next_batch(DELAY_S)) == [0]
    b.enqueue(request(5, priority=1), 0.0)
    assert len(b) == 3


def test_a_timed_out_request_is_rejected_by_expire():
    b = batcher(8, preferred_batch_size=[4], default_queue_policy={"default_timeout_microseconds": 50_000})
    a, late = request(0, 0.0), request(1, 0.04)
    b.enqueue(a, 0.0)
    b.enqueue(late, 0.04)
    assert a.deadline == pytest.approx(0.05)
    assert b.expire(0.049) == []
    assert b.expire(0.05) == [a]
    assert len(b) == 1 and b.all() == [late]
    assert b.expire(0.09) == [late] and len(b) == 0


def test_a_request_may_shorten_the_default_timeout_but_never_lengthen_it():
    policy = {"default_timeout_microseconds": 50_000, "allow_timeout_override": True}
    b = batcher(8, default_queue_policy=policy)
    shorter, longer, plain = request(0, timeout_us=10_000), request(1, timeout_us=900_000), request(2)
    for p in (shorter, longer, plain):
        b.enqueue(p, 0.0)
    assert (shorter.deadline, longer.deadline, plain.deadline) == pytest.approx((0.01, 0.05, 0.05))
    # With no default, none is set by a request either (Triton's priority queue: an override only
    # shortens a non-zero default).
    b = batcher(8, default_queue_policy={"allow_timeout_override": True})
    own = request(0, timeout_us=20_000)
    b.enqueue(own, 1.0)
    assert own.deadline == 0.0 and not b.timed
    assert b.expire(100.0) == [] and len(b) == 1


def test_a_request_timeout_is_ignored_unless_the_policy_allows_overrides():
    b = batcher(8)
    p = request(0, timeout_us=1)
    b.enqueue(p, 0.0)
    assert p.deadline == 0.0 and not b.timed
    assert b.expire(100.0) == [] and len(b) == 1


def test_timeout_action_delay_serves_timed_out_requests_after_the_others():
    b = batcher(1, default_queue_policy={"timeout_action": "DELAY", "default_timeout_microseconds": 50_000})
    early, later = request(0, 0.0), request(1, 0.2)
    b.enqueue(early, 0.0)
    b.enqueue(later, 0.2)
    assert b.expire(0.2) == []  # DELAY: nothing is rejected
    assert early.delayed and early.deadline == 0.0 and len(b) == 2
    assert slots(b.next_batch(0.2)) == [1]
    assert slots(b.next_batch(0.2)) == [0]
    assert len(b) == 0 and b.all() == []


def test_a_delayed_request_waits_behind_its_level_only_not_behind_lower_priorities():
    """As Triton's priority queue: each level serves its requests that did not time out, then its
    delayed ones, before the next level's (a delayed level-1 request goes before a fresh level-2 one)."""
    b = batcher(1, priority_levels=2, default_priority_level=1,
                default_queue_policy={"timeout_action": "DELAY", "default_timeout_microseconds": 100_000})
    for slot, arrived, priority in ((2, 0.05, 2), (3, 0.06, 1), (4, 0.07, 2), (5, 0.25, 1), (6, 0.26, 2)):
        b.enqueue(request(slot, arrived, priority=priority), arrived)
    assert b.expire(0.27) == []  # 2, 3 and 4 are past their 0.1 s: delayed in their levels
    order = []
    while len(b):
        order += slots(b.next_batch(1.0))
    assert order == [5, 3, 6, 2, 4]


def test_drop_client_forgets_only_that_clients_requests_queued_and_delayed():
    gone, stays = Client("gone", 1, None), Client("stays", 2, None)  # type: ignore[arg-type]
    b = batcher(8, default_queue_policy={"timeout_action": "DELAY", "default_timeout_microseconds": 10_000})
    b.enqueue(request(0, 0.0, client=gone), 0.0)
    b.enqueue(request(1, 0.0, client=stays), 0.0)
    b.expire(0.02)  # both delayed
    b.enqueue(request(2, 0.02, client=gone), 0.02)
    b.enqueue(request(3, 0.02, client=stays), 0.02)
    b.drop_client(gone)
    assert len(b) == 2 and sorted(p.slot for p in b.all()) == [1, 3]
    assert all(p.client is stays for p in b.all())


# -- the config's dict form -------------------------------------------------------------------


def config_dict(text: str) -> dict:
    config = cfgmod.parse_config_text(text, "m")
    return to_dict(config)


def test_queue_policies_read_from_a_parsed_config():
    d = config_dict('''
        max_batch_size: 4
        dynamic_batching {
          preserve_ordering: true
          priority_levels: 2
          default_priority_level: 2
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 7000 max_queue_size: 3 }
          priority_queue_policy { key: 1 value { allow_timeout_override: true max_queue_size: 1 } }
        }''')
    b = DynamicBatcher(d)
    assert b.preserve_ordering and b.levels == 2 and b.default_level == 2
    assert b.policies[1] == QueuePolicy(reject_on_timeout=False, default_timeout_us=7000, max_queue_size=3)
    assert b.policies[0] == QueuePolicy(reject_on_timeout=True, allow_timeout_override=True, max_queue_size=1)
    assert b.timed


def test_batches_on_worker_only_for_one_instance_of_a_batching_non_sequence_model():
    dynamic = config_dict("max_batch_size: 8 dynamic_batching { }")
    assert batches_on_worker(dynamic, 1)
    assert not batches_on_worker(dynamic, 2)  # the broker picks the instance
    assert not batches_on_worker(config_dict("max_batch_size: 8"), 1)
    assert not batches_on_worker(config_dict("max_batch_size: 0 dynamic_batching { }"), 1)
    assert not batches_on_worker(config_dict("max_batch_size: 8 sequence_batching { }"), 1)
    # (a config holds one of the two schedulers; a dict from elsewhere may hold both)
    assert not batches_on_worker({"max_batch_size": 8, "dynamic_batching": {}, "sequence_batching": {}}, 1)
    # A queue policy that refuses or times out is the broker's, whose scheduler acts while a batch runs.
    assert not batches_on_worker(config_dict("max_batch_size: 8 dynamic_batching { default_queue_policy "
                                             "{ max_queue_size: 2 } }"), 1)
    assert not batches_on_worker(config_dict("max_batch_size: 8 dynamic_batching { priority_levels: 2 "
                                             "priority_queue_policy { key: 2 value { default_timeout_microseconds: "
                                             "500 } } }"), 1)
    assert batches_on_worker(config_dict("max_batch_size: 8 dynamic_batching { priority_levels: 2 "
                                         "default_queue_policy { allow_timeout_override: true } }"), 1)


def test_a_large_request_of_another_shape_does_not_stop_the_batch_from_growing():
    b = batcher(4, preferred_batch_size=[2])
    b.enqueue(request(0, width=3), 0.0)
    b.enqueue(request(1, batch=4, width=5), 0.0)
    b.enqueue(request(2, width=3), 0.0)
    assert slots(b.next_batch(0.0)) == [0, 2]
    assert slots(b.next_batch(0.0)) == [1]  # 4 = max_batch_size
