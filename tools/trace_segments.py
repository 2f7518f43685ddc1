"""Where a request's time goes, segment by segment, from trace files in Triton's format: the
median time between each timestamp and the next, for one or more servers side by side.

Triton writes one object per timestamp and shmserve one per request; both carry the request's
``id``, so records are grouped by id and read alike. Only requests with every timestamp of the
path count (an HTTP ``/infer`` or a gRPC ``ModelInfer``: the two stamp names of the frontend
differ; a file holds one or the other). Run it on the files of a trace
taken with ``--trace-config level=TIMESTAMPS`` (docs/performance.md, "Where the time goes, target
by target")::

    python -m shmserve.tools.trace_segments triton='/tmp/tt/trace.json*' shmserve='/tmp/st/trace.json*'
"""
from __future__ import annotations

import argparse
import glob
import statistics
from typing import Iterable

from shmserve.shm.trace import GRPC_STAMPS, STAMPS, read_trace_file

RESPONSE_COMPLETE = "INFER_RESPONSE_COMPLETE"


def requests(files: Iterable[str]) -> list[dict[str, int]]:
    """Each traced request's timestamps (name to ns, the first of a name kept), from every file."""
    by_id: dict[int, dict[str, int]] = {}
    for path in files:
        for record in read_trace_file(path):
            stamps = by_id.setdefault(record["id"], {})
            for t in record.get("timestamps", ()):
                stamps.setdefault(t["name"], t["ns"])
    return list(by_id.values())


def segments(traced: list[dict[str, int]]) -> tuple[tuple[str, ...], list[float], int]:
    """(the path's stamp names, median µs from each to the next, the requests counted)."""
    # (with and without INFER_RESPONSE_COMPLETE, which files written before it was stamped lack)
    paths = [p for names in (STAMPS, GRPC_STAMPS) for p in (names, tuple(n for n in names if n != RESPONSE_COMPLETE))]
    path = next((p for p in paths if any(all(n in r for n in p) for r in traced)), None)
    if path is None:
        return (), [], 0
    whole = [r for r in traced if all(n in r for n in path)]
    medians = [statistics.median((r[b] - r[a]) / 1e3 for r in whole) for a, b in zip(path, path[1:])]
    medians.append(statistics.median((r[path[-1]] - r[path[0]]) / 1e3 for r in whole))
    return path, medians, len(whole)


def table(servers: list[tuple[str, list[dict[str, int]]]]) -> str:
    """A markdown table: a row per segment, a column per server."""
    columns = [(name, *segments(traced)) for name, traced in servers]
    path = next((c[1] for c in columns if c[1]), None)
    if path is None:
        raise SystemExit("no request with every timestamp of an HTTP or gRPC path in these files")
    rows = [f"{a} to {b}" for a, b in zip(path, path[1:])] + ["the whole request in the server", "requests"]
    lines = ["| segment, µs | " + " | ".join(c[0] for c in columns) + " |", "| --- |" + " --- |" * len(columns)]
    for k, row in enumerate(rows):
        cells = []
        for _, _, medians, count in columns:
            if k == len(rows) - 1:
                cells.append(str(count))
            else:
                cells.append(f"{medians[k]:.1f}" if medians else "")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("servers", nargs="+", metavar="NAME=GLOB", help="a server's name and its trace files")
    args = p.parse_args(argv)
    servers = []
    for spec in args.servers:
        name, _, pattern = spec.partition("=")
        files = sorted(glob.glob(pattern))
        if not name or not files:
            raise SystemExit(f"{spec!r}: expected NAME=GLOB matching trace files")
        servers.append((name, requests(files)))
    print(table(servers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
