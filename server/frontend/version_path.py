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
