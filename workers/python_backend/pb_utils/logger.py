"""``pb_utils.Logger``: a model's log lines, in the server's log.

They go to the Python logger "shmserve.model", so they share the server's log, line format and
level switches (shm/logs.py).
"""
from __future__ import annotations

import enum
import logging

_MODEL_LOGGER = logging.getLogger("shmserve.model")


class _LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PY_LEVELS = {
    _LogLevel.INFO: logging.INFO,
    _LogLevel.WARNING: logging.WARNING,
    _LogLevel.ERROR: logging.ERROR,
    _LogLevel.VERBOSE: logging.DEBUG,
}


def _emit(message: str, level: _LogLevel) -> None:
    # stacklevel=3: _emit <- Logger.<method> <- model code, so the record's
    # file/line are the model's, like Triton's log lines.
    _MODEL_LOGGER.log(_PY_LEVELS[level], "%s", message, stacklevel=3)


class Logger:
    """Model logging (``pb_utils.Logger.log_info(...)``); VERBOSE maps to DEBUG, verbose level 1."""

    LogLevel = _LogLevel
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _LogLevel = _LogLevel.INFO) -> None:
        try:
            lvl = _LogLevel(level)
        except (ValueError, TypeError):
            raise TypeError(f"invalid log level: {level!r}") from None
        _emit(str(message), lvl)

    @staticmethod
    def log_info(message: str) -> None:
        _emit(str(message), _LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        _emit(str(message), _LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        _emit(str(message), _LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        _emit(str(message), _LogLevel.VERBOSE)
