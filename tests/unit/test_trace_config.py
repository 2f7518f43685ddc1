"""``--trace-config`` as Triton 2.51 reads it at start (src/command_line_parser.cc): the level's
old names, and OpenTelemetry's resource and batch span processor settings, kept in the order
given with the processor's defaults after them (the settings API shows them so)."""
from __future__ import annotations

import pytest

from shmserve.shm.trace import otel_bsp, otel_resource, parse_config


@pytest.mark.parametrize("given,level", [("max", "TIMESTAMPS"), ("MIN", "TIMESTAMPS"), ("on", "TIMESTAMPS"),
                                         ("true", "TIMESTAMPS"), ("Timestamps", "TIMESTAMPS"), ("false", "OFF"),
                                         ("off", "OFF")])
def test_the_level_takes_tritons_names_ignoring_case(given, level):
    assert parse_config([f"level={given}"])["level"] == level


def test_opentelemetry_settings_keep_their_order_and_defaults_follow(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4096")
    got = parse_config(["mode=opentelemetry", "opentelemetry,resource=service.name=svc",
                        "opentelemetry,url=http://collector:4318/v1/traces", "opentelemetry,resource=team=ml",
                        "opentelemetry,bsp_schedule_delay=100"])
    assert got["url"] == "http://collector:4318/v1/traces"
    assert got["otel"] == [("resource", "service.name=svc"), ("url", "http://collector:4318/v1/traces"),
                           ("resource", "team=ml"), ("bsp_schedule_delay", "100"),
                           ("bsp_max_queue_size", "4096"), ("bsp_max_export_batch_size", "512")]
    assert otel_resource(got["otel"]) == {"service.name": "svc", "team": "ml"}
    assert otel_bsp(got["otel"]) == {"bsp_schedule_delay": 100, "bsp_max_queue_size": 4096,
                                     "bsp_max_export_batch_size": 512}


@pytest.mark.parametrize("item,needle", [
    ("opentelemetry,bsp_max_queue_size=0", "bsp_max_queue_size"),
    ("opentelemetry,bsp_max_queue_size=-5", "bsp_max_queue_size"),
    ("opentelemetry,resource=novalue", "<key>=<value>"),
    ("level=loud", "unknown trace level 'loud'"),
])
def test_bad_values_are_refused_by_name(item, needle):
    with pytest.raises(ValueError, match=needle):
        parse_config([item])


@pytest.mark.parametrize("env,value", [("OTEL_BSP_SCHEDULE_DELAY", "0"), ("OTEL_BSP_MAX_QUEUE_SIZE", "many"),
                                       ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "100000")])
def test_the_sdks_variables_matter_only_in_opentelemetry_mode(monkeypatch, env, value):
    """Triton reads OTEL_BSP_* only for mode=opentelemetry (ProcessOpenTelemetryBatchSpanProcessorArgs):
    a variable set for another program's SDK must not stop a server that traces to a file, or not
    at all, from starting; in OpenTelemetry mode it is refused by name."""
    monkeypatch.setenv(env, value)
    assert parse_config([])["otel"] == []
    assert parse_config(["level=TIMESTAMPS", "triton,file=/tmp/t.json"])["level"] == "TIMESTAMPS"
    with pytest.raises(ValueError, match="bsp_"):
        parse_config(["mode=opentelemetry"])
