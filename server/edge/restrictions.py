"""Triton's restricted groups (``--http-restricted-api``, ``--grpc-restricted-protocol``): the flags'
values, parsed the same way for both frontends. Each frontend matches its own endpoints against
them (frontend/restricted.py, grpc/restricted.py)."""
from __future__ import annotations

CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
Restrictions = dict[str, tuple[str, str]]  # category -> (header name, lower case; value)


def parse(values: list[str], flag: str = "--http-restricted-api", kind: str = "api") -> Restrictions:
    """``<group>[,<group>...]:<key>=<value>`` flags (``flag``: Triton's ``--http-restricted-api``
    or ``--grpc-restricted-protocol``, whose groups are the same and called protocols). ValueError
    says what is wrong in Triton's words (command_line_parser.cc), which operators' scripts match:
    a malformed value, an unknown group, a group in two flags."""
    out: Restrictions = {}
    for value in values:
        apis, sep, header = value.partition(":")
        key, eq, expected = header.partition("=")
        if not sep or not eq or not key.strip() or not apis.strip() or not expected:
            raise ValueError(f"{flag} option format is '<config name>:<setting>=<value>'. Got {value}")
        for api in (a.strip() for a in apis.split(",")):
            if api not in CATEGORIES:
                raise ValueError(f"unknown restricted {kind} '{api}'")
            if api in out:
                raise ValueError(f"restricted {kind} '{api}' can not be specified in multiple config groups")
            out[api] = (key.strip().lower(), expected)
    return out
