"""Train the small CNN behind ``model_repository/digits`` and export it as TorchScript.

The data is scikit-learn's bundled ``load_digits`` set (1797 8x8 grayscale
images), so training needs no network access and takes a few seconds on a CPU.
This gives the repository a real model whose answers can be checked, rather
than an identity or random-weight stand-in.

Usage (from the project root)::

    python tools/train_digits.py                # writes model_repository/digits/1/model.pt
    python tools/train_digits.py --epochs 30 --output /tmp/model.pt

Serving contract (must match ``model_repository/digits/config.pbtxt``):
    INPUT__0   float32 [batch, 1, 8, 8], pixel values scaled to [0, 1]
    OUTPUT__0  float32 [batch, 10], unnormalised logits (argmax = digit)
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = PROJECT_ROOT / "model_repository" / "digits" / "1" / "model.pt"

# Kept in sync with tools/digits_client.py so the client samples the same
# held-out images the reported test accuracy was measured on.
TEST_SIZE = 0.2
SPLIT_SEED = 0
# load_digits pixels are integers 0..16; dividing maps them onto [0, 1].
PIXEL_MAX = 16.0


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 pool and a linear head (~10k parameters).

    Small enough that the committed TorchScript file stays well under 1 MB and
    inference is cheap, yet accurate enough (>95%) that a wrong batching or
    tensor-layout bug in the server shows up as wrong predictions.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[batch, 1, 8, 8]`` pixels in [0, 1] to ``[batch, 10]`` logits."""
        return self.classifier(torch.flatten(self.features(x), 1))


def make_deterministic(seed: int) -> None:
    """Seed every RNG and pin CPU kernels so two runs give identical weights.

    One intra-op thread keeps floating-point reduction order fixed across
    machines with different core counts; at this model size it costs nothing.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)`` as tensors in the serving layout."""
    digits = load_digits()
    images = (digits.images / PIXEL_MAX).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=labels
    )
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
            torch.from_numpy(x_te), torch.from_numpy(y_te))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int,
          batch_size: int, lr: float, seed: int) -> None:
    """Plain Adam + cross-entropy; a dedicated generator makes shuffling reproducible."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for start in range(0, len(x), batch_size):
            idx = perm[start:start + batch_size]
            opt.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        if epoch == 1 or epoch % 5 == 0 or epoch == epochs:
            print(f"epoch {epoch:3d}  train loss {total / len(x):.4f}")


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` whose argmax logit equals the label."""
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def export(model: nn.Module, output: Path, check_input: torch.Tensor) -> torch.Tensor:
    """Trace the model, save it, reload it and check the reload predicts identically.

    ``torch.jit.trace`` rather than ``script``: scripted modules serialise
    ``__constants__`` in set order, which depends on PYTHONHASHSEED, so the same
    weights would produce a different file on every run. The traced graph has no
    data-dependent control flow and ``flatten(x, 1)`` keeps the batch dimension
    symbolic, so any batch size from 1 to max_batch_size works (checked below).
    Saving through a buffer keeps the output path out of the zip's record names,
    so retraining gives a byte-identical file wherever it is written.
    Returns the reloaded model's logits for ``check_input``.
    """
    model.eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, check_input[:4])
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(buf.getvalue())

    loaded = torch.jit.load(str(output), map_location="cpu")
    loaded.eval()
    with torch.no_grad():
        before = model(check_input)
        after = loaded(check_input)
        # Odd sizes and the config's max_batch_size, to prove the trace is not
        # specialised to the 4-row example batch.
        for size in (1, 7, 64):
            if not torch.equal(model(check_input[:size]), loaded(check_input[:size])):
                raise RuntimeError(f"reloaded model disagrees at batch size {size}")
        single = torch.cat([loaded(check_input[i:i + 1]) for i in range(len(check_input))])
    if not torch.equal(before, after):
        raise RuntimeError("reloaded TorchScript model disagrees with the in-memory model")
    if not torch.equal(before.argmax(1), single.argmax(1)):
        raise RuntimeError("batch-of-1 predictions differ from batched predictions")
    return after


def main(argv: list[str] | None = None) -> int:
    """Train, report test accuracy, export; exit non-zero if accuracy is too low."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help=f"TorchScript file to write (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.95,
                        help="fail (exit 1) below this test accuracy instead of exporting")
    args = parser.parse_args(argv)

    make_deterministic(args.seed)
    x_tr, y_tr, x_te, y_te = load_split()
    model = DigitsCNN()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {len(x_tr)}  test {len(x_te)}  parameters {n_params}")

    train(model, x_tr, y_tr, epochs=args.epochs, batch_size=args.batch_size,
          lr=args.lr, seed=args.seed)
    acc = accuracy(model, x_te, y_te)
    print(f"test accuracy {acc:.4f} ({round(acc * len(y_te))}/{len(y_te)})")
    if acc < args.min_accuracy:
        print(f"accuracy below --min-accuracy {args.min_accuracy}; not exporting", file=sys.stderr)
        return 1

    logits = export(model, args.output, x_te)
    reload_acc = (logits.argmax(1) == y_te).float().mean().item()
    print(f"reloaded TorchScript accuracy {reload_acc:.4f}; matches in-memory model exactly")
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
