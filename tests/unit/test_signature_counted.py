"""``ModelSignature.check_inputs`` with ``counted_only`` (an ensemble's step request): a required
input missing passes while the count fits, as Triton's core counts it, and never lets the same
inputs from a client pass (they are refused for it, whichever came first)."""
from __future__ import annotations

import pytest

from shmserve.shm.descriptor import InputTensor
from shmserve.signature import InvalidRequest, ModelSignature

CONFIG = {"max_batch_size": 0, "input": [
    {"name": "A", "data_type": "TYPE_INT32", "dims": [4]},
    {"name": "B", "data_type": "TYPE_INT32", "dims": [4], "optional": True}]}
ONLY_B = [InputTensor("B", "INT32", [4], 16)]
MISSING_A = ("expected number of inputs between 1 and 2 but got 1 inputs for model 'optm'. Got input(s) ['B'], "
             "but missing required input(s) ['A']. Please provide all required input(s).")


@pytest.mark.parametrize("step_first", [True, False])
def test_a_step_request_is_counted_and_a_clients_is_checked_by_name(step_first):
    signature = ModelSignature("optm", CONFIG)
    if step_first:
        assert signature.check_inputs(ONLY_B, counted_only=True) == 1
    with pytest.raises(InvalidRequest) as e:
        signature.check_inputs(ONLY_B)
    assert str(e.value) == "[request id: <id_unknown>] " + MISSING_A
    assert signature.check_inputs(ONLY_B, counted_only=True) == 1


def test_too_few_inputs_are_refused_either_way():
    signature = ModelSignature("optm", CONFIG)
    for counted_only in (False, True):
        with pytest.raises(InvalidRequest) as e:
            signature.check_inputs([], counted_only=counted_only)
        assert "expected number of inputs between 1 and 2 but got 0 inputs" in str(e.value)
