"""Work for a client that may leave before it is answered: a handler that waits for a model
(``/generate``, the OpenAI routes without ``stream``) would otherwise notice a disconnect only
when it sends the answer, and the model would run to its end for nobody. ``unless_gone`` waits
for the work and for the client's ``http.disconnect`` together (uvicorn's ``receive`` returns it
once the body is read), and cancels the work when the client leaves first: a reader's
``finally`` closes its ``StreamEvents``, which cancels the request (its model sees
``is_cancelled()``, a queued one never runs). Streamed answers need none of this: Starlette's
``StreamingResponse`` listens for the disconnect itself.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict]]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody reads one."""


async def unless_gone(work: Awaitable[T], receive: Receive) -> T:
    """``work``'s result; ClientGone (``work`` cancelled) if the client disconnects first."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (gone, task):  # the handler itself may be cancelled (shutdown): cancel both
            if not f.done():
                f.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its finally ran: the request is cancelled, what it held freed
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> Any:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a connection that fails is as gone as one that closed
        return
