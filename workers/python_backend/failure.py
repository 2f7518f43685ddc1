"""The error a Python model's requests get when its ``execute`` raises, in the words of Triton's
Python backend: the instance, the exception, and the model's frames "At:", innermost first, as
the stub prints them (pybind11's format). Clients match on the first part; the frames tell the
model's author where it broke without reading the server's log."""
from __future__ import annotations

import traceback
from pathlib import Path

# The server's own code, whose frames lead to the model's ``execute``: not the model's frames.
_OURS = tuple(str(Path(__file__).resolve().parents[2] / d) + "/" for d in ("workers", "shm", "server", "shmserve"))


def execute_failure(instance: str, e: BaseException) -> str:
    """Triton's text for ``e`` raised by the ``execute`` of the instance named ``instance``."""
    text = f"Failed to process the request(s) for model '{instance}', message: {type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    first = next((i for i, f in enumerate(frames) if not f.filename.startswith(_OURS)), len(frames))
    model_frames = frames[first:]
    if model_frames:
        text += "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(model_frames))
    return text
