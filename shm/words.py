"""Stores of one shared-memory word that another process may read at any moment.

``struct.pack_into`` zeroes its target bytes before it writes the value, so a reader on another
core can see 0 in between: a lane of 0 for a client still waiting for one, a block's state that
is neither held nor freed, a want-wakeup flag off while it stays on. These write the word with
one aligned store (a memoryview cast to the word's C type copies it whole), as the rings write
their counters (ring.py). Reads may stay ``struct.unpack_from``: reading never writes.
"""
from __future__ import annotations

from typing import Any


def store_u32(buf: Any, offset: int, value: int) -> None:
    """``buf[offset:offset + 4]`` = ``value`` (little-endian, 4-byte aligned), in one store."""
    memoryview(buf)[offset:offset + 4].cast("I")[0] = value


def store_u64(buf: Any, offset: int, value: int) -> None:
    """``buf[offset:offset + 8]`` = ``value`` (little-endian, 8-byte aligned), in one store."""
    memoryview(buf)[offset:offset + 8].cast("Q")[0] = value
