"""Flag values read as ``tritonserver`` 2.51 reads them (``src/command_line_parser.cc``).

A value Triton refuses at start is refused here too, with Triton's words, also for the flags that
have no effect here: a command line that would not start Triton must not start shmserve and
seem to work. Each reader is an ``argparse`` ``type=``; it returns the value as it was given
(what the start-up notices show) or, where shmserve acts on it, the value read.
"""
from __future__ import annotations

import argparse
import re
from typing import Callable

INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)
# std::stoi and friends: leading blanks, a sign, digits (what follows them is ignored by Triton;
# here it is refused, as no Triton command line means it)
_INT = re.compile(r"\s*[+-]?\d+")


def _bad(why: str, arg: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{why} Got {arg}")


def integer(arg: str, bounds: tuple[int, int] = INT32) -> int:
    """Triton's ParseOption<int> (int64_t, uint64_t with other ``bounds``)."""
    if not _INT.fullmatch(arg):
        raise _bad("Invalid option value.", arg)
    n = int(arg)
    if not bounds[0] <= n <= bounds[1]:
        raise _bad("Provided option value is out of bound.", arg)
    return n


def real(arg: str) -> float:
    """Triton's ParseOption<double>."""
    try:
        return float(arg)
    except ValueError:
        raise _bad("Invalid option value.", arg) from None


def boolean(arg: str) -> bool:
    """Triton's ParseOption<bool>: true/on/1 or false/off/0, ignoring case."""
    v = arg.lower()
    if v in ("true", "on", "1"):
        return True
    if v in ("false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"invalid value for bool option: {arg}")


def int_or_bool(arg: str) -> int:
    """Triton's ``--log-verbose``: ``true`` is 1, ``false`` 0 (ignoring case), else an integer."""
    v = arg.lower()
    return 1 if v == "true" else 0 if v == "false" else integer(arg)


def trace_level(arg: str) -> str:
    """Triton's ParseTraceLevelOption (the deprecated ``--trace-level``): a level it knows, ignoring case."""
    if arg.lower() not in ("false", "off", "true", "on", "min", "max", "timestamps", "tensors"):
        raise argparse.ArgumentTypeError(f"invalid value for trace level option: {arg}")
    return arg


def pair(delim: str, first: Callable[[str], object], second: Callable[[str], object]) -> Callable[[str], str]:
    """Triton's ParsePairOption: ``<first><delim><second>``, each part read as its type."""
    def read(arg: str) -> str:
        at = arg.find(delim)
        if at < 0:
            raise argparse.ArgumentTypeError(
                f"Cannot parse pair option due to incorrect number of inputs.--<pair option> argument requires "
                f"format <first>{delim}<second>. Found: {arg}")
        first(arg[:at])
        second(arg[at + len(delim):])
        return arg
    return read


def config(option: str, name: str, first_delim: str = ",", second_delim: str = "=") -> Callable[[str], str]:
    """Triton's ParseGenericConfigOption: ``<name><first_delim><setting><second_delim><value>``,
    none of the three empty (``--host-policy``)."""
    def read(arg: str) -> str:
        at = arg.find(first_delim)
        eq = arg.find(second_delim, at + 1) if at >= 0 else -1
        if at < 1 or eq < 0 or eq == at + 1 or eq == len(arg) - 1:
            raise argparse.ArgumentTypeError(f"--{option} option format is '<{name}>{first_delim}<setting>"
                                             f"{second_delim}<value>'. Got {arg}")
        return arg
    return read


def backend_config(arg: str) -> tuple[str, str, str]:
    """Triton's ParseBackendConfigOption: (backend, setting, value) of
    ``[<backend>,]<setting>=<value>``, split at the first ``,`` and the first ``=`` after it."""
    comma = arg.find(",")
    if comma == 0:
        raise argparse.ArgumentTypeError(f"No backend specified. --backend-config option format is <backend name>,"
                                         f"<setting>=<value> or <setting>=<value>. Got {arg}")
    eq = arg.find("=", comma + 1)
    form = f"--backend-config option format is '<backend name>,<setting>=<value>'. Got {arg}"
    if eq < 0:
        raise argparse.ArgumentTypeError(form)
    backend, setting, value = (arg[:comma] if comma > 0 else ""), arg[comma + 1:eq], arg[eq + 1:]
    if not setting or not value:
        raise argparse.ArgumentTypeError(form)
    return backend, setting, value


def choice(names: tuple[str, ...], flag: str) -> Callable[[str], str]:
    """One of ``names``, ignoring case (Triton's --model-control-mode, --rate-limit), as its name."""
    def read(arg: str) -> str:
        v = arg.lower()
        if v not in names:
            raise argparse.ArgumentTypeError(f"invalid argument for {flag}: '{arg}' (choose from {', '.join(names)}, "
                                             f"ignoring case)")
        return v
    return read
