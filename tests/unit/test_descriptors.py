"""Request descriptors a worker keeps by their bytes: the send time is cut off the bytes the
clients write (``Connection.prepared_prefix``), only descriptors whose meaning cannot change get
a plan, and a plan places a request exactly where the full check would have."""
from __future__ import annotations

import orjson
import pytest

from shmserve.shm.connection import Connection
from shmserve.workers.descriptors import LARGEST, SEND_TIME, Plan, plan_of, split_send_time

T = 1_234_567_890_123


def wire(doc: dict, sent_ns: int = T) -> bytes:
    """A descriptor as clients send it: prepared up to its send time, then the time and ``}``."""
    return b"%b%d}" % (Connection.prepared_prefix(doc), sent_ns)


# -- the send time ----------------------------------------------------------------------------


def test_the_send_time_is_split_off_what_clients_write():
    doc = {"model": "m", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": 0, "size": 12}]}
    raw = wire(doc)
    assert orjson.loads(raw)["t"] == T  # the bytes are the JSON the full way parses
    prefix, t = split_send_time(raw)
    assert t == T and prefix + SEND_TIME == Connection.prepared_prefix(doc)


def test_only_the_send_time_may_differ_between_requests_with_one_key():
    doc = {"model": "m", "id": "a", "inputs": []}
    assert split_send_time(wire(doc, 1))[0] == split_send_time(wire(doc, 99_999_999))[0]
    assert split_send_time(wire(doc))[0] != split_send_time(wire({**doc, "id": "b"}))[0]


@pytest.mark.parametrize("raw", [
    b'{"model":"m","inputs":[]}',  # no send time
    b'{"t":5,"model":"m"}',  # not last
    b'{"t":5}',  # nothing before it: not a descriptor the marker can cut
    b'{"model":"m","t":-5}',
    b'{"model":"m","t":5.0}',
    b'{"model":"m","t":"5"}',
    b'{"model":"m","t":5} ',  # anything after the closing brace
    b'{"model":"m","t":}',
    b'{"model":"m","t":' + b"1" * 20 + b"}",  # past 64 bits: the JSON parser says what is wrong
    b'{"model":"m","params":{"a":1,"t":5}}',  # a "t" inside a member, not the descriptor's
])
def test_anything_but_a_plain_trailing_send_time_takes_the_full_way(raw):
    assert split_send_time(raw) is None


def test_a_t_inside_a_string_is_escaped_and_never_taken_for_the_send_time():
    doc = {"model": "m", "id": 'x,"t":7', "inputs": []}
    prefix, t = split_send_time(wire(doc))
    assert t == T and prefix.endswith(b'"inputs":[]')


def test_the_largest_send_time_of_19_digits_is_taken_and_long_descriptors_are_not():
    assert split_send_time(b'{"a":1,"t":' + b"9" * 19 + b"}") == (b'{"a":1', int("9" * 19))
    padded = {"model": "m", "id": "x" * LARGEST, "inputs": []}
    assert split_send_time(wire(padded)) is None


# -- which descriptors get a plan ------------------------------------------------------------

CLIENT = "/shmserve.s.client.3"


def tensor(name: str, data: int, size: int, shape: list[int]) -> dict:
    return {"name": name, "datatype": "FP32", "shape": shape, "data": data, "size": size}


def located(t: dict, data_start: int) -> dict:
    """The full check's entry for a tensor in the client's block (worker ``_locate``)."""
    return {"name": t["name"], "seg": CLIENT, "off": data_start + t["data"], "size": t["size"],
            "datatype": t["datatype"], "shape": t["shape"]}


def block_request() -> tuple[dict, dict]:
    """A descriptor with tensors in the client's block, and the entry the full check made of it
    for data start 4096."""
    x, y = tensor("X", 0, 12, [1, 3]), tensor("Y", 64, 8, [1, 2])
    doc = {"model": "m", "id": "r", "params": {"p": 1}, "priority": 2, "timeout": 500,
           "inputs": [x, y], "outputs": [{"name": "OUT", "data": 128, "size": 16}, {"name": "CLS", "class": 3}],
           "t": T}
    entry = {"id": "r", "params": {"p": 1}, "corr": 0, "flags": 0,
             "inputs": [located(x, 4096), located(y, 4096)],
             "outputs": [{"name": "OUT", "seg": CLIENT, "off": 4096 + 128, "size": 16}, {"name": "CLS", "class": 3}]}
    return doc, entry


def test_a_plan_keeps_offsets_relative_to_the_data_start_and_the_queue_options():
    doc, entry = block_request()
    plan = plan_of(doc, entry, batch=1, priority=2, timeout_us=500, regions=7)
    assert isinstance(plan, Plan)
    assert (plan.batch, plan.priority, plan.timeout_us) == (1, 2, 500)
    assert plan.regions is None  # no region named: valid whatever the region table does
    assert (plan.low, plan.high) == (0, 144)  # the span its block's tensors cover
    assert plan.fields == {"id": "r", "params": {"p": 1}, "corr": 0, "flags": 0}


def test_placing_a_plan_at_another_data_start_gives_the_full_checks_entry_there():
    doc, entry = block_request()
    plan = plan_of(doc, entry, 1, 2, 500, None)
    placed: dict = {"client": CLIENT, "slot": 4}
    plan.place(placed, CLIENT, 8192)
    assert placed["inputs"] == [located(t, 8192) for t in doc["inputs"]]
    assert placed["outputs"] == [{"name": "OUT", "seg": CLIENT, "off": 8192 + 128, "size": 16},
                                 {"name": "CLS", "class": 3}]
    assert (placed["id"], placed["params"], placed["slot"]) == ("r", {"p": 1}, 4)


def test_each_placed_request_gets_its_own_parameters_and_region_tensors():
    """A backend may change what it is handed; the next request from the same plan must not see it."""
    region_in = {"name": "X", "datatype": "FP32", "shape": [1, 3], "region": "r0", "offset": 0, "size": 12}
    doc = {"model": "m", "params": {"p": 1}, "inputs": [region_in],
           "outputs": [{"name": "O", "region": "r0", "size": 4}]}
    resolved_in = {"name": "X", "seg": "/client-region", "ino": 11, "off": 0, "size": 12, "datatype": "FP32",
                   "shape": [1, 3]}
    resolved_out = {"name": "O", "seg": "/client-region", "ino": 11, "off": 64, "size": 4}
    entry = {"inputs": [resolved_in], "outputs": [resolved_out]}
    plan = plan_of(doc, entry, 1, 0, 0, regions=5)
    assert plan.regions == 5  # valid only while the region table is the one they were resolved against
    first: dict = {}
    plan.place(first, CLIENT, 0)
    first["params"]["p"] = 99
    first["inputs"][0]["off"] = 12345
    first["outputs"][0]["size"] = 0
    second: dict = {}
    plan.place(second, CLIENT, 0)
    assert second["params"] == {"p": 1}
    assert second["inputs"] == [resolved_in] and second["outputs"] == [resolved_out]


def test_a_descriptor_without_outputs_places_none():
    doc = {"model": "m", "inputs": [tensor("X", 0, 4, [1])]}
    entry = {"inputs": [located(doc["inputs"][0], 64)]}
    placed: dict = {}
    plan_of(doc, entry, 1, 0, 0, None).place(placed, CLIENT, 64)
    assert placed["outputs"] is None and placed["params"] is None and placed["inputs"] == entry["inputs"]


@pytest.mark.parametrize("change", [
    lambda d: d.update(stream=1024),  # streams: their response ring is per request
    lambda d: d.update(tr=1),  # traced requests
    lambda d: d.update(inputs=[]),
    lambda d: d["inputs"][0].update(region="r0"),  # both in the block and in a region
    lambda d: d["inputs"][0].pop("data"),  # in neither
    lambda d: d["inputs"][0].update(extra=1),
    lambda d: d["outputs"][0].pop("size"),  # placed output without a size
    lambda d: d["outputs"][1].update(size=4),  # a size without a place
    lambda d: d["outputs"][0].update(region="r0"),  # both places
    lambda d: d["outputs"][1].update(binary_data=True),
])
def test_descriptors_whose_meaning_may_change_get_no_plan(change):
    doc, entry = block_request()
    change(doc)
    assert plan_of(doc, entry, 1, 0, 0, 3) is None


def test_a_descriptor_naming_a_region_gets_no_plan_while_the_region_table_changed():
    doc, entry = block_request()
    doc["inputs"][0] = {**doc["inputs"][0], "region": "r0", "offset": 0}
    del doc["inputs"][0]["data"]
    assert plan_of(doc, entry, 1, 0, 0, regions=None) is None
    assert plan_of(doc, entry, 1, 0, 0, regions=2).regions == 2
