"""The request descriptor (shm/descriptor.py): what is encoded decodes the same, and bytes no
client would write, anywhere in a block, are a DescriptorError and nothing else."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from shmserve.shm.descriptor import DATATYPES, DescriptorError, InferRequest, InputTensor, RequestedOutput, decode, \
    stamp_sent

U64 = st.integers(0, (1 << 64) - 1)
TEXT = st.text(max_size=12)
SHAPES = st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=6)

inputs = st.builds(InputTensor, TEXT, st.sampled_from(DATATYPES), SHAPES, U64, U64, st.just(""), st.just(0)) | \
    st.builds(InputTensor, TEXT, st.sampled_from(DATATYPES), SHAPES, U64, st.just(0), TEXT.filter(bool), U64)
outputs = st.builds(RequestedOutput, TEXT, st.integers(0, (1 << 32) - 1)) | \
    st.builds(RequestedOutput, TEXT, st.integers(0, (1 << 32) - 1), TEXT.filter(bool), U64, U64) | \
    st.builds(RequestedOutput, TEXT, st.integers(0, (1 << 32) - 1), st.just(""), st.just(0), U64, U64)
params = st.none() | st.dictionaries(TEXT, st.booleans() | st.integers(-5, 5) | TEXT, min_size=1, max_size=3)
requests = st.builds(InferRequest, TEXT, TEXT, st.lists(inputs, max_size=4), st.none() | st.lists(outputs, max_size=3),
                     TEXT, params, U64 | TEXT, st.integers(0, (1 << 32) - 1), U64, U64, U64, st.booleans(),
                     st.none() | U64)


def roundtrip(req: InferRequest, pad: bytes = b"") -> InferRequest:
    raw = b"\xee" * 5 + req.encode() + pad  # not at offset 0, with bytes after the block
    return decode(memoryview(raw), 5, len(raw) - len(pad))


@settings(max_examples=300, deadline=None)
@given(requests)
def test_what_is_encoded_decodes_the_same(req):
    back = roundtrip(req, b"\x01" * 7)
    if req.sequence_id == "":
        back.sequence_id = ""  # (an empty text id reads as text again)
    assert back == req


def test_an_add_sub_request_and_its_send_time():
    req = InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [16], 64, 0),
                                       InputTensor("INPUT1", "INT32", [16], 64, 64)],
                       [RequestedOutput("OUTPUT0"), RequestedOutput("OUTPUT1", 3)], sequence_id="seq-é",
                       parameters={"k": 1})
    raw = bytearray(req.encode())
    stamp_sent(memoryview(raw), 0, 123456789)  # a reserved request is stamped when it is sent
    req.sent_ns = 123456789
    assert decode(memoryview(raw), 0, len(raw)) == req


@pytest.mark.parametrize("bad", [{"priority": -1}, {"timeout_us": 1 << 64}, {"sent_ns": 1.5},
                                 {"sequence_id": [1]}, {"sequence_flags": -1},
                                 {"inputs": [InputTensor("X", "FP8", [1], 1)]},
                                 {"inputs": [InputTensor("X", "FP32", [1 << 63], 4)]}])
def test_what_the_layout_cannot_hold_is_a_value_error(bad):
    with pytest.raises(ValueError, match="cannot be encoded"):
        InferRequest("m", **bad).encode()


@settings(max_examples=500, deadline=None)
@given(requests, st.data())
def test_any_change_of_the_bytes_decodes_or_is_a_descriptor_error(req, data):
    raw = bytearray(req.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))  # truncated, or whole
    try:
        decode(memoryview(raw), 0, cut)
    except DescriptorError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_are_a_descriptor_error_or_a_request(raw):
    try:
        assert isinstance(decode(memoryview(raw), 0, len(raw)), InferRequest)
    except DescriptorError:
        pass


BASE = InferRequest("m", "", [InputTensor("X", "INT32", [2, 3], 24, 0)], [RequestedOutput("Y")]).encode()


def overwrite(offset: int, fmt: str, value: int) -> bytes:
    raw = bytearray(BASE)
    struct.pack_into(fmt, raw, offset, value)
    return bytes(raw)


@pytest.mark.parametrize("raw,needle", [
    (BASE[:40], "cannot hold its header"),
    (overwrite(0, "<I", 0x7B22), "magic"),
    (overwrite(4, "<I", 1 << 9), "option bits"),
    (overwrite(12, "<I", 1 << 31), "past its block"),  # an input count of 2^31
    (overwrite(16, "<I", 0xFFFFFFFF), "past its block"),
    (overwrite(20, "<I", 1 << 30), "past its block"),  # dimensions
    (overwrite(84, "<I", 1 << 32 - 1), "past its block"),  # text past the block
    (overwrite(64, "<I", 1 << 20), "past its text"),  # a string past its text
    (overwrite(88 + 8, "<B", 200), "datatype code"),
    (overwrite(88 + 9, "<B", 255), "dimensions"),  # a rank past the dimensions there are
    (overwrite(88, "<I", 1 << 30), "bytes of text"),  # a name past the text
    (BASE[:-1], "past its block"),  # truncated
])
def test_malformed_descriptors_say_what_is_wrong(raw, needle):
    with pytest.raises(DescriptorError, match=needle):
        decode(memoryview(raw), 0, len(raw))


def test_bad_utf8_and_parameters_that_are_not_an_object():
    raw = InferRequest("m\xe9", "").encode()
    bad = raw.replace("m\xe9".encode(), b"m\xff")
    with pytest.raises(DescriptorError):
        decode(memoryview(bad), 0, len(bad))
    raw = InferRequest("m", parameters={"a": 1}).encode().replace(b'{"a":1}', b'[1,2,3]')
    with pytest.raises(DescriptorError, match="not a JSON object"):
        decode(memoryview(raw), 0, len(raw))


def test_a_request_of_many_tensors_round_trips():
    """Past the counts whose layouts are compiled once (8 inputs, 8 outputs, 32 dimensions)."""
    req = InferRequest("m", "2", [InputTensor(f"in{i}", "FP32", [1, 2, 3, 4, 5], 480, i * 480) for i in range(10)],
                       [RequestedOutput(f"out{i}", size=4, data=i) for i in range(9)], sequence_id=7)
    assert roundtrip(req) == req
    raw = bytearray(req.encode())
    struct.pack_into("<B", raw, 88 + 8, 99)  # the first input's datatype code
    with pytest.raises(DescriptorError, match="datatype code"):
        decode(memoryview(raw), 0, len(raw))
