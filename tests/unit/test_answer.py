"""The answer descriptor (shm/answer.py): every answer a producer writes reads back the same, and
bytes no producer writes (garbage, a block cut short) read as ``AnswerCorrupt``, never as another
exception or an output outside its block."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve.shm.answer import (ALIGN, DATATYPES, AnswerCorrupt, AnswerDescriptor, ErrorCode, OutputTensor, StepTrace,
                                 answer_room, decode_answer, refusal, write_answer)

names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
shapes = st.lists(st.integers(min_value=-1, max_value=1 << 40), max_size=8).map(tuple)
outputs = st.builds(OutputTensor, names, st.sampled_from(DATATYPES), shapes, st.integers(0, 4096),
                    st.integers(0, 4096), st.booleans())
json_values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | names,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
                           max_leaves=8)
answers = st.builds(AnswerDescriptor, st.lists(outputs, max_size=5).map(tuple), st.integers(0, (1 << 63) - 1),
                    st.none() | st.dictionaries(names, json_values, min_size=1, max_size=3),
                    st.none() | names, st.booleans(), st.lists(st.integers(0, 1 << 62), max_size=5).map(tuple),
                    st.booleans(), st.integers(0, (1 << 32) - 1), st.none() | json_values,
                    st.none()).map(lambda a: a._replace(code=ErrorCode.INVALID_ARG) if a.error is not None and
                                   a.version % 2 else a)  # a model's code, only with an error


@st.composite
def step_traces(draw) -> tuple[StepTrace, ...]:
    """A traced ensemble's steps: each parent is the request (-1) or an earlier step."""
    steps: list[StepTrace] = []
    for i in range(draw(st.integers(0, 4))):
        steps.append(StepTrace(draw(names), draw(st.integers(-1, (1 << 63) - 1)), draw(st.integers(-1, i - 1)),
                               tuple(draw(st.lists(st.integers(0, 1 << 62), min_size=7, max_size=7)))))
    return tuple(steps)


answers = st.tuples(answers, step_traces()).map(lambda pair: pair[0]._replace(steps=pair[1]))


def placed(answer: AnswerDescriptor, offset: int = 0) -> tuple[memoryview, int]:
    """``answer`` written at ``offset`` of a buffer with room for every output's bytes; (buffer, data start)."""
    raw = answer.encode()
    need = max([o.offset + o.size for o in answer.outputs if not o.in_region], default=0)
    buf = memoryview(bytearray(offset + answer_room(len(raw)) + need))
    return buf, write_answer(buf, offset, raw)


@settings(max_examples=300, deadline=None)
@given(answers, st.sampled_from([0, 64, 192]))
def test_every_answer_reads_back_as_written(answer, offset):
    buf, data = placed(answer, offset)
    got, start = decode_answer(buf, offset, len(buf))
    assert start == data and start % ALIGN == 0
    assert got == answer


def test_a_typical_answer_reads_back_with_its_tensor_bytes_after_it():
    outs = (OutputTensor("OUTPUT0", "INT32", (16,), 0, 64), OutputTensor("OUTPUT1", "INT32", (16,), 64, 64),
            OutputTensor("OUT_REGION", "FP32", (2, 3), 0, 24, True))
    answer = AnswerDescriptor(outs, 3, {"p": 1}, trace=(1, 2, 3, 4, 5))
    buf, data = placed(answer)
    buf[data:data + 128] = bytes(range(128))
    got, start = decode_answer(buf, 0, len(buf))
    assert got == answer and start == data
    assert bytes(buf[start + got.outputs[1].offset:start + 128]) == bytes(range(64, 128))


def test_errors_refusals_stream_ends_and_control_documents_are_answers():
    for answer in (refusal("no"), AnswerDescriptor(error="é" * 3), AnswerDescriptor(final=True, responses=7),
                   AnswerDescriptor(error="model says no", code=ErrorCode.UNKNOWN),
                   AnswerDescriptor.of_document({"ready": True}), AnswerDescriptor.of_document(["a", "b"]),
                   AnswerDescriptor.of_document({"error": "gone"})):
        buf, _ = placed(answer)
        assert decode_answer(buf, 0)[0] == answer
    assert refusal("no").refused and not AnswerDescriptor(error="x").refused
    assert AnswerDescriptor.of_document({"error": "gone"}).control_document() == {"error": "gone"}
    assert AnswerDescriptor.of_document({"error": "x", "more": 1}).error == "x"
    assert AnswerDescriptor.of_document([1]).control_document() == [1]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 64))
def test_garbage_reads_as_corrupt_and_nothing_else(junk, offset):
    buf = memoryview(bytearray(offset) + junk)
    try:
        answer, data = decode_answer(buf, offset, len(buf))
    except AnswerCorrupt:
        return
    for o in answer.outputs:  # whatever reads must still lie inside the block
        assert o.in_region or data + o.offset + o.size <= len(buf)


@settings(max_examples=300, deadline=None)
@given(answers, st.data())
def test_an_answer_cut_short_or_scribbled_on_reads_as_corrupt_or_in_bounds(answer, data):
    buf, start = placed(answer)
    raw = bytearray(buf)
    end = data.draw(st.integers(0, len(raw)))
    if raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    try:
        got, data_start = decode_answer(memoryview(raw), 0, end)
    except AnswerCorrupt:
        return
    for o in got.outputs:
        assert o.in_region or data_start + o.offset + o.size <= end


def test_an_output_past_its_block_is_refused_even_when_its_table_was_read_before():
    answer = AnswerDescriptor((OutputTensor("Y", "UINT8", (100,), 0, 100),))
    buf, data = placed(answer)
    decode_answer(buf, 0, len(buf))
    with pytest.raises(AnswerCorrupt):
        decode_answer(buf, 0, data + 99)  # the same table, in a block one byte short
    raw = bytearray(buf)
    struct.pack_into("<I", raw, 4, 2)  # the header claims two outputs; the table holds one
    with pytest.raises(AnswerCorrupt):
        decode_answer(memoryview(raw), 0)



def test_text_that_is_not_utf8_encodable_is_replaced_not_raised():
    """An error text or output name may carry lone surrogates (a file name decoded with
    surrogateescape): the worker must still answer."""
    answer = AnswerDescriptor((OutputTensor("out\udcff", "BYTES", (1,), 0, 5),), error="bad \udcff")
    buf, _ = placed(answer)
    got, _ = decode_answer(buf, 0)
    assert got.error == "bad ?" and got.outputs[0].name == "out?"


def test_a_step_trace_naming_no_earlier_parent_or_cut_short_is_corrupt():
    good = AnswerDescriptor(version=1, steps=(StepTrace("add_sub", 1, -1, (1,) * 7),
                                              StepTrace("inner", 1, 0, (2,) * 7)))
    buf, _ = placed(good)
    got, _ = decode_answer(buf, 0)
    assert got.steps == good.steps
    for bad in (good._replace(steps=(StepTrace("a", 1, 0, (1,) * 7),)),  # its own index: not earlier
                good._replace(steps=(StepTrace("a", 1, -2, (1,) * 7),))):
        buf, _ = placed(bad)
        with pytest.raises(AnswerCorrupt, match="step trace"):
            decode_answer(buf, 0)
