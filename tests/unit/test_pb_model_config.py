"""pb_utils.ModelConfig's refusals in auto_complete_config, in Triton 2.51's words (compared side
by side on the reference server)."""
from __future__ import annotations

import pytest

from shmserve.workers.python_backend.pb_utils.model_config import ModelConfig


def test_a_smaller_max_batch_size_and_an_unknown_property_are_refused_in_tritons_words():
    config = ModelConfig({"name": "m", "max_batch_size": 4, "input": [], "output": []})
    with pytest.raises(ValueError) as e:
        config.set_max_batch_size(2)
    assert str(e.value) == ("configuration specified max_batch_size 4, but in auto-complete-config function for "
                            "model 'm' specified max_batch_size 2")
    with pytest.raises(ValueError) as e:
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1], "foo": 1})
    assert str(e.value) == ("input 'X' in auto-complete-config function for model 'm' contains property other "
                            "than 'name', 'data_type', 'dims' and 'optional'.")
