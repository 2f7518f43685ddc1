"""A frontend call cancelled while it waits for its answer (server/edge/link.py ``completion_of``):
a gRPC client's deadline or cancel cancels the handler's task, sometimes just after the answer
was set on its future and before the task ran again. That answer must be freed then, with the
request's own block: unread, each pins its arena (a producer's FIFO arena cannot pass a block
whose consumer still lives) for as long as the frontend runs."""
from __future__ import annotations

import asyncio

import pytest

from shmserve.server.edge.link import completion_of
from shmserve.shm.arena import Arena
from shmserve.shm.completion import Completion
from segments import segment_pair  # noqa: F401  (a fixture: real segments, mapped twice)

SIZE = 4096


def arenas(segment_pair) -> tuple[Arena, Arena, Completion]:
    """A producer's arena holding an answer's block and a client's holding the request's, and the
    completion a frontend's callback gets for them (over the consumer's own mappings)."""
    producer, producer_view = segment_pair(SIZE)
    client, client_view = segment_pair(SIZE)
    answers, requests = Arena(producer.buf, 0, SIZE), Arena(client.buf, 0, SIZE)
    answer_at, request_at = answers.alloc(100), requests.alloc(100)
    completion = Completion(200, producer_view.buf, answer_at, request=(client_view.buf, request_at), end=SIZE)
    return answers, requests, completion


def test_an_answer_that_came_just_before_the_cancel_is_freed(segment_pair):
    answers, requests, completion = arenas(segment_pair)

    async def scenario() -> None:
        fut = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(completion_of(fut))
        await asyncio.sleep(0)  # the call waits on its future
        fut.set_result(completion)  # the answer comes ...
        waiting.cancel()  # ... and the client's deadline, before the call's task runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())
    assert answers.drained() and requests.drained()  # both blocks were given back


def test_an_answer_awaited_to_the_end_is_the_callers_to_free(segment_pair):
    answers, requests, completion = arenas(segment_pair)

    async def scenario() -> Completion:
        fut = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(completion_of(fut))
        await asyncio.sleep(0)
        fut.set_result(completion)
        return await waiting

    got = asyncio.run(scenario())
    assert got is completion and not answers.drained() and not requests.drained()
    got.release()
    assert answers.drained() and requests.drained()


def test_a_call_cancelled_before_its_answer_leaves_the_future_cancelled(segment_pair):
    """The request's callback then sees a done future and frees the answer itself when it comes
    (the pattern of every frontend callback: ``if fut.done(): completion.release()``)."""
    answers, requests, completion = arenas(segment_pair)

    async def scenario() -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(completion_of(fut))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return fut

    fut = asyncio.run(scenario())
    assert fut.cancelled() and not answers.drained()
    completion.release()  # what the callback does when the answer comes
    assert answers.drained() and requests.drained()
