"""The model and inputs behind docs/performance.md's figures for streams a client reads more slowly
than its model writes: ``chatter``, a decoupled Python model that sends COUNT responses of SIZE
bytes as fast as it can, and perf_analyzer-format input files that ask it for each stream shape.

    python -m shmserve.tools.stream_models DIR [--shape 5000x16 --shape 1000x65536 --shape 100x1048576]

writes ``DIR/repo/chatter`` and ``DIR/<COUNT>x<SIZE>.json`` for each ``--shape``; then serve
``DIR/repo`` from the two builds to compare (a worktree of the older commit, say) and time one
stream at a time with shmserve-perf, the servers in turns::

    shmserve-perf -m chatter -i grpc -u 127.0.0.1:18941 --name old --compare new=grpc:127.0.0.1:18931 \\
        --input-data DIR/1000x65536.json --concurrency-range 1 --pairs 4
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIG = """name: "chatter"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "SIZE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """COUNT responses of SIZE bytes each, sent as fast as the sender takes them, then the final flag."""

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            out = np.full(size, 7, np.uint8)
            sender = request.get_response_sender()
            for _ in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

SHAPES = ("5000x16", "1000x65536", "100x1048576")  # the rows of docs/performance.md's table


def shape(text: str) -> str:
    """A ``--shape``: COUNTxSIZE, two positive integers."""
    count, sep, size = text.lower().partition("x")
    if not (sep and count.isdigit() and size.isdigit() and int(count) > 0 and int(size) > 0):
        raise argparse.ArgumentTypeError(f"'{text}' is not COUNTxSIZE (two positive integers, as 1000x65536)")
    return f"{int(count)}x{int(size)}"


def write(folder: Path, shapes: list[str]) -> list[Path]:
    """The repository (``folder/repo``) and one input file per shape; the files written."""
    model = folder / "repo" / "chatter"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(MODEL)
    written = []
    for shape in shapes:
        count, size = (int(x) for x in shape.lower().split("x"))
        path = folder / f"{count}x{size}.json"
        path.write_text(json.dumps({"data": [{"COUNT": [count], "SIZE": [size]}]}))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.stream_models", description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="where to write repo/chatter and the input files")
    p.add_argument("--shape", action="append", type=shape, metavar="COUNTxSIZE",
                   help=f"responses a stream and bytes a response; repeatable (default: {' '.join(SHAPES)})")
    args = p.parse_args(argv)
    for path in write(args.folder, args.shape or list(SHAPES)):
        print(path)
    print(args.folder / "repo")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
