"""What the broker must hand on to the broker the launcher starts after it dies.

Clients change server state through the API: explicit-mode model loads and unloads, regions
registered over HTTP, log and trace settings. That state lives in the broker's memory, so a
broker that crashes would take it along and the restarted one would serve something nobody asked
for. The broker writes that state here after each change, and a new broker reads it at start.

The journal is one small JSON file in /dev/shm named like every other object of the server
(``/shmserve.<id>.state.0``): the launcher keeps it when it cleans up after a dead broker and
removes it with everything else when the server stops (or when a later start finds a dead
server's objects), so it spans the broker restarts of one server's life and no more. Each write
goes to a temporary name first and is renamed into place, so a broker killed mid-write leaves
the previous journal whole.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import orjson

from shmserve.shm.names import SHM_DIR, object_name

log = logging.getLogger("shmserve.broker")

ROLE = "state"


def journal_path(server_id: str) -> str:
    return SHM_DIR + object_name(server_id, ROLE, 0)


class Journal:
    """The state to restore, by topic ("models", "regions", "cuda_regions", "log", "trace")."""

    def __init__(self, server_id: str) -> None:
        self.path = journal_path(server_id)
        self.restarted = os.path.exists(self.path)  # a broker before this one started: this is a restart
        self.state: dict[str, Any] = self._read()
        if not self.restarted:
            self._write()

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                state = orjson.loads(f.read())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # a damaged journal must not stop the broker
            log.error("cannot read the state a previous broker left (%s); starting without it", e)
            return {}
        return state if isinstance(state, dict) else {}

    def get(self, topic: str, default: Any = None) -> Any:
        return self.state.get(topic, default)

    def set(self, topic: str, value: Any) -> None:
        if topic in self.state and self.state[topic] == value:
            return
        self.state[topic] = value
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as f:
                f.write(orjson.dumps(self.state))
            os.replace(tmp, self.path)
        except OSError as e:  # /dev/shm full: serving goes on, a restart would lose this change
            log.error("cannot record server state for a broker restart: %s", e)
