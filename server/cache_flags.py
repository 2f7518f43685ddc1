"""Triton's response cache flags: ``--cache-config <cache>,<setting>=<value>`` (repeatable, one
setting each), ``--response-cache-byte-size`` (deprecated by Triton in 23.03, still accepted as
``--cache-config local,size=``) and ``--cache-directory``.

Only Triton's ``local`` cache exists here, built in, held in shared memory so that every process
of the server uses the same one. Errors carry Triton's texts where Triton has them.
"""
from __future__ import annotations

import argparse
import logging
import os

FORMAT = "'<cache name>,<setting>=<value>'"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-config", action="append", default=[], metavar="<cache>,<setting>=<value>",
                   help="the response cache, as Triton's: --cache-config local,size=<bytes> shares a cache of "
                        "that size among every process of the server; models use it when their config says "
                        "response_cache { enable: true }; repeatable, one setting each")
    p.add_argument("--response-cache-byte-size", type=int, default=None, metavar="BYTES",
                   help="DEPRECATED, as in Triton: the same as --cache-config local,size=BYTES")
    p.add_argument("--cache-directory", default=None, metavar="PATH",
                   help="accepted for Triton's command lines: the local cache is built in, so no cache "
                        "library is looked for")


def parse_setting(item: str) -> tuple[str, str, str]:
    """(cache, setting, value) of one ``--cache-config`` item; ValueError with Triton's text."""
    name, comma, rest = item.partition(",")
    if not comma or not name:
        raise ValueError(f"No cache specified. --cache-config option format is <cache name>,<setting>=<value>. "
                         f"Got {item}")
    setting, equals, value = rest.partition("=")
    if not equals or not setting or not value:
        raise ValueError(f"--cache-config option format is {FORMAT}. Got {item}")
    return name, setting, value


def response_cache(args: argparse.Namespace) -> tuple[int, list[tuple[int, str]]]:
    """(the response cache's size in bytes, 0 for none; the notices the flags call for).
    ValueError says what Triton would refuse, in its words where it has them."""
    notices: list[tuple[int, str]] = []
    if args.cache_directory is not None:
        notices.append((logging.INFO, f"--cache-directory {args.cache_directory}: the local cache is built in; "
                                      f"no cache library is loaded"))
    if args.response_cache_byte_size is not None:
        if args.cache_config:
            raise ValueError("Error: Incompatible flags --response-cache-byte-size and --cache-config both "
                             "provided. Please provide one or the other.")
        size = args.response_cache_byte_size
        notices.append((logging.WARNING, f"'--response-cache-byte-size' has been deprecated! This will default to "
                                         f"the 'local' cache implementation with the provided byte size for its "
                                         f"config. Please use '--cache-config' instead. The equivalent "
                                         f"--cache-config CLI args would be: '--cache-config=local,size={size}'"))
        settings = {"size": str(size)}  # 0 too: Triton 2.51 refuses it as any size too small
    elif args.cache_config:
        caches: dict[str, dict[str, str]] = {}
        for item in args.cache_config:
            name, setting, value = parse_setting(item)
            caches.setdefault(name, {})[setting] = value
        if len(caches) > 1:
            raise ValueError("found multiple cache configurations, but only a single cache is currently supported")
        name, settings = next(iter(caches.items()))
        if name != "local":
            raise ValueError(f"--cache-config {name}: no such cache here; shmserve has Triton's 'local' cache only")
    else:
        return 0, notices
    for setting, value in settings.items():
        if setting != "size":
            notices.append((logging.WARNING, f"--cache-config local,{setting}={value}: the local cache has no "
                                             f"setting '{setting}'; ignored"))
    if "size" not in settings:
        raise ValueError("Failed to initialize LocalCache: config didn't contain a valid 'size' field.")
    try:
        size = int(settings["size"])
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"Failed to initialize LocalCache: 'size' must be a number of bytes, got "
                         f"'{settings['size']}'")
    from shmserve.shm.response_cache import MIN_BYTES

    if size < MIN_BYTES:
        raise ValueError(f"Failed to initialize LocalCache: a size of {size} bytes is too small (at least "
                         f"{MIN_BYTES})")
    free = _shm_free_bytes()
    if free is not None and size > free:
        raise ValueError(f"Failed to initialize LocalCache: {size} bytes do not fit in /dev/shm ({free} bytes free)")
    return size, notices


def _shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, where the cache lives (a cache larger would crash its writers)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
