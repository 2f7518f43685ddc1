"""Ragged batching's tensors on their own: the batch inputs of each kind and the scatter of a batch
output, for the shapes Triton's own batch input tests send (qa/L0_batch_input), with the values
and shapes Triton's backends give."""
from __future__ import annotations

import numpy as np
import pytest

from shmserve.workers.batch_io import BatchIO

KINDS = ["BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
         "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", "BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"]


def batch_io(data_type: str = "TYPE_FP32", max_batch_size: int = 8, output_dims: list[int] | None = None) -> BatchIO:
    return BatchIO({
        "max_batch_size": max_batch_size,
        "input": [{"name": "R", "dims": [-1], "allow_ragged_batch": True}, {"name": "M", "dims": [2]}],
        "output": [{"name": "O", "dims": output_dims or [-1]}, {"name": "P", "dims": [1]}],
        "batch_input": [{"kind": k, "target_name": [k.lower()], "data_type": data_type, "source_input": ["R"]}
                        for k in KINDS],
        "batch_output": [{"kind": "BATCH_SCATTER_WITH_INPUT_SHAPE", "target_name": ["O"], "source_input": ["R"]}]})


def requests(*shapes: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
    return [{"R": np.zeros(s, np.float32)} for s in shapes]


def test_element_counts_for_requests_of_2_4_1_and_3_elements():
    made = batch_io().batch_inputs(requests((1, 2), (1, 4), (1, 1), (1, 3)))
    assert made["batch_element_count"].tolist() == [2, 4, 1, 3]
    assert made["batch_accumulated_element_count"].tolist() == [2, 6, 7, 10]
    assert made["batch_accumulated_element_count_with_zero"].tolist() == [0, 2, 6, 7, 10]
    assert made["batch_max_element_count_as_shape"].shape == (4,)  # only its shape carries the value
    assert all(v.dtype == np.float32 for v in made.values())


def test_element_counts_include_the_batch_dimension_and_keep_int32():
    made = batch_io("TYPE_INT32").batch_inputs(requests((2, 3), (1, 5)))
    assert made["batch_element_count"].tolist() == [6, 5]
    assert made["batch_element_count"].dtype == np.int32


def test_item_shapes_have_a_row_per_batch_item():
    made = batch_io().batch_inputs(requests((2, 1, 2), (1, 1, 2), (1, 2, 2)))
    assert made["batch_item_shape"].tolist() == [[1, 2], [1, 2], [1, 2], [2, 2]]
    flat = batch_io().batch_inputs(requests((1, 4, 1), (1, 1, 2), (1, 1, 2), (1, 2, 2)))["batch_item_shape_flatten"]
    assert flat.tolist() == [4, 1, 1, 2, 1, 2, 2, 2]


def test_only_ragged_inputs_are_flattened():
    io = batch_io()
    assert [p.shape for p in io.parts("R", [np.zeros((1, 3)), np.zeros((1, 5))])] == [(3,), (5,)]
    assert [p.shape for p in io.parts("M", [np.zeros((1, 2)), np.zeros((2, 2))])] == [(1, 2), (2, 2)]
    assert io.targets == [k.lower() for k in KINDS]


def test_a_batch_output_is_scattered_with_each_requests_input_shape():
    pieces = batch_io().scatter("O", np.arange(10, dtype=np.float32), requests((1, 2), (1, 4), (1, 1), (1, 3)))
    assert [p.tolist() for p in pieces] == [[[0, 1]], [[2, 3, 4, 5]], [[6]], [[7, 8, 9]]]


def test_a_batch_output_keeps_its_fixed_dimensions():
    pieces = batch_io(output_dims=[-1, 2]).scatter("O", np.arange(12), requests((1, 2), (2, 1)))
    assert [p.shape for p in pieces] == [(1, 2, 2), (2, 1, 2)]


def test_a_batch_output_too_small_for_the_requests_is_an_error():
    with pytest.raises(ValueError, match="batch output 'O' has 3 elements"):
        batch_io().scatter("O", np.arange(3), requests((1, 2), (1, 4)))


def test_a_config_without_ragged_batching_leaves_batches_alone():
    io = BatchIO({"max_batch_size": 8, "input": [{"name": "X", "dims": [4]}], "output": [{"name": "Y", "dims": [4]}]})
    assert not io.ragged and not io.outputs and io.batch_inputs(requests((1, 4))) == {} and io.targets == []
    assert [p.shape for p in io.parts("X", [np.zeros((1, 4)), np.zeros((2, 4))])] == [(1, 4), (2, 4)]
