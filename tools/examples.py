"""Runs the bundled examples against a server started with `make serve` (or --url / --id).

    python tools/examples.py [pipeline|sequence|bls|stream|local|all]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import tritonclient.http as httpclient


def pipeline(url: str, server_id: str) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images[:10].astype(np.uint8)
    t = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
    t.set_data_from_numpy(images)
    result = httpclient.InferenceServerClient(url).infer("digits_pipeline", [t])
    print("ensemble digits_pipeline: labels", result.as_numpy("LABEL").reshape(-1).tolist(),
          "true", digits.target[:10].tolist())


def sequence(url: str, server_id: str) -> None:
    client = httpclient.InferenceServerClient(url)
    totals = []
    for i, value in enumerate([1.0, 2.5, 4.0]):
        t = httpclient.InferInput("VALUE", [1, 1], "FP32")
        t.set_data_from_numpy(np.array([[value]], np.float32))
        r = client.infer("running_sum", [t], sequence_id=7, sequence_start=i == 0, sequence_end=i == 2)
        totals.append(float(r.as_numpy("SUM")[0, 0]))
    print("sequence running_sum (1, 2.5, 4):", totals)


def bls(url: str, server_id: str) -> None:
    a, b = np.arange(16, dtype=np.int32), np.full(16, 2, np.int32)
    inputs = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(arr)
        inputs.append(t)
    r = httpclient.InferenceServerClient(url).infer("add_sub_bls", inputs)
    print("BLS add_sub_bls (a+b)*(a-b):", r.as_numpy("OUTPUT0").tolist())


def stream(url: str, server_id: str) -> None:
    from shmserve.shm.client import Client

    with Client(server_id) as client:
        words = [r["text_output"][0].decode() for r in
                 client.stream("word_stream", {"text_input": np.array([b"responses one by one"], dtype=object)})]
    print("decoupled word_stream via the local client:", words)


def local(url: str, server_id: str) -> None:
    from shmserve.shm.client import Client

    with Client(server_id) as client:
        region = client.create_region("example", 4096)
        a = region.array(np.int32, (16,))
        a[:] = np.arange(16)
        out = region.array(np.int32, (16,), offset=64)
        client.infer("add_sub", {"INPUT0": a, "INPUT1": a}, {"OUTPUT0": out})
        print("local client, zero copy in and out: OUTPUT0 =", out.tolist())


EXAMPLES = {"pipeline": pipeline, "sequence": sequence, "bls": bls, "stream": stream, "local": local}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", nargs="?", default="all", choices=[*EXAMPLES, "all"])
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--id", default="shmserve", help="the server's --id (for the local client)")
    args = p.parse_args()
    from tritonclient.utils import InferenceServerException

    from shmserve.shm.client import InferenceServerError
    from shmserve.shm.connection import NoServer, ServerUnavailable

    for name, fn in EXAMPLES.items():
        if args.which in (name, "all"):
            try:
                fn(args.url, args.id)
            except ServerUnavailable as e:  # the local client's: no server under that --id, or one it may not use
                hint = " (start one with `make serve`, or pass its --id)" \
                    if isinstance(e, NoServer) and "running here" not in str(e) else ""
                print(f"examples.py {name}: {e}{hint}", file=sys.stderr)
                return 1
            except OSError as e:  # connection refused, host unknown: no server there yet
                print(f"examples.py {name}: no server answers at {args.url} ({e}): start one with `make serve` "
                      f"in another shell, or pass --url", file=sys.stderr)
                return 1
            except (InferenceServerException, InferenceServerError) as e:  # a model missing, not ready ...
                print(f"examples.py {name}: {e}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
