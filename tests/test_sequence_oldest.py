"""The Oldest sequence batching strategy against a real server: its ``max_queue_delay_microseconds``
holds a candidate's request back to gather the other sequences' requests into one execution, up
to a ``preferred_batch_size`` (or ``max_batch_size``), and a lone request still runs once the
delay ends. The delays that must not end during a test are a minute long: which requests share an
execution follows from the order the test sends them in, not from how fast the host is."""
from __future__ import annotations

import concurrent.futures as cf
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import wait_pending

MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """TOTAL is the sequence's running sum (implicit state); BATCH is how many requests ran in
    the execution that answered this one."""

    def execute(self, requests):
        out = []
        for r in requests:
            total = pb_utils.get_input_tensor_by_name(r, "ACC_IN").as_numpy() + \\
                pb_utils.get_input_tensor_by_name(r, "VALUE").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("TOTAL", total.astype(np.int64)),
                pb_utils.Tensor("ACC_OUT", total.astype(np.int64)),
                pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32))]))
        return out
'''

CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "VALUE" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "TOTAL" data_type: TYPE_INT64 dims: [ 1 ] }}, {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 600000000
  oldest {{ max_candidate_sequences: 4 {oldest} }}
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT64 dims: [ 1 ] }} ]
}}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''

MINUTE_US = 60_000_000
MODELS = {
    # A preferred size of 2 ends the minute's wait as soon as two sequences have a request queued.
    "oldest_preferred": (4, f"preferred_batch_size: [ 2 ] max_queue_delay_microseconds: {MINUTE_US}"),
    # No preferred size: max_batch_size (2) ends it.
    "oldest_full": (2, f"max_queue_delay_microseconds: {MINUTE_US}"),
    # A short delay, which a lone request waits out.
    "oldest_short": (4, "max_queue_delay_microseconds: 200000"),
}


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("oldest")
    for name, (max_batch, oldest) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(CONFIG.format(name=name, max_batch=max_batch,
                                                                                oldest=oldest)))
        (repo / name / "1" / "model.py").write_text(MODEL)
    return module_factory.start([repo])


def send(url: str, model: str, seq: int, value: int, start: bool = False, end: bool = False) -> tuple[int, int]:
    """One step of sequence ``seq``: (its running total, the size of the execution it ran in)."""
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("VALUE", [1, 1], "INT64")
        x.set_data_from_numpy(np.array([[value]], np.int64))
        r = client.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end)
        return int(r.as_numpy("TOTAL")[0, 0]), int(r.as_numpy("BATCH")[0, 0])
    finally:
        client.close()


@pytest.mark.parametrize("model", ["oldest_preferred", "oldest_full"])
def test_two_sequences_requests_run_in_one_execution(server, model):
    expected_sum = 0
    with cf.ThreadPoolExecutor(2) as pool:
        for step, (value, start, end) in enumerate([(1, True, False), (10, False, False), (100, False, True)]):
            first = pool.submit(send, server.url, model, 1, value, start, end)
            # The first request is queued (and held by the delay) before the second is sent.
            wait_pending(server, model, 1)
            second = pool.submit(send, server.url, model, 2, 2 * value, start, end)
            expected_sum += value
            assert [first.result(), second.result()] == [(expected_sum, 2), (2 * expected_sum, 2)], f"step {step}"


def test_a_lone_request_runs_once_the_delay_ends(server):
    assert [send(server.url, "oldest_short", 5, v, start=v == 1, end=v == 3) for v in (1, 2, 3)] == \
        [(1, 1), (3, 1), (6, 1)]
