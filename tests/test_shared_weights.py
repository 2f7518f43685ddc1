"""One copy of a CPU PyTorch model's weights for all its instances (workers/shared_weights.py):
the instances answer as with their own copies, the server's memory grows by less than the
weights per added instance, a model that writes into its weights changes only its own copy, and
the shared file goes with the version."""
from __future__ import annotations

import os

import pytest
import torch
import tritonclient.http as httpclient

from shmserve.shm.names import SHM_DIR
from shmserve.tools import weights_memory
from shmserve.workers import shared_weights

MB = 32


@pytest.fixture
def scripted(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.eval()
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    return path


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load
def test_instances_share_one_copy_and_writes_stay_private(scripted):
    sid, key = f"sw{os.getpid()}", "m.1.1"
    first, second = torch.jit.load(str(scripted)), torch.jit.load(str(scripted))
    x = torch.randn(3, 64)
    expected = first(x)
    try:
        size = shared_weights.share(first, sid, key)
        assert shared_weights.share(second, sid, key) == size > 0
        assert os.path.getsize(shared_weights.weights_path(sid, key)) == shared_weights.ALIGN + size
        assert torch.equal(first(x), expected) and torch.equal(second(x), expected)
        with torch.no_grad():
            next(first.parameters()).add_(1.0)  # copy-on-write: the other instance is untouched
        assert not torch.equal(first(x), expected) and torch.equal(second(x), expected)
    finally:
        for suffix in ("", ".lock"):
            path = shared_weights.weights_path(sid, key) + suffix
            if os.path.exists(path):
                os.unlink(path)


def test_a_second_instance_costs_less_than_the_weights():
    shared = weights_memory.measure(MB, 2, True)
    own = weights_memory.measure(MB, 2, False)
    assert shared["workers"] == own["workers"] == 2
    # Two own copies hold the weights twice; shared, once (give or take a few MB of heap).
    assert own["pss_mb"] - shared["pss_mb"] > MB * 0.6, (shared, own)


def test_the_shared_file_goes_with_the_version(server_factory, tmp_path):
    weights_memory.write_model(tmp_path, 4, 2, True)
    s = server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "weights"])
    files = [f for f in os.listdir(SHM_DIR) if f.startswith(f"shmserve.{s.id}.weights.")]
    assert any(not f.endswith(".lock") for f in files), files
    x = httpclient.InferInput("INPUT__0", [1024], "FP32")
    x.set_data_from_numpy(torch.ones(1024).numpy())
    assert s.client().infer("weights", [x]).as_numpy("OUTPUT__0").shape == (1024,)
    s.client().unload_model("weights")
    s.wait_until(lambda: not [f for f in os.listdir(SHM_DIR) if f.startswith(f"shmserve.{s.id}.weights.")],
                 "the shared weights removed")


def test_onnx_instances_share_weights_in_an_external_data_file():
    """SHARE_WEIGHTS "yes" turns onnxruntime's prepacking off: it then reads the weights from
    its mapping of the external data file, one copy in the page cache for every instance."""
    shared = weights_memory.measure(MB, 2, True, "onnx")
    own = weights_memory.measure(MB, 2, False, "onnx")
    assert shared["workers"] == own["workers"] == 2
    assert own["pss_mb"] - shared["pss_mb"] > MB * 0.6, (shared, own)
