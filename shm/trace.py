"""Triton's trace extension (TIMESTAMPS level): the settings, and the state every process shares.

Sources (facts only): Triton's ``docs/user_guide/trace.md`` and ``docs/protocol/extension_trace.md``
(triton-inference-server/server; docs.nvidia.com "Triton Server Trace" and "Trace Extension"), and
its ``src/tracer.cc`` for the file format and the per-setting counters. What they say:

- Flags: ``--trace-config <setting>=<value>`` for the global settings ``level`` (OFF, TIMESTAMPS,
  TENSORS; default OFF), ``rate`` (trace every rate-th request; default 1000), ``count`` (traces
  left to take, -1 unlimited; default -1) and ``mode`` (triton or opentelemetry); and
  ``--trace-config <mode>,<setting>=<value>`` for a mode's own: ``triton,file=/tmp/trace.json``,
  ``triton,log-frequency=50``, ``opentelemetry,url=...``.
- HTTP: ``GET/POST v2[/models/<model>]/trace/setting`` with ``trace_file``, ``trace_level`` (a list),
  ``trace_rate``, ``trace_count``, ``log_frequency`` and ``trace_mode``, every value a string (the
  level a list of strings). A model's settings fall back on the global ones for every key it does not
  set, and follow later global changes for those keys; posting ``null`` for a key of a model clears
  it; a model with no key left uses the global setting object itself.
- Each setting object has its own sample counter (``++n % rate == 0`` is traced) and its own count
  of traces left; ``trace_count`` answers what is left.
- The trace file is a JSON array. With ``log_frequency`` 0 every trace goes to ``trace_file`` (Triton
  writes it when the server stops); with N > 0 every N traces make a complete array in
  ``<trace_file>.<k>``, k = 0, 1, ... Timestamp names: HTTP_RECV_START, HTTP_RECV_END,
  REQUEST_START, QUEUE_START, COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END,
  REQUEST_END, HTTP_SEND_START, HTTP_SEND_END (steady-clock ns); over gRPC the first two are
  GRPC_WAITREAD_START and GRPC_WAITREAD_END and the last two GRPC_SEND_START and GRPC_SEND_END.
  The frontends (``src/http_server.cc``, ``src/grpc/infer_handler.cc``, ``stream_infer_handler.cc``)
  also stamp INFER_RESPONSE_COMPLETE when they have made a response of the server's (each
  response of a stream), before its send.

How shmserve differs, and why:
- One JSON object per traced request: ``{"id", "model_name", "model_version", ["request_id",]
  "timestamps": [{"name", "ns"}, ...]}``, the schema Triton's trace.md documents (Triton itself
  writes one object per timestamp under the same id; readers that group by id read both).
  A streamed request (gRPC ModelStreamInfer, HTTP generate_stream) has a SEND pair per response,
  as Triton records, and its timestamps listed in the order they were taken. An ensemble's steps
  are traces of their own with ``parent_id``, as Triton's (the broker carries their stamps back in
  the answer, ``shm/answer.py`` StepTrace), written with their parent as one group.
- Traces are appended as they finish, from every frontend process (one write each, under a shared
  lock that also numbers them), so ``trace_file`` grows while the server runs; its closing ``]`` is
  appended when the server stops. ``read_trace_file`` reads a file that is still open.
- When ``trace_count`` runs out, traces stay in the file they were going to (Triton moves the
  collected ones to an indexed file).
- ``rate`` is counted per frontend process (with ``--http-workers N`` each traces every rate-th of
  its own requests); ``count`` and ids are exact across processes (counted in shared memory).
- TENSORS is refused (only OFF and TIMESTAMPS are implemented).
- ``trace_file`` may change at run time only to a file in the directory of the start-up trace file
  (a client must not make the server write wherever it likes); ``trace_mode`` not at all.
"""
from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import orjson
import posix_ipc

from .names import object_name, unlink_semaphore
from .published import Published
from .segment import Segment

LEVELS = ("OFF", "TIMESTAMPS")
MODES = ("triton", "opentelemetry")
DEFAULT_OTEL_URL = "http://localhost:4318/v1/traces"
# Internal names; TRITON_KEYS maps the HTTP names onto them.
DEFAULTS: dict[str, Any] = {"level": "OFF", "rate": 1000, "count": -1, "log_frequency": 0, "file": "",
                            "mode": "triton", "url": DEFAULT_OTEL_URL, "otel": []}
# OpenTelemetry's batch span processor settings (``opentelemetry,bsp_...``): Triton's defaults,
# from the SDK's environment variables where set, as Triton reads them.
OTEL_BSP = {"bsp_max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            "bsp_schedule_delay": ("OTEL_BSP_SCHEDULE_DELAY", 5000),
            "bsp_max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)}
# --trace-config level= at start, as Triton reads it (ignoring case); a POSTed level is exact.
START_LEVELS = {"off": "OFF", "false": "OFF", "timestamps": "TIMESTAMPS", "on": "TIMESTAMPS", "true": "TIMESTAMPS",
                "min": "TIMESTAMPS", "max": "TIMESTAMPS", "tensors": "TENSORS"}
TRITON_KEYS = {"trace_file": "file", "trace_level": "level", "trace_rate": "rate", "trace_count": "count",
               "log_frequency": "log_frequency", "trace_mode": "mode"}
MODEL_KEYS = ("file", "level", "rate", "count", "log_frequency")  # what a model may override
STAMPS = ("HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
          "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END", "INFER_RESPONSE_COMPLETE",
          "HTTP_SEND_START", "HTTP_SEND_END")
# Over gRPC, Triton names the frontend's own four stamps so (src/grpc/infer_handler.cc).
GRPC_STAMPS = ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *STAMPS[2:-2], "GRPC_SEND_START", "GRPC_SEND_END")
MAX_U32 = 0xFFFFFFFF
# Triton's words for a rate of 0 while the level is on (it takes one while tracing is OFF)
RATE_ZERO = "Attempting to set invalid trace setting :sample rate must be non-zero"
MAX_I32 = 0x7FFFFFFF


# -- settings -------------------------------------------------------------------------------------
def _int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"trace setting '{key}' must be an integer given as a string, got "
                         f"{orjson.dumps(value).decode()}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"trace setting '{key}' must be an integer, got '{value}'") from None
    if not low <= n <= high:
        raise ValueError(f"trace setting '{key}' must be between {low} and {high}, got {n}")
    return n


def _level(value: Any) -> str:
    levels = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in levels):
        raise ValueError(f"trace setting 'trace_level' must be a list of strings, got {orjson.dumps(value).decode()}")
    names = set(levels)
    if "OFF" in names and len(names) > 1:  # Triton's words
        raise ValueError("Expect only one trace level 'OFF' is specified")
    if "TENSORS" in names:
        raise ValueError("trace level TENSORS is not supported by shmserve (only OFF and TIMESTAMPS)")
    unknown = names - set(LEVELS)
    if unknown:
        raise ValueError(f"unknown trace level '{sorted(unknown)[0]}' (known: OFF, TIMESTAMPS)")
    return "TIMESTAMPS" if "TIMESTAMPS" in names else "OFF"


def check_value(key: str, value: Any) -> Any:
    """An internal setting's value from a flag or a POST body; ValueError says what is wrong."""
    if key == "level":
        return _level(value)
    if key == "rate":  # (0 only while the level is OFF, as Triton: check_update, the broker's check)
        return _int("trace_rate", value, 0, MAX_U32)
    if key == "count":
        return _int("trace_count", value, -1, MAX_I32)
    if key == "log_frequency":
        return _int("log_frequency", value, 0, MAX_U32)
    if key in ("file", "url"):
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"trace setting '{key}' must be a string")
        return value
    if key == "mode":
        if not isinstance(value, str) or value.lower() not in MODES:
            raise ValueError(f"trace mode must be 'triton' or 'opentelemetry', got {orjson.dumps(value).decode()}")
        return value.lower()
    raise ValueError(f"unknown trace setting '{key}'")


def parse_config(items: list[str]) -> dict[str, Any]:
    """``--trace-config`` values (``level=TIMESTAMPS``, ``triton,file=/tmp/t.json``, ...) as settings."""
    out: dict[str, Any] = {}
    otel: list[tuple[str, str]] = []  # opentelemetry,<key>=<value> in the order given (Triton shows them so)
    for item in items:
        head, sep, value = item.partition("=")
        if head.startswith(","):  # Triton's words for the three malformed forms
            raise ValueError(f"No trace mode specified. --trace-config option format is <trace mode>,<setting>="
                             f"<value> or <setting>=<value>. Got {item}")
        if not sep or not value or not head or head.endswith(","):
            raise ValueError(f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {item}")
        mode, comma, key = head.rpartition(",")
        key = key.strip().replace("-", "_")
        mode = mode.strip().lower()
        if comma and mode not in MODES:
            raise ValueError(f"--trace-config '{item}': unknown mode '{mode}' (triton or opentelemetry)")
        known = {"": ("level", "rate", "count", "mode", "log_frequency", "file"),
                 "triton": ("file", "log_frequency"), "opentelemetry": ("url", "resource", *OTEL_BSP)}[mode]
        if key not in known:
            raise ValueError(f"--trace-config '{item}': unknown setting '{key}'"
                             + (f" for mode {mode}" if mode else "") + f" (known: {', '.join(known)})")
        if mode == "opentelemetry":
            otel.append((key, _otel_value(key, value, item)))
            if key != "url":
                continue
        if key == "level":
            value = START_LEVELS.get(value.strip().lower(), value)
            if out.get("level") == "TIMESTAMPS":
                check_value(key, value)  # repeated levels add up, as Triton's
                continue
        out[key] = check_value(key, value)
    given = {key for key, _ in otel}
    # Triton reads the SDK's variables in OpenTelemetry mode only: one set for another program must
    # not stop a server that traces to a file, or not at all (settings given are checked whatever the mode).
    if out.get("mode") == "opentelemetry" or given & OTEL_BSP.keys():
        otel += [(key, str(_bsp_default(key, env, default))) for key, (env, default) in OTEL_BSP.items()
                 if key not in given]
        bsp = {key: int(value) for key, value in otel if key in OTEL_BSP}
        if bsp["bsp_max_export_batch_size"] > bsp["bsp_max_queue_size"]:
            raise ValueError(f"--trace-config opentelemetry,bsp_max_export_batch_size="
                             f"{bsp['bsp_max_export_batch_size']} exceeds bsp_max_queue_size={bsp['bsp_max_queue_size']}"
                             f" (given, or from OTEL_BSP_*): a batch is taken from the queue")
    out["otel"] = otel
    return out


def _bsp_default(key: str, env: str, default: int) -> int:
    """A batch span processor setting not given: the SDK's variable ``env`` where set, else Triton's
    default; ValueError names the variable."""
    try:
        return _int(key, os.environ.get(env, str(default)), 1, MAX_U32)
    except ValueError as e:
        raise ValueError(f"{env}: {e}") from None


def _otel_value(key: str, value: str, item: str) -> str:
    """An ``opentelemetry,<key>=<value>`` setting's value as Triton keeps it (a string)."""
    if key in OTEL_BSP:
        return str(_int(key, value, 1, MAX_U32))
    if key == "resource" and "=" not in value:
        raise ValueError(f"--trace-config '{item}': a resource is <key>=<value>")
    return check_value("url", value) if key == "url" else value


def otel_resource(otel: list) -> dict[str, str]:
    """The resource attributes ``opentelemetry,resource=<key>=<value>`` settings give spans."""
    return dict(str(value).split("=", 1) for key, value in otel if key == "resource")


def otel_bsp(otel: list) -> dict[str, int]:
    """The batch span processor's settings (``OTEL_BSP`` keys, each given or its default)."""
    return {key: int(value) for key, value in otel if key in OTEL_BSP}


def effective(global_: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    return {**global_, **(override or {})}


def triton_doc(setting: dict[str, Any], remaining: int) -> dict[str, Any]:
    """A setting as Triton's trace extension shows it (every value a string, the level a list)."""
    doc: dict[str, Any] = {"trace_level": [setting["level"]], "trace_rate": str(setting["rate"]),
                           "trace_count": str(remaining)}
    if setting["mode"] == "opentelemetry":  # (as Triton: no file, and the mode's own settings)
        doc["trace_mode"] = setting["mode"]
        doc.update((key, str(value)) for key, value in setting["otel"])
        return doc
    doc.update(log_frequency=str(setting["log_frequency"]), trace_file=setting["file"], trace_mode=setting["mode"])
    return doc


def check_update(update: Any, model: str, current: dict[str, Any], start_file: str,
                 start: dict[str, Any]) -> dict[str, Any]:
    """A POST body as internal settings (None: clear a model's key); ValueError says what is wrong.

    ``current`` is the setting in effect for ``model`` (or the global one), ``start`` the global
    one the server started with: a global key cleared (null) goes back to it, as in Triton; an
    empty ``trace_level`` list changes nothing, as in Triton."""
    if not isinstance(update, dict):
        raise ValueError("the trace setting request must be a JSON object")
    out: dict[str, Any] = {}
    for name, value in update.items():
        key = TRITON_KEYS.get(name)
        if key is None:
            raise ValueError(f"unknown trace setting '{name}' (known: {', '.join(TRITON_KEYS)})")
        if key == "mode":
            if value is None or check_value("mode", value) == current["mode"]:
                continue  # as it is: nothing to change
            raise ValueError("trace setting 'trace_mode' cannot be changed at run time; start the server with "
                             "--trace-config mode=<mode>")
        if value is None:
            if not model:
                out[key] = start[key]
            else:
                out[key] = None
            continue
        if key == "level" and value == []:
            continue
        value = check_value(key, value)
        if key == "file" and value != current["file"]:
            check_file(value, start_file)
            value = os.path.realpath(value if os.path.isabs(value) else
                                     os.path.join(os.path.dirname(start_file), value))
        out[key] = value
    level = out["level"] if out.get("level") is not None else current["level"]
    if level != "OFF" and out.get("count") == 0:  # Triton refuses a setting that traces nothing unless it is OFF
        raise ValueError("Attempting to set invalid trace setting : a trace_count of 0 traces nothing while "
                         "trace_level is on (-1: no limit; or set trace_level OFF)")
    if level != "OFF" and out.get("rate") == 0:
        raise ValueError(RATE_ZERO)
    return out


def check_file(path: str, start_file: str) -> None:
    """Run-time trace files must lie in the directory of the start-up one (not a symlink out of it)."""
    if not start_file:
        raise ValueError("trace setting 'trace_file' can be changed at run time only when the server was "
                         "started with --trace-config triton,file=<path> (new files must be in its directory)")
    root = os.path.realpath(os.path.dirname(start_file))
    target = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.dirname(target) != root or not os.path.basename(target):
        raise ValueError(f"trace setting 'trace_file' must name a file in {root} (the directory of the "
                         f"start-up trace file), got '{path}'")
    if os.path.exists(target) and not os.path.isfile(target):
        raise ValueError(f"trace file '{path}' exists and is not a regular file")


# -- state shared by the broker and every frontend -------------------------------------------------
SLOTS = 256  # setting objects (global, and each model with its own settings)
FILES = 128  # trace files ever named during one broker's life
_MAGIC = 0x54524345  # "TRCE"
_HEAD = struct.Struct("<IIQ")  # magic, broker pid, next trace id
SLOTS_OFF = 64
FILES_OFF = SLOTS_OFF + SLOTS * 32
DOC_OFF = (FILES_OFF + FILES * 32 + 4095) & ~4095
DOC_BYTES = 1 << 16
SIZE = DOC_OFF + DOC_BYTES
LOCK_TIMEOUT_S = 1.0


class TraceShared:
    """``/shmserve.<id>.trace.0``: the published settings, and the counters every process updates
    under one semaphore: per setting object (serial, traces left), per trace file (serial, records
    in the main file, records in the current indexed file, its index), and the next trace id."""

    def __init__(self, server_id: str, seg: Segment, sem: posix_ipc.Semaphore) -> None:
        self.name = seg.name
        self.seg = seg
        self.sem = sem
        self.sem_name = object_name(server_id, "trace", 0)
        self.head = np.ndarray((2,), dtype=np.uint32, buffer=seg.buf, offset=0)
        self.next_id = np.ndarray((1,), dtype=np.int64, buffer=seg.buf, offset=8)
        self.slots = np.ndarray((SLOTS, 4), dtype=np.int64, buffer=seg.buf, offset=SLOTS_OFF)
        self.files = np.ndarray((FILES, 4), dtype=np.int64, buffer=seg.buf, offset=FILES_OFF)
        self.doc = Published(seg.buf, DOC_OFF, DOC_BYTES)

    @classmethod
    def create(cls, server_id: str) -> "TraceShared":
        name = object_name(server_id, "trace", 0)
        seg = Segment.create_anew(name, SIZE)
        unlink_semaphore(name)
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
        shared = cls(server_id, seg, sem)
        _HEAD.pack_into(seg.buf, 0, _MAGIC, os.getpid(), 0)
        return shared

    @classmethod
    def attach(cls, server_id: str) -> "TraceShared":
        name = object_name(server_id, "trace", 0)
        seg = Segment.attach(name)
        if _HEAD.unpack_from(seg.buf, 0)[0] != _MAGIC:
            seg.close()
            raise ConnectionError(f"{name} is not ready")
        return cls(server_id, seg, posix_ipc.Semaphore(name))

    @property
    def pid(self) -> int:
        return int(self.head[1])

    def lock(self) -> bool:
        try:
            self.sem.acquire(LOCK_TIMEOUT_S)
            return True
        except posix_ipc.BusyError:
            return False

    def unlock(self) -> None:
        self.sem.release()

    def take_over(self) -> None:
        """Broker: take the lock, even from a process that died holding it (after the timeout)."""
        self.lock()

    def claim(self, slot: int, serial: int) -> int:
        """A new trace id if the setting object still exists and has traces left, else 0; -1 when
        the lock stays taken (a process died holding it)."""
        if not self.lock():
            return -1
        try:
            row = self.slots[slot]
            if int(row[0]) != serial or int(row[1]) == 0:
                return 0
            if int(row[1]) > 0:
                row[1] -= 1
            self.next_id[0] += 1
            return int(self.next_id[0])
        finally:
            self.unlock()

    def child_ids(self, count: int) -> int:
        """The first of ``count`` new trace ids for the children of a traced request (an
        ensemble's steps): they take ids, not traces from any count, as Triton's child traces do;
        0 when the lock stays taken."""
        if not self.lock():
            return 0
        try:
            first = int(self.next_id[0]) + 1
            self.next_id[0] += count
            return first
        finally:
            self.unlock()

    def close(self) -> None:
        self.sem.close()
        self.seg.close()

    def unlink(self) -> None:
        unlink_semaphore(self.sem_name)
        self.seg.unlink()


# -- the trace file -------------------------------------------------------------------------------
def index_path(path: str, index: int) -> str:
    return f"{path}.{index}"


class FileWriter:
    """Appends one record to a trace file under the shared lock, keeping each file a JSON array:
    ``[`` before its first record (which also truncates what an earlier server left), ``,`` before
    the others, and ``]`` after the last record of an indexed file."""

    def __init__(self, shared: TraceShared) -> None:
        self.shared = shared
        self.fds: dict[str, int] = {}

    def write(self, fslot: int, fserial: int, path: str, log_frequency: int, record: bytes) -> bool:
        shared = self.shared
        if not shared.lock():
            return False
        try:
            row = shared.files[fslot]
            if int(row[0]) != fserial:
                return False
            if log_frequency == 0:
                target, n = path, int(row[1])
                row[1] = n + 1
                data = (b"[" if n == 0 else b",\n") + record
                last = False
            else:
                index, n = int(row[3]), int(row[2])
                target = index_path(path, index)
                data = (b"[" if n == 0 else b",\n") + record
                last = n + 1 >= log_frequency
                if last:
                    data += b"]\n"
                    row[2], row[3] = 0, index + 1
                else:
                    row[2] = n + 1
            fd = self._fd(target, fresh=n == 0)
            while data:
                data = data[os.write(fd, data):]
            if last:
                os.close(self.fds.pop(target))
            return True
        finally:
            shared.unlock()

    def _fd(self, path: str, fresh: bool) -> int:
        fd = self.fds.get(path)
        if fresh or fd is None:
            if fd is not None:
                os.close(fd)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if fresh else 0)
            fd = self.fds[path] = os.open(path, flags, 0o644)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def finish_files(shared: TraceShared, paths: dict[str, tuple[int, int]]) -> None:
    """Broker, at exit: close the arrays still open (the main file, and a partly filled indexed one)."""
    shared.take_over()
    try:
        for path, (fslot, serial) in paths.items():
            row = shared.files[fslot]
            if int(row[0]) != serial:
                continue
            for target, n in ((path, int(row[1])), (index_path(path, int(row[3])), int(row[2]))):
                if n > 0:
                    try:
                        with open(target, "ab") as f:
                            f.write(b"]\n")
                    except OSError:
                        pass
            row[1] = row[2] = 0
    finally:
        shared.unlock()


def read_trace_file(path: str) -> list[dict]:
    """The records of a trace file, also while the server still appends to it (no ``]`` yet)."""
    with open(path, "rb") as f:
        raw = f.read().strip()
    if not raw:
        return []
    if not raw.endswith(b"]"):
        raw += b"]"
    return orjson.loads(raw)
