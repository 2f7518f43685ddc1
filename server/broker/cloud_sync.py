"""The broker's re-syncs of cloud repositories' local copies (cloud_repository.py) while it serves.

- Poll mode: each periodic scan (repository_scan.py, every ``--repository-poll-secs``) first calls
  ``sync_all``; what it changes in a copy reaches the watcher and the scan as any change of a local
  repository does, and the model reloads.
- Explicit mode: a load request (control.py) re-syncs that model's folder before the load reads
  it, as Triton reads the repository again on each load. The download runs on a thread of its own
  so the broker's loop serves on meanwhile; a finished sync waits in a list, the loop is woken, and
  control.py takes it (``take_synced``) and starts the load as any other. The thread touches
  nothing but the copies and that locked list.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from typing import Any

from shmserve.shm.waker import Waker

from .cloud_repository import CloudError, Mirror

log = logging.getLogger("shmserve.broker")


@dataclasses.dataclass
class SyncedLoad:
    """A load request whose model folder was synced (``error``: why it could not be)."""
    name: str
    config: str | None  # the request's 'config' parameter
    waiter: tuple[Any, int]  # (client, slot) to answer
    error: str | None = None
    cancelled: bool = False  # an unload of the model came after it: it must not load


class CloudSyncs:
    def __init__(self, copies: dict[str, str], waker: Waker) -> None:
        """``copies``: {local repository folder: its URL}, as the launcher made them."""
        self.mirrors = [Mirror(url, os.path.dirname(repository)) for repository, url in copies.items()]
        self.waker = waker
        self._requests: queue.Queue[SyncedLoad | None] = queue.Queue()
        self._pending: list[SyncedLoad] = []  # asked for, in order; the thread sets their outcome
        self._done: list[SyncedLoad] = []
        self._lock = threading.Lock()
        self._last_errors: dict[str, str] = {}  # poll mode: an error is logged when it starts, not every scan
        self._thread: threading.Thread | None = None

    def sync_all(self) -> None:
        """Poll mode, on the scan's thread: bring every copy up to date. A store that cannot be read
        leaves its copy as it is (what serves goes on serving); the error is logged once."""
        for mirror in self.mirrors:
            url = mirror.location.url
            try:
                mirror.sync()
            except CloudError as e:
                if self._last_errors.get(url) != str(e):
                    log.error("%s; serving its last copy", e)
                self._last_errors[url] = str(e)
            else:
                if self._last_errors.pop(url, None):
                    log.info("model repository '%s' can be read again", url)

    def request(self, name: str, config: str | None, waiter: tuple[Any, int]) -> None:
        """Explicit mode: sync ``name``'s folder, then hand the load back to the loop."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cloud-sync", daemon=True)
            self._thread.start()
        load = SyncedLoad(name, config, waiter)
        with self._lock:
            self._pending.append(load)
        self._requests.put(load)

    def cancel(self, name: str) -> None:
        """An unload of ``name``: the loads asked for before it must not load once synced."""
        with self._lock:
            for load in (*self._pending, *self._done):
                if load.name == name:
                    load.cancelled = True

    def has_synced(self) -> bool:
        with self._lock:
            return bool(self._done)

    def take_synced(self) -> list[SyncedLoad]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _run(self) -> None:
        while (load := self._requests.get()) is not None:
            for mirror in self.mirrors:  # the model may be in any of them: one listing each
                try:
                    mirror.sync(load.name)
                except CloudError as e:
                    load.error = f"failed to load '{load.name}', {e}"
                    break
            with self._lock:
                self._pending.remove(load)
                self._done.append(load)
            self.waker.post()

    def stop(self) -> None:
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=2)
