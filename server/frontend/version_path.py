"""A model version in a URL path, as Triton's HTTP routes take it: ASCII digits only
(``/versions/([0-9]+)``). Any other version (``-1``, ``abc``, `` 1``) matches no route and gets
Triton's plain 404, rather than being read as a version."""
from __future__ import annotations

from starlette.convertors import Convertor, register_url_convertor


class Digits(Convertor[str]):
    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


DIGITS = Digits()
register_url_convertor("digits", DIGITS)


def is_version(segment: str) -> bool:
    """Whether a path segment is a version Triton's routes take."""
    return segment.isascii() and segment.isdigit()


INT64_MAX = (1 << 63) - 1


def version_error(segment: str) -> str | None:
    """Triton's 400 for a version its routes take but its ``std::stol`` cannot hold (measured on
    2.51, for every endpoint that names a version); None for any other."""
    if len(segment) > 18 and int(segment) > INT64_MAX:
        return (f"failed to get model version from specified version string '{segment}' (details: stol), "
                f"version should be an integral value > 0")
    return None


def path_version_error(path: str) -> str | None:
    """``version_error`` of a ``/v2/models/<m>/versions/<v>...`` path's version."""
    _, found, rest = path.partition("/versions/")
    if not found:
        return None
    segment = rest.partition("/")[0]
    return version_error(segment) if is_version(segment) else None
