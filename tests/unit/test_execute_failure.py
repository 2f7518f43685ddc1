"""The text a Python model's requests get when its execute raises (workers/failure.py):
Triton's words, then the model's frames innermost first, without the frames of the code that ran it."""
from __future__ import annotations

import concurrent.futures

from shmserve.workers.failure import execute_failure


def _inner() -> None:
    raise ValueError("bad value 1.5")


def _execute() -> None:
    _inner()


def test_the_model_s_frames_innermost_first_without_the_futures_that_handed_them_back():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as an async execute's result comes back
        try:
            pool.submit(_execute).result()
        except ValueError as e:
            text = execute_failure("m_0", e)
    head, frames = text.split("\n\nAt:\n")
    assert head == "Failed to process the request(s) for model 'm_0', message: ValueError: bad value 1.5"
    names = [line.rsplit(": ", 1)[1] for line in frames.splitlines()]
    assert names[:2] == ["_inner", "_execute"] and "concurrent" not in frames, frames
    assert frames.startswith(f"  {__file__}(")


def test_an_exception_that_cannot_be_printed():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    text = execute_failure("m_0", Unprintable())
    assert text == "Failed to process the request(s) for model 'm_0', message: Unprintable: <exception str() failed>"


def test_without_frames_for_a_model_that_is_not_python_code():
    try:
        _execute()
    except ValueError as e:
        assert execute_failure("m_0", e, frames=False) == \
            "Failed to process the request(s) for model 'm_0', message: ValueError: bad value 1.5"


def test_an_exception_with_no_message_is_said_as_tritons_stub_says_it():
    class TritonModelException(Exception):
        pass

    text = execute_failure("m_0", TritonModelException())
    assert text == "Failed to process the request(s) for model 'm_0', message: TritonModelException: <EMPTY MESSAGE>"
