"""Implicit state's ``initial_state`` as the worker reads it from the completed config: zeros or a
file's bytes, with Triton's checks failing the load."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shmserve.config_view import to_dict
from shmserve.server.broker.config import parse_config_text
from shmserve.shm.tensors import serialize_bytes
from shmserve.workers.sequence import SequenceSupport


def support(state: str, model_dir: Path, max_batch_size: int = 0) -> SequenceSupport:
    text = f'name: "m" max_batch_size: {max_batch_size} sequence_batching {{ state [ {{ {state} }} ] }}'
    return SequenceSupport(to_dict(parse_config_text(text, "m")), model_dir)


def first_state(s: SequenceSupport) -> np.ndarray:
    inputs: dict[str, np.ndarray] = {}
    s.augment(inputs, 1, 1)
    return inputs["IN"]


STATE = 'input_name: "IN" output_name: "OUT" data_type: {dtype} dims: [ -1, 2 ] '


def test_zero_data_has_the_initial_states_dims(tmp_path):
    s = support(STATE.format(dtype="TYPE_INT32") + 'initial_state { data_type: TYPE_INT32 dims: [ 3, 2 ] '
                'zero_data: true name: "z" }', tmp_path, max_batch_size=4)
    np.testing.assert_array_equal(first_state(s), np.zeros((1, 3, 2), np.int32))


def test_data_file_is_read_from_the_models_initial_state_folder(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "f.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    s = support(STATE.format(dtype="TYPE_FP32") + 'initial_state { data_type: TYPE_FP32 dims: [ 2, 2 ] '
                'data_file: "f.bin" name: "f" }', tmp_path)
    np.testing.assert_array_equal(first_state(s), np.arange(4, dtype=np.float32).reshape(2, 2))


def test_string_state_from_a_file(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "s.bin").write_bytes(serialize_bytes(np.array([b"a", b"", b"xyz", b"q"], object)))
    s = support(STATE.format(dtype="TYPE_STRING") + 'initial_state { data_type: TYPE_STRING dims: [ 2, 2 ] '
                'data_file: "s.bin" name: "s" }', tmp_path)
    assert first_state(s).tolist() == [[b"a", b""], [b"xyz", b"q"]]


@pytest.mark.parametrize("init,message", [
    ('data_type: TYPE_INT64 dims: [ 1, 2 ] zero_data: true name: "x"', "does not match the state data type"),
    ('data_type: TYPE_INT32 dims: [ 1, 2 ] zero_data: true', "Field 'name' must be set"),
    ('data_type: TYPE_INT32 dims: [ 2 ] zero_data: true name: "x"', "Number of dimensions in 'initial_state'"),
    ('data_type: TYPE_INT32 dims: [ -1, 2 ] zero_data: true name: "x"', "contains variable dimensions"),
    ('data_type: TYPE_INT32 dims: [ 1, 3 ] zero_data: true name: "x"', "doesn't match 'state' dim description. 3 != 2"),
])
def test_a_broken_initial_state_is_refused_with_tritons_message(tmp_path, init, message):
    with pytest.raises(ValueError, match=message):
        support(STATE.format(dtype="TYPE_INT32") + f"initial_state {{ {init} }}", tmp_path)
