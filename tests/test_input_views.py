"""Large inputs as private copy-on-write views (workers/input_views.py), against a real server.

A Python model gets views of its large inputs in shared arenas (a frontend's request block, a
local client's, another worker's output for an ensemble step) instead of copies; it may write
into them as into Triton's copies. These tests check that its writes reach nothing a client or
another model reads (an HTTP body, a system shared-memory region, an ensemble's input that a
later step reads again), above and below the size under which inputs are copied; that an input a
model keeps past ``execute`` keeps its bytes while the request blocks are reused and the client
rewrites or unregisters its region; and that a long run leaves the worker's mappings and memory
where they were.
"""
from __future__ import annotations

import itertools
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from conftest import raw_request, wait_until
from shmserve import Client
from shmserve.workers.input_views import VIEW_MIN_BYTES

SMALL = 1024  # FP32 elements: 4 KiB, copied
LARGE = 1 << 20  # 4 MiB, a view
assert SMALL * 4 < VIEW_MIN_BYTES <= LARGE * 4
STRIDE = 1 << 14  # the writer writes every 16384th element: one page in 16

# Writes into a few pages of its input in place (as Triton allows) and answers with it.
WRITER = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            owned = np.array([x.flags.owndata or x.base is None], np.int32)
            x[::%d] += 1
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x), pb_utils.Tensor("OWNED", owned)]))
        return out
''' % STRIDE

# Writes into all of its input: views cost it more than copies, so it gets copies after its first.
SCRIBBLER = WRITER.replace("x[::%d] += 1" % STRIDE, "x += 1")

# Keeps the first input it is given, as is, and answers every request with it.
KEEPER = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.first = None

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if self.first is None:
                self.first = x
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", self.first)]))
        return out
'''

# Keeps every input (a model that caches them): its mappings must stay bounded.
HOARDER = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            self.kept = self.kept[-20:] + [x]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", self.kept[0][:4])]))
        return out
'''

# Y and W in, Z = Y out: run after the step that wrote into its own Y.
PASS = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Z", pb_utils.get_input_tensor_by_name(r, "Y").as_numpy())])
                for r in requests]
'''

# X -> writer (Y = X + 1, in place) -> writer again on Y (W = Y + 1, in place) -> Z = Y, X again.
ENSEMBLE = '''
name: "write_chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "X_AGAIN" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "writer" input_map { key: "X" value: "X" } output_map { key: "Y" value: "y" } },
    { model_name: "writer" input_map { key: "X" value: "y" } output_map { key: "Y" value: "w" } },
    { model_name: "pass" input_map [ { key: "Y" value: "y" }, { key: "W" value: "w" } ] output_map { key: "Z" value: "Z" } },
    { model_name: "pass" input_map [ { key: "Y" value: "X" }, { key: "W" value: "w" } ] output_map { key: "Z" value: "X_AGAIN" } }
  ]
}
'''


def _io(name: str, dims: str = "-1", dtype: str = "TYPE_FP32") -> str:
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}'


def _model(repo: Path, name: str, source: str, inputs: list[str], outputs: list[str]) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\ninput [ {", ".join(inputs)} ]\n'
        f'output [ {", ".join(outputs)} ]\ninstance_group [ {{ count: 1 kind: KIND_CPU }} ]\n')


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("input_view_models")
    _model(repo, "writer", WRITER, [_io("X")], [_io("Y"), _io("OWNED", "1", "TYPE_INT32")])
    _model(repo, "scribbler", SCRIBBLER, [_io("X")], [_io("Y"), _io("OWNED", "1", "TYPE_INT32")])
    _model(repo, "keeper", KEEPER, [_io("X")], [_io("Y")])
    _model(repo, "hoarder", HOARDER, [_io("X")], [_io("Y")])
    _model(repo, "pass", PASS, [_io("Y"), _io("W")], [_io("Z")])
    (repo / "write_chain" / "1").mkdir(parents=True)
    (repo / "write_chain" / "config.pbtxt").write_text(ENSEMBLE)
    # A small frontend arena, so that a run of requests reuses its blocks soon.
    return module_factory.start([repo], ["--frontend-arena-mb", "32"])


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _written(x: np.ndarray) -> np.ndarray:
    """What the writer answers for ``x``."""
    y = x.copy()
    y[::STRIDE] += 1
    return y


def _infer(client, model: str, x: np.ndarray, outputs: list[str]) -> dict[str, np.ndarray]:
    inp = httpclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs])
    return {o: res.as_numpy(o) for o in outputs}


_keys = itertools.count()


class Region:
    """A system shared-memory region of this test, registered; unregistered and unlinked after."""

    def __init__(self, server, size: int) -> None:
        self.server = server
        n = next(_keys)
        self.name, self.key = f"iv_{n}", f"/iv_{server.id}_{n}"
        self.handle = shm.create_shared_memory_region(self.name, self.key, size, create_only=True)
        server.client().register_system_shared_memory(self.name, self.key, size)
        self.registered = True

    def write(self, arr: np.ndarray) -> None:
        shm.set_shared_memory_region(self.handle, [arr])

    def read(self, n: int) -> np.ndarray:
        return shm.get_contents_as_numpy(self.handle, np.float32, [n]).copy()

    def unregister(self) -> None:
        if self.registered:
            raw_request(self.server.port, "POST", f"/v2/systemsharedmemory/region/{self.name}/unregister")
            self.registered = False

    def close(self) -> None:
        self.unregister()
        shm.destroy_shared_memory_region(self.handle)


@pytest.fixture
def regions(server):
    made: list[Region] = []

    def make(size: int) -> Region:
        made.append(Region(server, size))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_model_writing_its_http_input_answers_from_its_own_view(server, n):
    """Over an HTTP binary body: a large input is a view (zero copy), a small one a copy, and
    either way each answer is its own input as the model wrote it, also once the frontend's arena
    has wrapped round (a page written for an earlier request never shows in a later one)."""
    client = server.client()
    runs = 12 if n == LARGE else 4  # 12 x 4 MiB wraps the 32 MiB arena
    for i in range(runs):
        x = _data(n, i)
        got = _infer(client, "writer", x, ["Y", "OWNED"])
        np.testing.assert_array_equal(got["Y"], _written(x))
        assert got["OWNED"].tolist() == [0 if n == LARGE else 1], "a large input is a view, a small one a copy"


def test_a_model_writing_all_of_its_inputs_gets_copies_after_its_first(server):
    client = server.client()
    owned = []
    for i in range(4):
        x = _data(LARGE, 50 + i)
        got = _infer(client, "scribbler", x, ["Y", "OWNED"])
        np.testing.assert_array_equal(got["Y"], x + 1)
        owned += got["OWNED"].tolist()
    assert owned == [0, 1, 1, 1]


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_model_writing_its_region_input_leaves_the_region_alone(server, regions, n):
    region = regions(n * 4)
    x = _data(n, 7)
    region.write(x)
    client = server.client()
    inp = httpclient.InferInput("X", [n], "FP32")
    inp.set_shared_memory(region.name, n * 4)
    res = client.infer("writer", [inp], outputs=[httpclient.InferRequestedOutput("Y", binary_data=True)])
    np.testing.assert_array_equal(res.as_numpy("Y"), _written(x))
    np.testing.assert_array_equal(region.read(n), x)  # the model wrote into its own bytes only


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_model_writing_its_input_leaves_a_local_clients_arena_alone(server, n):
    """Through the local client (inputs in its own arena), the same array again and again: each
    answer is it as written once, never written twice."""
    x = _data(n, 3)
    with Client(server.id) as c:
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("writer", {"X": x})["Y"], _written(x))


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_a_step_writing_its_input_leaves_it_alone_for_the_next_steps(server, n):
    """In an ensemble, two steps write into their inputs in place (the client's input, then the
    first step's output in its worker's arena); later steps that read the same tensors get them
    as they were made."""
    x = _data(n, 11)
    got = _infer(server.client(), "write_chain", x, ["Z", "X_AGAIN"])
    np.testing.assert_array_equal(got["Z"], _written(x))
    np.testing.assert_array_equal(got["X_AGAIN"], x)


def test_an_input_kept_past_execute_keeps_its_bytes(server):
    """The model keeps its first input (a view of the frontend's request block) and answers every
    later request with it: its bytes stay while later bodies reuse that block."""
    client = server.client()
    first = _data(LARGE, 100)
    np.testing.assert_array_equal(_infer(client, "keeper", first, ["Y"])["Y"], first)
    for i in range(12):  # 12 x 4 MiB: the 32 MiB arena wraps over the first block
        np.testing.assert_array_equal(_infer(client, "keeper", _data(LARGE, 101 + i), ["Y"])["Y"], first)


def test_a_region_input_kept_past_execute_is_the_models_own(module_factory, tmp_path, regions):
    """An input read from a region the client rewrites, then unregisters: the kept array is
    unchanged (inputs in registered regions are copies)."""
    repo = tmp_path / "repo"
    _model(repo, "keeper", KEEPER, [_io("X")], [_io("Y")])
    server = module_factory.start([repo])
    region = Region(server, LARGE * 4)
    try:
        first = _data(LARGE, 5)
        region.write(first)
        client = server.client()
        inp = httpclient.InferInput("X", [LARGE], "FP32")
        inp.set_shared_memory(region.name, LARGE * 4)
        out = [httpclient.InferRequestedOutput("Y", binary_data=True)]
        np.testing.assert_array_equal(client.infer("keeper", [inp], outputs=out).as_numpy("Y"), first)
        region.write(_data(LARGE, 6))
        np.testing.assert_array_equal(client.infer("keeper", [inp], outputs=out).as_numpy("Y"), first)
        region.unregister()
        np.testing.assert_array_equal(_infer(client, "keeper", _data(LARGE, 7), ["Y"])["Y"], first)
    finally:
        region.close()
        server.stop()


def _maps_and_rss(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return maps, rss_kb


@pytest.mark.parametrize("model", ["writer", "hoarder"])
def test_a_long_run_leaves_the_workers_mappings_and_memory_alone(server, model):
    """300 requests of 2 MiB (views), each written into (writer) or kept (hoarder, up to 21 at
    once): the worker's mappings and resident memory end where the first requests left them."""
    client = server.client()
    (pid,) = server.worker_pids(model)
    n = VIEW_MIN_BYTES // 4
    x = _data(n, 1)
    for _ in range(30):
        _infer(client, model, x, ["Y"])
    maps0, rss0 = _maps_and_rss(pid)
    for _ in range(300):
        _infer(client, model, x, ["Y"])
    maps1, rss1 = _maps_and_rss(pid)
    assert maps1 <= maps0 + 4, f"{maps0} mappings before, {maps1} after"
    assert rss1 <= rss0 + 16 * 1024, f"VmRSS {rss0} KiB before, {rss1} KiB after"


def _client_segments_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[5] for line in f if ".client." in line and len(line.split()) > 5}


def test_a_local_clients_private_mapping_goes_with_it(server):
    """A local client's arena, mapped privately for its large inputs, is unmapped from the worker
    once the client has gone, as the worker's shared mapping of it is."""
    (pid,) = server.worker_pids("writer")
    before = _client_segments_mapped(pid)
    x = _data(LARGE, 9)
    with Client(server.id) as c:
        np.testing.assert_array_equal(c.infer("writer", {"X": x})["Y"], _written(x))
        with open(f"/proc/{pid}/maps") as f:
            private = [line for line in f if ".client." in line and line.split()[1] == "rw-p"]
        assert private, "the local client's arena is not mapped privately"
    wait_until(lambda: _client_segments_mapped(pid) <= before, "the gone client's arena unmapped", 30)
