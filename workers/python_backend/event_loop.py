"""The event loop of a model whose ``execute`` is ``async def``, as Triton's Python stub keeps one.

The loop runs for the life of the instance in its own thread. A non-decoupled model's coroutine
runs there while the worker waits for its responses; a decoupled model's coroutine is only started
there: the worker goes back to its lanes at once and takes the next request, so the coroutines of
many requests run concurrently (as in Triton, where the stub does not wait for them). Their
responses reach the clients through the requests' senders, from the loop's thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable

log = logging.getLogger("shmserve.worker")

DRAIN_TIMEOUT_S = 60.0


class EventLoop:
    """One asyncio loop in a daemon thread, started on first use."""

    def __init__(self, thread_setup: Callable[[], Any] | None = None) -> None:
        # thread_setup runs first on the loop's thread (e.g. to make the instance's GPU current there).
        self._thread_setup = thread_setup
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run, name="model-event-loop", daemon=True)
            self._thread.start()
        return self._loop

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        if self._thread_setup is not None:
            self._thread_setup()
        self._loop.run_forever()

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result (a non-decoupled model's execute)."""
        return asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self._running_loop()).result()

    def start(self, coro: Awaitable[Any], on_error: Callable[[BaseException], None]) -> None:
        """Start ``coro`` on the loop without waiting for it (a decoupled model's execute);
        ``on_error`` runs on the loop's thread if it raises, so that its requests still end."""
        asyncio.run_coroutine_threadsafe(_detached(coro, on_error), self._running_loop())

    def close(self) -> None:
        """Let the coroutines still running finish (their clients wait for them), then stop."""
        loop = self._loop
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(_drain(), loop).result(DRAIN_TIMEOUT_S)
        except concurrent.futures.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
            log.warning("coroutines of execute() still running after %.0f s; stopping the loop", DRAIN_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5.0)
        self._loop = None


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    """run_coroutine_threadsafe takes coroutines only; execute() may return any awaitable."""
    return await awaitable


async def _detached(coro: Awaitable[Any], on_error: Callable[[BaseException], None]) -> None:
    try:
        await coro
    except Exception as e:  # noqa: BLE001 - model code may raise anything
        on_error(e)


async def _drain() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others)
