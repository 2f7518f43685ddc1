"""Logging for every shmserve process, in Triton's line format, from one settings dict.

The settings are Triton's logging extension document (``GET /v2/logging``)::

    {"log_file": "", "log_info": true, "log_warning": true, "log_error": true,
     "log_verbose_level": 0, "log_format": "default"}

Line formats, as Triton documents them (``--log-format``; the level letter is E, W, I or V, the
third field is the process id, times are UTC)::

    default:  <L><MMDD> <hh:mm:ss.uuuuuu> <pid> <file>:<line>] <msg>
              I0520 20:03:25.829575 3355 model_lifecycle.cc:441] AsyncLoad() 'simple'
    ISO8601:  <YYYY-MM-DD>T<hh:mm:ss>Z <L> <pid> <file>:<line>] <msg>
              2024-05-20T20:03:26Z I 3415 model_lifecycle.cc:441] AsyncLoad() 'simple'

Differences from Triton: verbose lines carry the letter V (older Triton releases log verbose
messages as INFO, letter I), and messages are not JSON-escaped. A worker's lines start with
``[<model> v<version> #<instance>] ``. Like Triton, ``log_file`` is set at start only.

Python's DEBUG is verbose level 1; level N is the Python level ``11 - N`` (see ``verbose_level``).
Other libraries' debug lines (watchdog's file events, grpc's, asyncio's) count as level
``LIBRARY_VERBOSE``: level 1 shows what the server does (each execution, each change of settings),
not the chatter of what it is built on.
The broker owns the settings and publishes them in its segment (``BrokerSegment.settings``);
workers follow them with ``Follower.check()`` when they wake, the launcher and the frontends with
``BrokerSettings.check()`` on the ticks of their own loops.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import orjson

from .channel import BrokerSegment
from .names import pid_alive
from .published import Published

DEFAULTS: dict[str, Any] = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                            "log_verbose_level": 0, "log_format": "default"}
FORMATS = ("default", "ISO8601")
VERBOSE = logging.DEBUG  # verbose level 1; pb_utils.Logger.VERBOSE maps here
LIBRARY_VERBOSE = 2  # the verbose level from which other libraries' debug lines show
MAX_VERBOSE = 0xFFFFFFFF  # Triton's log_verbose_level is a uint32
_log = logging.getLogger("shmserve.logs")


def verbose_level(levelno: int) -> int:
    """The verbose level of a Python level below INFO (DEBUG is 1, DEBUG - 1 is 2, ...)."""
    return max(1, 11 - levelno)


def level_letter(levelno: int) -> str:
    """Triton's level letter; CRITICAL counts as E, anything below INFO as V."""
    if levelno >= logging.ERROR:
        return "E"
    if levelno >= logging.WARNING:
        return "W"
    return "I" if levelno >= logging.INFO else "V"


def open_log_file(path: str) -> int:
    """An O_APPEND descriptor: every process appends whole lines to one file without a lock."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)


def merge(current: dict[str, Any], update: Any) -> dict[str, Any]:
    """``current`` with ``update`` (a POST body) applied; ValueError says what is wrong."""
    if not isinstance(update, dict):
        raise ValueError("the log settings request must be a JSON object")
    new = dict(current)
    for key, value in update.items():
        if key not in DEFAULTS:
            raise ValueError(f"unknown log setting '{key}' (known: {', '.join(DEFAULTS)})")
        if value is None:  # as Triton: a key given null changes nothing (log_file too)
            continue
        if key in ("log_info", "log_warning", "log_error"):
            if not isinstance(value, bool):
                raise ValueError(f"log setting '{key}' must be a boolean, got {orjson.dumps(value).decode()}")
        elif key == "log_verbose_level":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_VERBOSE:
                raise ValueError(f"log setting 'log_verbose_level' must be an integer >= 0, got "
                                 f"{orjson.dumps(value).decode()}")
        elif key == "log_format":
            if value not in FORMATS:
                raise ValueError(f"log setting 'log_format' must be 'default' or 'ISO8601', got "
                                 f"{orjson.dumps(value).decode()}")
        elif key == "log_file":
            # As Triton since it deprecated this (server PR #7090, after CVE-2024-0087): a client
            # that could name the file could make the server append to any file its user can write.
            # Any value, the current one too: Triton 2.51 refuses the setting whatever it says.
            raise LogFileFixed("log file location can not be updated through network protocol")
        new[key] = value
    return new


def follow(answer: dict[str, Any]) -> None:
    """Apply a change the broker answered (a frontend follows the POST it forwarded at once):
    every setting but the file, which no request changes, and which the answer names as the
    flag did (relative, maybe), not as this process opens it."""
    configure({**answer, "log_file": current()["log_file"]})


class LogFileFixed(ValueError):
    """A change of the log file over the network: Triton's refusal (its 501, UNIMPLEMENTED)."""

    status = 501


class _State:
    """One immutable snapshot the handler reads at once, so a change from another thread never
    tears a line."""

    __slots__ = ("fd", "iso", "info", "warning", "error", "verbose", "prefix")

    def __init__(self, fd: int, settings: dict[str, Any], prefix: str) -> None:
        self.fd = fd
        self.iso = settings["log_format"] == "ISO8601"
        self.info = bool(settings["log_info"])
        self.warning = bool(settings["log_warning"])
        self.error = bool(settings["log_error"])
        self.verbose = int(settings["log_verbose_level"])
        self.prefix = prefix

    def enabled(self, levelno: int) -> bool:
        if levelno >= logging.ERROR:
            return self.error
        if levelno >= logging.WARNING:
            return self.warning
        if levelno >= logging.INFO:
            return self.info
        return self.verbose >= verbose_level(levelno)

    def root_level(self) -> int:
        """The lowest level any line could pass, so disabled verbose calls stay cheap."""
        if self.verbose:
            return 11 - min(self.verbose, 10)
        for on, level in ((self.info, logging.INFO), (self.warning, logging.WARNING), (self.error, logging.ERROR)):
            if on:
                return level
        return logging.CRITICAL + 1


class TritonHandler(logging.Handler):
    """Writes each record as one ``write`` to stderr or the O_APPEND log file."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def handle(self, record: logging.LogRecord) -> bool:  # no handler lock: one write per record
        state = self.state
        if not state.enabled(record.levelno):
            return False
        if record.levelno < logging.INFO and state.verbose < LIBRARY_VERBOSE and not record.name.startswith("shmserve"):
            return False  # another library's debug line
        try:
            line = self.line(record, state)
            data = line.encode("utf-8", "replace")
            while data:
                n = os.write(state.fd, data)
                data = data[n:]
        except Exception:  # noqa: BLE001 - logging must never break the caller
            self.handleError(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    @staticmethod
    def line(record: logging.LogRecord, state: _State) -> str:
        t = time.gmtime(record.created)
        letter = level_letter(record.levelno)
        if state.iso:
            head = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', t)} {letter}"
        else:
            usec = int((record.created % 1) * 1_000_000)
            head = f"{letter}{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{usec:06d}"
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + logging.Formatter().formatException(record.exc_info)
        if record.stack_info:
            msg += "\n" + record.stack_info
        return f"{head} {record.process} {record.filename}:{record.lineno}] {state.prefix}{msg}\n"


_lock = threading.Lock()
_handler: TritonHandler | None = None
_settings: dict[str, Any] = dict(DEFAULTS)
_prefix = ""
_file: tuple[str, int] | None = None  # (path, fd) of the open log file


def current() -> dict[str, Any]:
    return dict(_settings)


def configure(settings: dict[str, Any], prefix: str | None = None) -> None:
    """(Re)configure this process's logging; ``prefix`` starts every line (kept when None).

    Idempotent: the same settings again change nothing, and a change is itself logged at verbose
    level 1 so one can see each process take it."""
    global _handler, _settings, _prefix, _file
    with _lock:
        new = {**DEFAULTS, **settings}
        if prefix is not None:
            _prefix = prefix
        changed = new != _settings and _handler is not None  # (the first settings are no change)
        fd, old_fd = 2, None
        path = new["log_file"]
        if path:
            if _file is not None and _file[0] == path:
                fd = _file[1]
            else:
                fd = open_log_file(path)
                old_fd = _file[1] if _file is not None else None
                _file = (path, fd)
        elif _file is not None:
            old_fd, _file = _file[1], None
        state = _State(fd, new, _prefix)
        root = logging.getLogger()
        if _handler is None:
            for h in list(root.handlers):
                root.removeHandler(h)
            _handler = TritonHandler(state)
            root.addHandler(_handler)
        else:
            _handler.state = state
        root.setLevel(state.root_level())
        if old_fd is not None:
            os.close(old_fd)
        _settings = new
    if changed:
        _log.debug("log settings: %s", orjson.dumps(new).decode())


def publish(area: Published, settings: dict[str, Any]) -> None:
    """Broker side: the settings every other process follows."""
    area.publish(orjson.dumps({"log": settings}))


class Follower:
    """Applies the published settings when their generation moves (one integer read otherwise)."""

    def __init__(self, area: Published) -> None:
        self.area = area
        self.gen = -1

    def check(self) -> bool:
        if self.area.generation() == self.gen:
            return False
        gen, raw = self.area.read()
        self.gen = gen
        if not raw:
            return False
        try:
            configure(orjson.loads(raw)["log"])
        except (OSError, ValueError, KeyError) as e:
            _log.error("cannot apply the published log settings: %s", e)
        return True


class BrokerSettings:
    """The log settings a process with no broker loop of its own (launcher, frontends) follows:
    ``check()`` a few times a second from its own loop (no thread to wake), re-attaching when the
    broker is replaced."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self._seg: BrokerSegment | None = None
        self._follower: Follower | None = None

    def check(self) -> None:
        try:
            if self._seg is not None and not pid_alive(self._seg.pid):
                self.close()
            if self._seg is None:
                self._seg = BrokerSegment.attach(self.server_id)
                self._follower = Follower(self._seg.settings)
            assert self._follower is not None
            self._follower.check()
        except Exception:  # noqa: BLE001 - no broker yet, or it is restarting: try again later
            self.close()

    def close(self) -> None:
        if self._seg is not None:
            try:
                self._seg.close()
            except Exception:  # noqa: BLE001
                pass
        self._seg = self._follower = None
