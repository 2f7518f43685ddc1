"""Loads with 'file:' contents run the uploaded code as the server's user: refused (HTTP 403, gRPC
PERMISSION_DENIED, a text naming --allow-model-file-uploads) unless the server enables them or the
request carries the key of the restricted model-repository group. A load with only a 'config'
stays allowed. (The enabled path: test_lifecycle.py, test_broker_restart.py, test_limits.py; a
model's own pb_utils.load_model with files, allowed without the flag: test_bls.py.)"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS

ADD_SUB_CODE = (PRODUCT_MODELS / "add_sub" / "1" / "model.py").read_bytes()
KEY_HEADER, KEY = "admin-key", "s3cret"
GRPC_KEY = {f"triton-grpc-protocol-{KEY_HEADER}": KEY}


def add_sub_config(name: str, count: int = 1) -> str:
    return json.dumps({
        "name": name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                  {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                   {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "instance_group": [{"count": count, "kind": "KIND_CPU"}]})


def marking_code(marker: Path) -> bytes:
    """add_sub's model, which also leaves ``marker`` when it is imported: proof that it ran."""
    return ADD_SUB_CODE + f"\nopen({str(marker)!r}, 'w').close()\n".encode()


def add_sub(url: str, model: str) -> list[int]:
    with httpclient.InferenceServerClient(url) as c:
        ins = []
        for name in ("INPUT0", "INPUT1"):
            t = httpclient.InferInput(name, [16], "INT32")
            t.set_data_from_numpy(np.arange(16, dtype=np.int32))
            ins.append(t)
        return c.infer(model, ins).as_numpy("OUTPUT0").tolist()


def upload_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("shmserve-model-*"))


def client_of(server, protocol: str):
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url)
    return grpcclient.InferenceServerClient(server.grpc_url)


@pytest.fixture(scope="module")
def open_server(module_factory):
    """Explicit control, no restrictions, uploads not enabled."""
    return module_factory.start([PRODUCT_MODELS], ["--model-control-mode=explicit", "--load-model", "add_sub"])


@pytest.fixture(scope="module")
def keyed_server(module_factory):
    """The model-repository group restricted on both protocols, uploads not enabled otherwise."""
    return module_factory.start([PRODUCT_MODELS], [
        "--model-control-mode=explicit", "--load-model", "add_sub",
        f"--http-restricted-api=model-repository:{KEY_HEADER}={KEY}",
        f"--grpc-restricted-protocol=model-repository:{KEY_HEADER}={KEY}"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_uploads_are_refused_unless_enabled(open_server, protocol, tmp_path):
    marker = tmp_path / "ran"
    before = upload_dirs()
    with client_of(open_server, protocol) as c:
        # A new model, and one that replaces the served add_sub: neither runs the code sent.
        for name in ("uploaded", "add_sub"):
            with pytest.raises(InferenceServerException) as e:
                c.load_model(name, config=add_sub_config(name), files={"file:1/model.py": marking_code(marker)})
            assert e.value.status() == ("403" if protocol == "http" else "StatusCode.PERMISSION_DENIED")
            assert f"failed to load '{name}'" in e.value.message()
            assert "--allow-model-file-uploads" in e.value.message()
        assert not c.is_model_ready("uploaded")
        assert c.is_model_ready("add_sub")
        # Loading with a config alone (no code sent) stays allowed.
        c.load_model("add_sub", config=add_sub_config("add_sub", count=2))
    assert not marker.exists(), "the uploaded code ran"
    assert upload_dirs() == before, "a refused upload left its folder"
    assert add_sub(open_server.url, "add_sub") == list(range(0, 32, 2))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_uploads_with_the_restricted_model_repository_key(keyed_server, protocol, tmp_path):
    marker = tmp_path / "ran"
    name = f"uploaded_{protocol}"
    key = {KEY_HEADER: KEY} if protocol == "http" else GRPC_KEY
    files = {"file:1/model.py": marking_code(marker)}
    with client_of(keyed_server, protocol) as c:
        with pytest.raises(InferenceServerException, match="restricted"):
            c.load_model(name, config=add_sub_config(name), files=files)  # no key: the restriction's refusal
        c.load_model(name, config=add_sub_config(name), files=files, headers=key)
        assert c.is_model_ready(name)
        assert marker.exists()
        assert add_sub(keyed_server.url, name) == list(range(0, 32, 2))
        c.unload_model(name, headers=key)
