"""BLS: Python models calling other models from inside execute(), synchronously and with
async_exec, through a real server."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([Path(__file__).parent / "models" / "bls", ROOT / "model_repository"])


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list:
    out = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_bls_exec_calls_another_model(server):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 3, np.int32)
    result = server.client().infer("add_sub_bls", add_sub_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (a + b) * (a - b))


def test_bls_under_concurrency_keeps_requests_apart(server):
    def one(k: int) -> bool:
        a = np.full(16, k, np.int32)
        b = np.arange(16, dtype=np.int32)
        c = httpclient.InferenceServerClient(server.url)
        try:
            out = c.infer("add_sub_bls", add_sub_inputs(a, b)).as_numpy("OUTPUT0")
        finally:
            c.close()
        return bool(np.array_equal(out, (a + b) * (a - b)))

    with cf.ThreadPoolExecutor(6) as pool:
        assert all(pool.map(one, range(30)))


def test_async_exec_gathers_and_reports_errors(server):
    a = np.arange(16, dtype=np.int32)
    b = np.ones(16, np.int32)
    result = server.client().infer("bls_async", add_sub_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    assert "Request for unknown model: 'no_such_model' is not found" in result.as_numpy("ERROR")[0].decode()
