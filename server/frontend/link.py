"""The frontend's way to the broker: a shm ``Connection`` bridged onto the asyncio loop.

Completions arrive on the connection's waiter thread and are handed to the loop with
``call_soon_threadsafe``; the loop itself never blocks on a semaphore. If the broker restarts, the
next request opens a fresh connection; meanwhile requests get a 503 instead of hanging.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from shm.connection import Backpressure, Completion, Connection, ServerUnavailable
from shm.protocol import REQ_CONTROL, REQ_INFER


class BrokerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _resolve(fut: asyncio.Future, completion: Completion) -> None:
    if fut.done():  # the HTTP client went away; free the answer nobody will read
        completion.release()
    else:
        fut.set_result(completion)


class BrokerLink:
    def __init__(self, server_id: str, arena_bytes: int) -> None:
        self.server_id = server_id
        self.arena_bytes = arena_bytes
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def connection(self) -> Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        with self._lock:
            if self._conn is not None and not self._conn.alive:
                self._conn.close()
                self._conn = None
            if self._conn is None:
                try:
                    self._conn = Connection(self.server_id, arena_bytes=self.arena_bytes)
                except ServerUnavailable as e:
                    raise BrokerError(503, f"the server is not available: {e}") from None
            return self._conn

    async def call(self, kind: int, doc: dict, tensors: Any = ()) -> Completion:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        conn = self.connection()
        try:
            conn.submit(kind, doc, tensors, lambda c: loop.call_soon_threadsafe(_resolve, fut, c))
        except Backpressure as e:
            raise BrokerError(503, str(e)) from None
        except ServerUnavailable as e:
            raise BrokerError(503, str(e)) from None
        return await fut

    async def infer(self, doc: dict, tensors: Any) -> Completion:
        return await self.call(REQ_INFER, doc, tensors)

    async def control(self, doc: dict) -> tuple[int, Any]:
        completion = await self.call(REQ_CONTROL, doc)
        try:
            return completion.status, completion.doc()
        finally:
            completion.release()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
