"""pb_utils.Tensor takes a name as Triton's binding does: a str, or bytes (a std::string there:
names read from a BYTES input or a config arrive as bytes); and the module holds what Triton's
exposes beside its API (``pb_utils.np`` and friends, which models reach through it)."""
from __future__ import annotations

import numpy as np
import pytest

from shmserve.workers.python_backend import pb_utils


def test_a_tensor_named_with_bytes_is_named_with_its_text():
    assert pb_utils.Tensor(b"Y", np.ones(1, np.float32)).name() == "Y"
    assert pb_utils.Tensor.from_dlpack(b"Z", np.arange(3, dtype=np.float32)).name() == "Z"
    with pytest.raises(TypeError):
        pb_utils.Tensor(7, np.ones(1, np.float32))
    with pytest.raises(pb_utils.TritonModelException, match="Tensor name cannot be an empty string."):
        pb_utils.Tensor(b"", np.ones(1, np.float32))


def test_the_module_carries_the_modules_triton_imports_at_its_top():
    import json
    import struct

    assert pb_utils.np is np and pb_utils.json is json and pb_utils.struct is struct
