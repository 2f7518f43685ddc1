"""Serving functions from one script (shmserve.bind): the script run as users run it
(``python app.py``), reached with tritonclient over HTTP and gRPC and with the local client;
batching, streaming, a class with setup, a repository's model beside the script's, hot reload of
the script, and a clean stop."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS, PYTHON, READY_TIMEOUT_S, ROOT, free_ports, new_server_id, shm_entries
from shmserve import Client

APP = '''
import numpy as np
import shmserve

FACTOR = 2.0


@shmserve.model(inputs={"x": (np.float32, [-1])}, outputs={"y": (np.float32, [-1])},
                max_batch_size=16, max_queue_delay_us=20000, instances=1)
def scale(x):
    return {"y": x * FACTOR}


@shmserve.model(inputs={"text": (bytes, [1])}, outputs={"word": (bytes, [1])})
def words(text):
    for word in text[0].split():
        yield {"word": np.array([word], dtype=object)}


@shmserve.model(inputs={"a": (np.int64, [3])}, outputs={"total": (np.int64, [1])}, name="summer")
class Summer:
    def setup(self):
        self.offset = 100 if self.device == "cpu" else 0

    def __call__(self, a):
        return np.array([a.sum() + self.offset])


@shmserve.model(inputs={"mode": (np.int32, [1])}, outputs={"y": (np.float32, [2]), "n": (np.int32, [1])},
                name="wrong")
def wrong(mode):
    good = {"y": np.zeros(2, np.float32), "n": np.array([1], np.int32)}
    return [good, {**good, "z": np.zeros(1)}, {"y": good["y"]}, {**good, "y": np.array(["a", "b"])},
            {**good, "y": np.zeros(3, np.float32)}, {**good, "n": np.array([1.5])}][int(mode[0])]


if __name__ == "__main__":
    shmserve.serve(repositories=[@REPO@], reload=True, http_port=@HTTP@, grpc_port=@GRPC@,
                   metrics_port=@METRICS@, id=@SID@, http_address="127.0.0.1", grpc_address="127.0.0.1")
'''


class App:
    """The script, run as ``python app.py`` in a session of its own."""

    def __init__(self, folder: Path) -> None:
        self.sid = new_server_id()
        self.http, self.grpc, self.metrics = free_ports(3)
        self.script = folder / "app.py"
        text = APP
        for key, value in (("@REPO@", repr(str(PRODUCT_MODELS))), ("@HTTP@", self.http), ("@GRPC@", self.grpc),
                           ("@METRICS@", self.metrics), ("@SID@", repr(self.sid))):
            text = text.replace(key, str(value))
        self.script.write_text(text)
        self.log = open(folder / "app.log", "wb")
        self.proc = subprocess.Popen([PYTHON, str(self.script)], cwd=folder, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> httpclient.InferenceServerClient:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{self.http}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if client.is_server_ready():
                    return client
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < deadline, "the app did not get ready"
            time.sleep(0.1)

    def generated_repositories(self) -> list[Path]:
        tmp = Path(tempfile.gettempdir())
        return [p for p in tmp.glob("shmserve-app-*")
                if (p / "scale" / "1" / "script_app.py").resolve() == self.script.resolve()]

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.log.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = App(tmp_path_factory.mktemp("app"))
    a.wait_ready()
    yield a
    assert a.generated_repositories()  # the repository serve() wrote for the script
    assert a.stop() == 0
    assert shm_entries(a.sid) == []
    assert a.generated_repositories() == []  # and removed at exit


def scale_input(values: list[float]) -> httpclient.InferInput:
    x = httpclient.InferInput("x", [1, len(values)], "FP32")
    x.set_data_from_numpy(np.array([values], dtype=np.float32))
    return x


def test_a_batched_function_over_http_batches_concurrent_requests(app):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http}", concurrency=8)
    assert client.infer("scale", [scale_input([1, 2, 3])]).as_numpy("y").tolist() == [[2, 4, 6]]
    before = client.get_inference_statistics("scale")["model_stats"][0]
    pending = [client.async_infer("scale", [scale_input([float(i)] * 3)]) for i in range(8)]
    results = [p.get_result().as_numpy("y").tolist() for p in pending]
    assert results == [[[2.0 * i] * 3] for i in range(8)]  # each request gets its own rows back
    after = client.get_inference_statistics("scale")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 8
    assert after["execution_count"] - before["execution_count"] < 8  # some requests ran together


def test_grpc_and_the_local_client_reach_the_same_models(app):
    with grpcclient.InferenceServerClient(f"127.0.0.1:{app.grpc}") as g:
        a = grpcclient.InferInput("a", [3], "INT64")
        a.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int64))
        assert g.infer("summer", [a]).as_numpy("total").tolist() == [106]  # setup() ran: offset 100
    with Client(app.sid) as local:
        assert local.infer("summer", {"a": np.array([1, 1, 1], dtype=np.int64)})["total"].tolist() == [103]
        assert local.infer("add_sub", {"INPUT0": np.ones(16, np.int32),  # the repository's model beside
                                       "INPUT1": np.ones(16, np.int32)})["OUTPUT0"].tolist() == [2] * 16


def test_a_generator_streams(app):
    with Client(app.sid) as local:
        words = [r["word"][0] for r in local.stream("words", {"text": np.array([b"one two three"], dtype=object)})]
    assert words == [b"one", b"two", b"three"]


def test_an_edit_of_the_script_reloads_its_models(app):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http}")
    app.script.write_text(app.script.read_text().replace("FACTOR = 2.0", "FACTOR = 3.0"))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while client.infer("scale", [scale_input([1, 1, 1])]).as_numpy("y").tolist() != [[3, 3, 3]]:
        assert time.monotonic() < deadline, "the edit was not picked up"
        time.sleep(0.2)


def test_a_script_that_declares_nothing_says_so(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text("import shmserve\nshmserve.serve()\n")
    run = subprocess.run([PYTHON, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no model is declared" in run.stderr


@pytest.mark.parametrize("mode, error", [
    (1, "model 'wrong' returned output(s) ['z'] it does not declare (declared: ['y', 'n'])"),
    (2, "model 'wrong' did not return its declared output(s) ['n']"),
    (3, "model 'wrong' returned output 'y' as <U1, which does not convert to the declared float32"),
    (4, "model 'wrong' returned output 'y' with shape [3], but declared [2]"),
    (5, "model 'wrong' returned output 'n' as float64, which does not convert to the declared int32"),
])
def test_outputs_other_than_declared_are_an_error_naming_them(app, mode, error):
    """Not a 200 without the output: the client hears which output was wrong and how."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http}")
    m = httpclient.InferInput("mode", [1], "INT32")
    m.set_data_from_numpy(np.array([mode], dtype=np.int32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("wrong", [m])
    assert error in e.value.message()
    m.set_data_from_numpy(np.array([0], dtype=np.int32))
    result = client.infer("wrong", [m])
    np.testing.assert_array_equal(result.as_numpy("y"), np.zeros(2, np.float32))
    np.testing.assert_array_equal(result.as_numpy("n"), np.array([1], np.int32))


def test_a_batched_function_must_answer_every_row_of_its_batch():
    """The outputs of a batched function keep the batch as their first dimension."""
    from shmserve.bind import Declaration, TensorSpec
    from shmserve.bound_model import OutputError, checked_outputs

    declared = Declaration("b", None, [], [TensorSpec("y", "TYPE_FP32", (-1,))], max_batch_size=8)
    assert checked_outputs(declared, {"y": np.zeros((3, 5))}, 3)["y"].dtype == np.float32
    with pytest.raises(OutputError, match=r"output 'y' with shape \[2, 5\] for a batch of 3"):
        checked_outputs(declared, {"y": np.zeros((2, 5))}, 3)
