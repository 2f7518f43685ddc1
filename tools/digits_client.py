"""Send held-out sklearn digits to a running server and check its predictions.

An end-to-end smoke test for the ``digits`` model in ``model_repository``: it
speaks plain KServe v2 HTTP through ``tritonclient.http``, so it works the same
against shmserve or a stock Triton server. Needs only tritonclient, numpy and
scikit-learn (no torch), so it can run on a machine without the model's stack.

Usage::

    python tools/digits_client.py                       # localhost:8000, 16 images
    python tools/digits_client.py --url host:8000 --count 100 --batch-size 32
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import tritonclient.http as httpclient
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

INPUT_NAME = "INPUT__0"
OUTPUT_NAME = "OUTPUT__0"
MAX_BATCH_SIZE = 64  # config.pbtxt max_batch_size

# Same split as tools/train_digits.py (duplicated so this file needs no torch):
# the images sent are ones the model never trained on.
TEST_SIZE = 0.2
SPLIT_SEED = 0
PIXEL_MAX = 16.0


def held_out_digits() -> tuple[np.ndarray, np.ndarray]:
    """Return the test split as float32 ``[n, 1, 8, 8]`` in [0, 1] plus int labels."""
    digits = load_digits()
    images = (digits.images / PIXEL_MAX).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    _, x_test, _, y_test = train_test_split(
        images, labels, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=labels
    )
    return x_test, y_test


def infer(client: httpclient.InferenceServerClient, model: str, batch: np.ndarray,
          binary: bool) -> np.ndarray:
    """Run one request and return its ``[batch, 10]`` logits."""
    inp = httpclient.InferInput(INPUT_NAME, list(batch.shape), "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(batch), binary_data=binary)
    out = httpclient.InferRequestedOutput(OUTPUT_NAME, binary_data=binary)
    result = client.infer(model, inputs=[inp], outputs=[out])
    logits = result.as_numpy(OUTPUT_NAME)
    if logits is None or logits.shape != (len(batch), 10):
        got = None if logits is None else logits.shape
        raise RuntimeError(f"expected {OUTPUT_NAME} of shape {(len(batch), 10)}, got {got}")
    return logits


def main(argv: list[str] | None = None) -> int:
    """Query the server, print predicted vs true labels; exit 1 if any request fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000",
                        help="server HTTP endpoint, host:port (default: localhost:8000)")
    parser.add_argument("--model", default="digits", help="model name (default: digits)")
    parser.add_argument("--count", type=int, default=16,
                        help="number of held-out images to send (default: 16, max 360)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help=f"images per request, 1..{MAX_BATCH_SIZE} (default: 8)")
    parser.add_argument("--json", action="store_true",
                        help="send tensors as JSON instead of the binary extension")
    args = parser.parse_args(argv)
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        parser.error(f"--batch-size must be between 1 and {MAX_BATCH_SIZE}")

    x, y = held_out_digits()
    x, y = x[:args.count], y[:args.count]
    if len(x) == 0:
        parser.error("--count must be at least 1")

    client = httpclient.InferenceServerClient(url=args.url)
    try:
        if not client.is_model_ready(args.model):
            print(f"model {args.model!r} is not ready at {args.url}", file=sys.stderr)
            return 1
        preds = np.concatenate([
            infer(client, args.model, x[i:i + args.batch_size], binary=not args.json).argmax(1)
            for i in range(0, len(x), args.batch_size)
        ])
    except ConnectionRefusedError as exc:  # no server there yet
        print(f"inference failed: no server answers at {args.url} ({exc}): start one with `make serve` "
              f"in another shell, or pass --url", file=sys.stderr)
        return 1
    except OSError as exc:  # host unknown, connection reset mid-run
        print(f"inference failed: {args.url}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # HTTP errors, shape mismatch
        print(f"inference failed: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()

    print(" idx  true  pred")
    for i, (t, p) in enumerate(zip(y, preds)):
        print(f"{i:4d}  {t:4d}  {p:4d}{'' if t == p else '  <- wrong'}")
    correct = int((preds == y).sum())
    print(f"accuracy {correct}/{len(y)} = {correct / len(y):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
