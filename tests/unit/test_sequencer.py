"""The sequence batcher on its own: sequences keep one slot on one instance from START to END,
wait in a backlog when every slot is taken, lose their slot when idle, and each batch takes at
most one request per sequence, in slot order (direct) or by age (oldest)."""
from __future__ import annotations

import pytest

from shmserve.server.broker.config import parse_config_text
from shmserve.batching import Pending
from shmserve.server.broker.models import Instance
from shmserve.server.broker.sequencer import DEFAULT_IDLE_S, END, START, SequenceBatcher
from shmserve.signature import InvalidRequest


def sequencer(max_batch_size: int = 2, strategy: str = "direct { }", idle_us: int = 0) -> SequenceBatcher:
    idle = f"max_sequence_idle_microseconds: {idle_us}" if idle_us else ""
    text = f'name: "seq" max_batch_size: {max_batch_size} sequence_batching {{ {idle} {strategy} }}'
    return SequenceBatcher(parse_config_text(text, "seq"))


def instance(num: int, ready: bool = True) -> Instance:
    """An instance as the sequencer sees it: a number and readiness (it never touches the worker's
    segment or process, so none is made here)."""
    return Instance(num, f"seq_{num}", num, "CPU", 0, None, None, ready=ready)  # type: ignore[arg-type]


def step(corr, flags: int = 0, arrived: float = 0.0, batch: int = 1, tag: str = "") -> Pending:
    entry = {"sequence_id": corr, "sequence_flags": flags, "id": tag, "inputs": []}
    return Pending(None, 0, 0, entry, batch, arrived)


def ids(batch: list[Pending] | None) -> list[str] | None:
    return None if batch is None else [p.entry["id"] for p in batch]


# -- what a request must carry ----------------------------------------------------------------


def test_a_batch_of_several_is_refused_before_the_correlation_id_is_looked_at():
    sb, inst = sequencer(), instance(0)
    with pytest.raises(InvalidRequest, match="must specify batch-size 1 due to requirements of sequence batcher"):
        sb.enqueue(step(None, START, batch=2), [inst], 0.0)


@pytest.mark.parametrize("corr", [None, 0, ""])
def test_a_missing_or_zero_correlation_id_is_refused(corr):
    sb, inst = sequencer(), instance(0)
    with pytest.raises(InvalidRequest, match="must specify a non-zero or non-empty correlation ID"):
        sb.enqueue(step(corr, START), [inst], 0.0)
    assert len(sb) == 0 and not sb.sequences


def test_a_sequence_must_begin_with_start():
    sb, inst = sequencer(), instance(0)
    with pytest.raises(InvalidRequest, match="sequence 5 to model 'seq' must specify the START flag"):
        sb.enqueue(step(5), [inst], 0.0)


def test_nothing_may_follow_an_end_but_a_new_start():
    sb, inst = sequencer(), instance(0)
    sb.enqueue(step(5, START | END), [inst], 0.0)
    with pytest.raises(InvalidRequest, match="must specify the START flag"):
        sb.enqueue(step(5), [inst], 0.0)


def test_string_and_integer_correlation_ids_are_different_sequences():
    sb, inst = sequencer(max_batch_size=4), instance(0)
    sb.enqueue(step(1, START, tag="int"), [inst], 0.0)
    sb.enqueue(step("1", START, tag="str"), [inst], 0.0)
    assert set(sb.sequences) == {1, "1"}
    batch = sb.next_batch(inst, [inst], 0.0)
    assert ids(batch) == ["int", "str"]
    assert [p.entry["slot_index"] for p in batch] == [0, 1]


# -- slots and batches --------------------------------------------------------------------------


def test_a_sequence_keeps_its_slot_and_a_batch_takes_one_request_of_it():
    sb, inst = sequencer(max_batch_size=4), instance(0)
    sb.enqueue(step(7, START, tag="a0"), [inst], 0.0)
    sb.enqueue(step(7, 0, tag="a1"), [inst], 0.0)
    sb.enqueue(step(8, START, tag="b0"), [inst], 0.0)
    sb.enqueue(step(7, END, tag="a2"), [inst], 0.0)
    assert len(sb) == 4 and sorted(ids(sb.all())) == ["a0", "a1", "a2", "b0"]
    first = sb.next_batch(inst, [inst], 0.0)
    assert ids(first) == ["a0", "b0"]
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["a1"]
    last = sb.next_batch(inst, [inst], 0.0)
    assert ids(last) == ["a2"] and last[0].entry["slot_index"] == 0
    assert sb.next_batch(inst, [inst], 0.0) is None
    # END frees the slot without a release: the worker forgets the sequence at END itself.
    assert 7 not in sb.sequences and sb.slots[0][0] is None
    assert sb.take_releases(inst) == []


def test_more_sequences_than_slots_wait_in_the_backlog_for_a_freed_slot():
    sb, inst = sequencer(max_batch_size=2), instance(0)
    for corr in (1, 2, 3):
        sb.enqueue(step(corr, START, tag=f"s{corr}"), [inst], 0.0)
    assert [s.corr for s in sb.backlog] == [3]
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s1", "s2"]
    assert sb.next_batch(inst, [inst], 0.0) is None  # 3 still has no slot
    sb.enqueue(step(1, END, tag="e1"), [inst], 0.0)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["e1"]
    batch = sb.next_batch(inst, [inst], 0.0)  # the slot 1 left goes to the backlog's first
    assert ids(batch) == ["s3"] and batch[0].entry["slot_index"] == 0
    assert not sb.backlog


def test_sequences_go_to_the_ready_instance_with_the_most_free_slots():
    sb = sequencer(max_batch_size=2)
    a, b, down = instance(0), instance(1), instance(2, ready=False)
    everyone = [down, a, b]
    for corr in (1, 2, 3):
        sb.enqueue(step(corr, START), everyone, 0.0)
    assert [sb.sequences[c].inst.num for c in (1, 2, 3)] == [0, 1, 0]
    assert 2 not in sb.slots  # a down instance gets no slot
    assert ids(sb.next_batch(down, everyone, 0.0)) is None


def test_with_no_ready_instance_a_sequence_waits_until_one_is():
    sb, inst = sequencer(), instance(0, ready=False)
    sb.enqueue(step(1, START, tag="s"), [inst], 0.0)
    assert [s.corr for s in sb.backlog] == [1]
    inst.ready = True
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s"]


def started(sb: SequenceBatcher, inst: Instance, corrs: list[int]) -> None:
    """Sequences ``corrs`` started and their START requests run."""
    for corr in corrs:
        sb.enqueue(step(corr, START), [inst], 0.0)
    while sb.next_batch(inst, [inst], 0.0):
        pass


def test_direct_walks_the_slots_in_order():
    sb, inst = sequencer(max_batch_size=2, strategy="direct { }"), instance(0)
    started(sb, inst, [1, 2])
    sb.enqueue(step(2, 0, arrived=1.0, tag="s2"), [inst], 1.0)
    sb.enqueue(step(1, 0, arrived=2.0, tag="s1"), [inst], 2.0)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s1", "s2"]


def test_oldest_takes_the_sequences_whose_next_request_is_oldest():
    sb, inst = sequencer(max_batch_size=2, strategy="oldest { max_candidate_sequences: 3 }"), instance(0)
    started(sb, inst, [1, 2, 3])
    for corr, arrived in ((1, 3.0), (2, 1.0), (3, 2.0)):
        sb.enqueue(step(corr, 0, arrived=arrived, tag=f"s{corr}"), [inst], arrived)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s2", "s3"]  # two of three candidates, by age
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s1"]


def test_oldest_offers_as_many_slots_as_candidate_sequences():
    assert sequencer(max_batch_size=2, strategy="oldest { max_candidate_sequences: 5 }").slots_per_instance == 5
    assert sequencer(max_batch_size=4, strategy="oldest { max_candidate_sequences: 2 }").slots_per_instance == 2
    assert sequencer(max_batch_size=4, strategy="oldest { }").slots_per_instance == 4
    assert sequencer(max_batch_size=0).slots_per_instance == 1  # a model that does not batch: one sequence
    assert sequencer(max_batch_size=0).max_batch == 1


def test_oldest_waits_up_to_the_delay_for_a_full_batch():
    sb, inst = sequencer(max_batch_size=3, strategy="oldest { max_queue_delay_microseconds: 100000 }"), instance(0)
    sb.enqueue(step(1, START, arrived=1.0, tag="s1"), [inst], 1.0)
    assert sb.next_batch(inst, [inst], 1.0) is None  # one of three: wait
    assert sb.next_timer(1.0) == pytest.approx(0.1)
    sb.enqueue(step(2, START, arrived=1.05, tag="s2"), [inst], 1.05)
    assert sb.next_batch(inst, [inst], 1.05) is None
    assert ids(sb.next_batch(inst, [inst], 1.1)) == ["s1", "s2"]  # the oldest waited the delay
    for corr in (1, 2, 3):
        sb.enqueue(step(corr, START if corr == 3 else 0, arrived=2.0, tag=f"n{corr}"), [inst], 2.0)
    assert ids(sb.next_batch(inst, [inst], 2.0)) == ["n1", "n2", "n3"]  # max_batch_size: at once


def test_oldest_sends_the_largest_preferred_size_it_can_fill_at_once():
    strategy = "oldest { max_candidate_sequences: 6 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 1000000 }"
    sb, inst = sequencer(max_batch_size=4, strategy=strategy), instance(0)
    for corr in range(1, 4):
        sb.enqueue(step(corr, START, arrived=corr / 10, tag=f"s{corr}"), [inst], corr / 10)
    assert ids(sb.next_batch(inst, [inst], 0.3)) == ["s1", "s2"]  # 2 of 3 ready: the preferred 2
    assert sb.next_batch(inst, [inst], 0.3) is None  # s3 alone waits
    for corr in range(4, 7):
        sb.enqueue(step(corr, START, arrived=0.35, tag=f"s{corr}"), [inst], 0.35)
    assert ids(sb.next_batch(inst, [inst], 0.35)) == ["s3", "s4", "s5", "s6"]  # the largest preferred size


def test_oldest_delay_timer_counts_only_requests_still_waiting():
    sb, inst = sequencer(max_batch_size=2, strategy="oldest { max_queue_delay_microseconds: 100000 }"), instance(0)
    sb.enqueue(step(1, START, arrived=0.0), [inst], 0.0)
    assert sb.next_timer(0.05) == pytest.approx(0.05)
    assert sb.next_timer(0.2) is None  # its delay ended: it goes when the instance is free


def test_a_start_after_a_queued_end_begins_a_sequence_that_goes_on():
    """START, END and a new START of the same id, sent before the END ran: the new sequence
    keeps its slot after its START runs, and its next request is taken."""
    sb, inst = sequencer(), instance(0)
    sb.enqueue(step(9, START, tag="s"), [inst], 0.0)
    sb.enqueue(step(9, END, tag="e"), [inst], 0.0)
    sb.enqueue(step(9, START, tag="s2"), [inst], 0.0)
    assert [ids(sb.next_batch(inst, [inst], 0.0)) for _ in range(3)] == [["s"], ["e"], ["s2"]]
    assert sb.sequences[9].slot == 0 and sb.take_releases(inst) == []
    sb.enqueue(step(9, 0, tag="m2"), [inst], 1.0)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["m2"]


def test_a_start_on_an_idle_sequence_restarts_it_and_tells_the_worker_to_forget_the_old_one():
    sb, inst = sequencer(), instance(0)
    sb.enqueue(step(4, START), [inst], 0.0)
    sb.next_batch(inst, [inst], 0.0)
    old = sb.sequences[4]
    sb.enqueue(step(4, START, tag="again"), [inst], 0.1)
    assert sb.sequences[4] is not old
    assert sb.take_releases(inst) == [4]
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["again"]


def test_a_cancelled_queued_request_ends_its_sequence_and_what_follows_it_is_late():
    """As in Triton: a request cancelled before it ran ends its sequence; of those queued behind
    it, one without START is refused as any late one is, and a START begins the sequence again."""
    sb, inst = sequencer(), instance(0)
    client = object()

    def at(slot: int, flags: int, tag: str) -> Pending:
        p = step(5, flags, tag=tag)
        p.client, p.slot = client, slot
        return p

    sb.enqueue(at(1, START, "s"), [inst], 0.0)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["s"]  # runs
    for slot, flags, tag in ((2, 0, "m"), (3, 0, "late"), (4, START, "again"), (5, END, "end")):
        sb.enqueue(at(slot, flags, tag), [inst], 0.1)
    assert sb.cancel(client, 9, [inst], 0.2) == (None, [])  # no such request: nothing changes
    cancelled, refused = sb.cancel(client, 2, [inst], 0.2)
    assert cancelled is not None and cancelled.entry["id"] == "m"
    assert [(p.entry["id"], "START" in str(e)) for p, e in refused] == [("late", True)]
    assert sb.take_releases(inst) == [5]  # the worker forgets the ended sequence's state
    assert [ids(sb.next_batch(inst, [inst], 0.3)) for _ in range(2)] == [["again"], ["end"]]


# -- idle sequences, clients and instances that go away ---------------------------------------


def test_an_idle_sequence_loses_its_slot_and_the_worker_is_told():
    sb, inst = sequencer(idle_us=50_000), instance(0)
    sb.enqueue(step(1, START), [inst], 0.0)
    sb.enqueue(step(2, START), [inst], 0.04)
    sb.next_batch(inst, [inst], 0.0)
    assert sb.next_timer(0.0) == pytest.approx(0.05)  # the first to fall idle
    sb.expire(0.05)  # exactly the limit: still kept
    assert set(sb.sequences) == {1, 2}
    sb.expire(0.0501)
    assert set(sb.sequences) == {2} and sb.slots[0][0] is None
    assert sb.take_releases(inst) == [1]
    assert sb.take_releases(inst) == []  # taken once
    with pytest.raises(InvalidRequest, match="START"):
        sb.enqueue(step(1), [inst], 0.06)


def test_a_sequence_with_queued_requests_is_never_idle():
    sb, inst = sequencer(idle_us=50_000), instance(0)
    sb.enqueue(step(1, START), [inst], 0.0)
    sb.expire(10.0)
    assert 1 in sb.sequences and len(sb) == 1
    assert sb.next_timer(10.0) is None


def test_the_idle_limit_defaults_to_one_second():
    assert sequencer().idle_s == DEFAULT_IDLE_S == 1.0


def timed(corr, flags: int = 0, arrived: float = 0.0, timeout_us: int = 0, tag: str = "") -> Pending:
    p = step(corr, flags, arrived, tag=tag)
    p.timeout_us = timeout_us
    return p


def test_a_timeout_ends_a_backlogged_sequences_wait_and_the_broker_wakes_for_it():
    """Triton's backlog expiry: the earliest deadline among a backlogged sequence's requests
    refuses them all and forgets the sequence; the slot holder keeps its slot, and a timeout on a
    request of a sequence that has a slot counts for nothing."""
    sb, inst = sequencer(max_batch_size=1, idle_us=60_000_000), instance(0)
    sb.enqueue(timed(1, START, timeout_us=1000, tag="s1"), [inst], 0.0)  # gets the slot: no deadline
    sb.next_batch(inst, [inst], 0.0)
    sb.enqueue(timed(2, START, 0.0, tag="s2"), [inst], 0.0)
    sb.enqueue(timed(2, 0, 0.1, timeout_us=300_000, tag="m2"), [inst], 0.1)
    sb.enqueue(timed(2, 0, 0.2, timeout_us=5_000_000, tag="n2"), [inst], 0.2)  # a later deadline changes nothing
    assert sb.next_timer(0.2) == pytest.approx(0.2)  # the broker wakes when m2's 0.3 s end
    assert sb.expire(0.39) == []
    assert ids(sb.expire(0.41)) == ["s2", "m2", "n2"]
    assert not sb.backlog and 2 not in sb.sequences and sb.slots[0][0] is sb.sequences[1]
    with pytest.raises(InvalidRequest, match="START"):
        sb.enqueue(step(2), [inst], 0.5)


def test_a_start_behind_a_backlogged_end_waits_with_its_own_timeout():
    """A START queued behind its sequence's END in the backlog begins another of Triton's backlog
    queues: the first one's deadline refuses only the first one's requests."""
    sb, inst = sequencer(max_batch_size=1), instance(0)
    sb.enqueue(step(1, START), [inst], 0.0)
    sb.enqueue(timed(2, START | END, 0.0, timeout_us=100_000, tag="whole"), [inst], 0.0)
    sb.enqueue(timed(2, START, 0.05, tag="again"), [inst], 0.05)
    assert ids(sb.expire(0.2)) == ["whole"]
    assert ids(list(sb.sequences[2].pending)) == ["again"] and not sb.sequences[2].ending
    sb.enqueue(step(2, 0, tag="more"), [inst], 0.3)  # the sequence goes on: no START needed
    assert sb.next_timer(0.3) is None  # no deadline is left to wake for
    assert sequencer(idle_us=2_500_000).idle_s == 2.5


def test_drop_client_forgets_its_queued_requests_but_not_the_sequence():
    sb, inst = sequencer(), instance(0)
    gone, stays = object(), object()
    a, b = step(1, START), step(2, START)
    a.client, b.client = gone, stays
    sb.enqueue(a, [inst], 0.0)
    sb.enqueue(b, [inst], 0.0)
    sb.drop_client(gone)
    assert sb.all() == [b] and 1 in sb.sequences


def test_a_dead_instance_loses_its_sequences_and_their_queued_requests():
    sb = sequencer(max_batch_size=1)
    a, b = instance(0), instance(1)
    sb.enqueue(step(1, START, tag="on-a"), [a, b], 0.0)
    sb.enqueue(step(2, START, tag="on-b"), [a, b], 0.0)
    sb.enqueue(step(3, START, tag="backlog"), [a, b], 0.0)
    lost = sb.forget_instance(a)
    assert ids(lost) == ["on-a"]
    assert set(sb.sequences) == {2, 3} and 0 not in sb.slots and sb.take_releases(a) == []
    with pytest.raises(InvalidRequest, match="START") as e:
        sb.enqueue(step(1), [b], 0.0)  # its state died with the instance: the client starts again
    assert str(e.value).endswith("of the sequence (the sequence was lost: the instance that held it exited)")
    sb.enqueue(step(1, START, tag="again"), [b], 0.1)  # begun again: a later refusal says no more of it
    with pytest.raises(InvalidRequest) as e:
        sb.enqueue(step(9), [b], 0.2)
    assert str(e.value).endswith("of the sequence")


# -- shapes ---------------------------------------------------------------------------------------


def shaped(corr, dims: list[int], flags: int = 0, arrived: float = 0.0, tag: str = "") -> Pending:
    p = step(corr, flags, arrived, tag=tag)
    p.entry["inputs"] = [{"name": "VALUE", "datatype": "FP32", "shape": [1, *dims]}]
    return p


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { max_candidate_sequences: 4 }"])
def test_a_batch_takes_only_requests_of_the_first_ones_shapes(strategy):
    """As Triton's sequence batcher enforces equal shapes: the backends concatenate a batch's
    inputs, so a sequence whose next request has other dims waits for the next batch."""
    sb, inst = sequencer(max_batch_size=4, strategy=strategy), instance(0)
    sb.enqueue(shaped(1, [3], START, 0.0, "a3"), [inst], 0.0)
    sb.enqueue(shaped(2, [5], START, 0.1, "b5"), [inst], 0.1)
    sb.enqueue(shaped(3, [3], START, 0.2, "c3"), [inst], 0.2)
    assert ids(sb.next_batch(inst, [inst], 10.0)) == ["a3", "c3"]
    assert ids(sb.next_batch(inst, [inst], 10.0)) == ["b5"]


def test_ragged_inputs_need_not_match():
    text = ('name: "seq" max_batch_size: 4 input [ { name: "VALUE" data_type: TYPE_FP32 dims: [ -1 ] '
            'allow_ragged_batch: true } ] sequence_batching { direct { } }')
    sb, inst = SequenceBatcher(parse_config_text(text, "seq")), instance(0)
    sb.enqueue(shaped(1, [3], START, tag="a3"), [inst], 0.0)
    sb.enqueue(shaped(2, [5], START, tag="b5"), [inst], 0.0)
    assert ids(sb.next_batch(inst, [inst], 0.0)) == ["a3", "b5"]
