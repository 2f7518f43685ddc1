"""The error a batch's requests get when a model's ``execute`` raises, in the words of Triton's
Python backend: the instance and the exception; for a Python model also its frames "At:",
innermost first, as Triton's stub prints them (pybind11's format). Clients match on the first
part; the frames tell the model's author where it broke without reading the server's log."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import traceback

# Frames that are not the model's: the server's own code, which calls ``execute`` and runs an async
# one on its loop, and the standard library's asyncio and futures, which hand its result back.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_THE_MODEL = tuple(os.path.join(_ROOT, d, "") for d in ("workers", "shm", "server", "shmserve")) + \
    tuple(os.path.join(os.path.dirname(m.__file__), "") for m in (asyncio, concurrent.futures))


def execute_failure(instance: str, e: BaseException, frames: bool = True) -> str:
    """Triton's text for ``e`` raised by the ``execute`` of the instance named ``instance``;
    ``frames``: with the model's frames (a Python model's, whose code its author reads), and an
    exception with no message said as Triton's stub says it."""
    try:
        message = str(e)
    except Exception:  # noqa: BLE001 - a model's exception whose __str__ raises
        message = "<exception str() failed>"
    if frames and not message:
        message = "<EMPTY MESSAGE>"
    text = f"Failed to process the request(s) for model '{instance}', message: {type(e).__name__}: {message}"
    model_frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(_NOT_THE_MODEL)] \
        if frames else []
    if model_frames:
        text += "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(model_frames))
    return text
