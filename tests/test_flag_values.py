"""Flag values as ``tritonserver`` 2.51 reads them (its src/command_line_parser.cc): what Triton
takes starts the server here too, what it refuses is refused, in its words, also for the flags
that do nothing here (server/triton_values.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

TRITON_TAKES_BUT_DOES_NOT_ACT_ON = "has no effect"


def _refusal(repo: Path, capsys: pytest.CaptureFixture, *args: str) -> str:
    """The one-line error the command line prints for ``args`` (exit code 2), parsed in this
    process: a value wrongly taken starts no server."""
    from shmserve.server.cli import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(["--model-repository", str(repo), *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2, (exit.value.code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmserve: error: "), err
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (["--http-thread-count=abc"], "argument --http-thread-count: Invalid option value. Got abc"),
    (["--http-thread-count=99999999999"],
     "argument --http-thread-count: Provided option value is out of bound. Got 99999999999"),
    (["--grpc-infer-allocation-pool-size=x"], "argument --grpc-infer-allocation-pool-size: Invalid option value"),
    (["--buffer-manager-thread-count", "many"], "Invalid option value. Got many"),
    (["--pinned-memory-pool-byte-size=abc"], "argument --pinned-memory-pool-byte-size: Invalid option value"),
    (["--enable-peer-access=maybe"], "argument --enable-peer-access: invalid value for bool option: maybe"),
    (["--host-policy=foo"], "--host-policy option format is '<policy name>,<setting>=<value>'. Got foo"),
    (["--host-policy=numa0,cpu-cores="], "--host-policy option format is '<policy name>,<setting>=<value>'"),
    (["--cuda-memory-pool-byte-size=abc"], "argument --cuda-memory-pool-byte-size: Cannot parse pair option due "
                                           "to incorrect number of inputs.--<pair option> argument requires format "
                                           "<first>:<second>. Found: abc"),
    (["--cuda-memory-pool-byte-size=0:lots"], "argument --cuda-memory-pool-byte-size: Invalid option value. Got lots"),
    (["--min-supported-compute-capability=x"], "argument --min-supported-compute-capability: Invalid option value"),
    (["--model-load-gpu-limit=0:half"], "argument --model-load-gpu-limit: Invalid option value. Got half"),
    (["--sagemaker-safe-port-range=8080"], "requires format <first>-<second>. Found: 8080"),
    (["--backend-config=,shm-default-byte-size=65536"],
     "No backend specified. --backend-config option format is <backend name>,<setting>=<value> or "
     "<setting>=<value>. Got ,shm-default-byte-size=65536"),
    (["--backend-config=python,shm-default-byte-size="],
     "--backend-config option format is '<backend name>,<setting>=<value>'. Got python,shm-default-byte-size="),
    (["--model-config-name="], "empty argument for --model-config-name"),
    (["--trace-config=triton,file="],
     "--trace-config option format is '<trace mode>,<setting>=<value>'. Got triton,file="),
    (["--trace-config=level"], "--trace-config option format is '<trace mode>,<setting>=<value>'. Got level"),
    (["--trace-config=,level=TIMESTAMPS"], "No trace mode specified. --trace-config option format is <trace mode>,"
                                           "<setting>=<value> or <setting>=<value>. Got ,level=TIMESTAMPS"),
    (["--metrics-config=summary_latencies"], "--metrics-config option format is <setting>=<value>. Got "
                                             "summary_latencies"),
    (["--metrics-config=x,summary_latencies=true"], "--metrics-config option format is <setting>=<value>. Got "
                                                    "x,summary_latencies=true"),
    (["--log-verbose=yes"], "argument --log-verbose: Invalid option value. Got yes"),
    # the deprecated trace flags: only an empty --trace-file is taken (no file)
    (["--trace-level="], "argument --trace-level: invalid value for trace level option:"),
    (["--trace-level=loud"], "argument --trace-level: invalid value for trace level option: loud"),
    (["--trace-rate="], "argument --trace-rate: Invalid option value. Got"),
    (["--trace-count="], "argument --trace-count: Invalid option value. Got"),
    (["--trace-log-frequency=often"], "argument --trace-log-frequency: Invalid option value. Got often"),
    (["--model-control-mode=sometimes"], "invalid argument for --model-control-mode: 'sometimes'"),
    (["--load-model=x", "--model-control-mode=poll"],
     "Use of '--load-model' requires setting '--model-control-mode=explicit' as well."),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_value_triton_refuses_is_refused_in_its_words(tmp_path, capsys, args, needle):
    line = _refusal(tmp_path, capsys, *args)
    assert needle in line, (needle, line)


def test_values_triton_takes_are_taken(tmp_path):
    """``--log-verbose=true`` (Triton's 1), a control mode in capitals, and each value of a
    repeated flag that does nothing here named in its own warning."""
    from shmserve.server.cli import parse_args

    args = parse_args(["--model-repository", str(tmp_path), "--log-verbose=TRUE", "--model-control-mode=EXPLICIT",
                       "--load-model=m", "--host-policy=numa0,cpu-cores=0-1", "--host-policy=numa1,cpu-cores=2-3",
                       "--cuda-memory-pool-byte-size=0:1024", "--cuda-memory-pool-byte-size=1:2048"])
    assert (args.log_verbose, args.model_control_mode, args.load_model) == (1, "explicit", ["m"])
    named = [line for _, line in args.notices]
    for value in ("--host-policy numa0,cpu-cores=0-1", "--host-policy numa1,cpu-cores=2-3",
                  "--cuda-memory-pool-byte-size 0:1024", "--cuda-memory-pool-byte-size 1:2048"):
        assert any(line.startswith(f"{value} {TRITON_TAKES_BUT_DOES_NOT_ACT_ON}") for line in named), (value, named)
    assert parse_args(["--model-repository", str(tmp_path), "--log-verbose=false"]).log_verbose == 0
    # an empty deprecated --trace-file is no file, as in Triton (not a malformed --trace-config item)
    args = parse_args(["--model-repository", str(tmp_path), "--trace-file="])
    assert args.trace_config.get("file", "") == "" and any("--trace-file" in line for _, line in args.notices)


def test_deprecated_and_ignored_flags_are_named_at_start(server_factory, tmp_path):
    """Triton's deprecation warnings for --strict-model-config (and its override by
    --disable-auto-complete-config), and --repository-poll-secs outside poll mode, which Triton
    drops without a word, are in the log; --log-verbose=true is verbose level 1."""
    repo = tmp_path / "repo"
    repo.mkdir()
    s = server_factory.start([repo], ["--strict-model-config=false", "--disable-auto-complete-config",
                                      "--repository-poll-secs=5", "--log-verbose=true",
                                      "--model-control-mode=EXPLICIT"])
    log = s.log()
    for line in ("'--strict-model-config' has been deprecated! Please use '--disable-auto-complete-config' instead.",
                 "Overriding deprecated '--strict-model-config' from False to True in favor of "
                 "'--disable-auto-complete-config'!",
                 "--repository-poll-secs 5 has no effect: the repositories are polled only with "
                 "--model-control-mode=poll"):
        assert line in log, line
    assert s.client().get_log_settings()["log_verbose_level"] == 1


def test_two_services_on_one_port_are_refused_in_tritons_words(tmp_path, capsys):
    """As Triton's CheckPortCollision: refused before anything binds (it named the server itself as
    the port's holder), unless one of the two is off or they bind different addresses."""
    from shmserve.server.cli import parse_args

    line = _refusal(tmp_path, capsys, "--http-port=19130", "--grpc-port=19130")
    assert line.endswith("The server cannot listen to HTTP requests and GRPC requests at the same address and port "
                         "0.0.0.0:19130"), line
    line = _refusal(tmp_path, capsys, "--grpc-port=19131", "--metrics-port=19131", "--grpc-address=127.0.0.1",
                    "--metrics-address=127.0.0.1")
    assert line.endswith("cannot listen to GRPC requests and metrics requests at the same address and port "
                         "127.0.0.1:19131"), line
    for ok in (["--http-port=19130", "--grpc-port=19130", "--allow-grpc=false"],
               ["--http-port=19130", "--metrics-port=19130", "--allow-metrics=false"],
               ["--http-port=19130", "--grpc-port=19130", "--grpc-address=127.0.0.1"],
               ["--http-port=0", "--grpc-port=0", "--metrics-port=0"]):
        parse_args(["--model-repository", str(tmp_path), *ok])
