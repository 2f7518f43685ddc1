"""The broker's output arena grows as a worker's does (shm/extents.py): an ensemble's answer
larger than its first 64 MiB is served up to ``--broker-arena-mb``, and an answer a client keeps
pins only the extent it lies in, never every broker answer of every client."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from blob_models import infer, write_repo
from conftest import shm_entries
from shmserve import Client

MIB = 1 << 20


def _broker_extents(server_id: str) -> list[str]:
    return [n for n in shm_entries(server_id) if ".broker.0.arena." in n]


def test_an_ensemble_answer_past_the_brokers_first_extent_is_served_up_to_its_cap(server_factory, tmp_path):
    repo = write_repo(tmp_path / "repo")
    server = server_factory.start([repo], ["--broker-arena-mb", "256"]).wait_ready()
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    out = infer(client, "blob_ensemble", 1, 70 * MIB, 7)
    assert out.shape == (70 * MIB,) and (out == 7).all()
    assert len(_broker_extents(server.id)) == 1  # 128 MiB: twice the first
    assert (infer(client, "blob_ensemble", 1, 16, 8) == 8).all()

    capped = server_factory.start([repo], ["--broker-arena-mb", "128"]).wait_ready()
    client = httpclient.InferenceServerClient(capped.url, network_timeout=120)
    with pytest.raises(InferenceServerException) as e:
        infer(client, "blob_ensemble", 1, 70 * MIB, 7)
    assert e.value.status() == "500"  # it could never fit: no retry helps
    block = 70 * MIB + 192  # the answer's descriptor (with the sequence parameters) and its block header
    assert e.value.message() == (
        f"no room for the {block}-byte response of ensemble 'blob_ensemble': Failed to increase the shared "
        f"memory pool size of the broker for a {block}-byte response: larger than the cap of the "
        f"broker's output arena lets it ever hold, --broker-arena-mb=128: raise it")
    assert (infer(client, "blob_ensemble", 1, 16, 8) == 8).all()  # the next one is served
    assert not _broker_extents(capped.id)


def test_an_answer_a_local_client_keeps_does_not_stall_the_brokers_answers_to_others(server_factory, tmp_path):
    """Before, the one arena's head met the kept answer after 64 MiB had passed, and every answer
    the broker makes (ensembles', errors, control documents, readiness) was a 503 until it was
    let go."""
    server = server_factory.start([write_repo(tmp_path / "repo")]).wait_ready()
    local = Client(server.id)
    try:
        kept = local.infer("blob_ensemble", {"IN": np.array([5], dtype=np.uint8), "N": np.array([16], dtype=np.int64)})
        kept_out = kept["OUT"]  # a view of the answer in the broker's arena: the block stays held
        client = httpclient.InferenceServerClient(server.url, network_timeout=120)
        for i in range(40):  # 160 MiB of answers past it
            assert (infer(client, "blob_ensemble", 1, 4 * MIB, i) == i).all()
        assert client.is_server_ready()
        assert client.get_model_config("blob")["name"] == "blob"
        assert local.model_config("blob_ensemble")["name"] == "blob_ensemble"
        assert (kept_out == 5).all()  # untouched meanwhile
        assert _broker_extents(server.id)
    finally:
        local.close()
