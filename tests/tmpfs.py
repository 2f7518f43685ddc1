"""A tmpfs of a given size mounted on a test's folder (as root), for what /dev/shm holds."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def mounted(folder: Path, size: str, mode: str = "1777") -> Iterator[Path]:
    """``folder`` (made here) with a tmpfs of ``size`` ("8m", "4g") on it until the block ends;
    a tmpfs takes only the pages written, whatever its size."""
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
