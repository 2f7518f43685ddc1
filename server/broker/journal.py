"""What the broker must hand on to the broker the launcher starts after it dies.

Clients change server state through the API: explicit-mode model loads and unloads, regions
registered over HTTP, log and trace settings. That state lives in the broker's memory, so a
broker that crashes would take it along and the restarted one would serve something nobody asked
for. The broker writes that state here after each change, and a new broker reads it at start.

The journal is one small JSON file in /dev/shm named like every other object of the server
(``/shmserve.<id>.state.0``): the launcher keeps it when it cleans up after a dead broker and
removes it with everything else when the server stops (or when a later start finds a dead
server's objects), so it spans the broker restarts of one server's life and no more. Each write
goes to a new temporary file first (made with O_EXCL under a name no one can guess) and is
renamed into place, so a broker killed mid-write leaves the previous journal whole, and nothing
another user put at a name of ours is written through. /dev/shm is every user's: a journal is
read only if it is the server's user's alone (owner, mode, one name), since what it says (a log
file, a model's folder) the broker acts on as that user.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import orjson

from shmserve.shm.access import not_ours_alone
from shmserve.shm.names import SHM_DIR, object_name

log = logging.getLogger("shmserve.broker")

ROLE = "state"


def journal_path(server_id: str) -> str:
    return SHM_DIR + object_name(server_id, ROLE, 0)


class Journal:
    """The state to restore, by topic ("models", "regions", "cuda_regions", "log", "trace")."""

    def __init__(self, server_id: str) -> None:
        self.path = journal_path(server_id)
        self.restarted = False  # a broker before this one left its journal: this is a restart
        self.state: dict[str, Any] = self._read()
        if not self.restarted:
            self._write()

    def _read(self) -> dict[str, Any]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as e:  # (a link: ELOOP) a damaged journal must not stop the broker
            log.error("cannot read the state a previous broker left (%s); starting without it", e)
            return self._not_ours()
        try:
            why = not_ours_alone(os.fstat(fd))
            if why:
                log.error("%s is not the server's own journal (%s): ignored and removed; starting without the "
                          "state a previous broker left", self.path, why)
                return self._not_ours()
            self.restarted = True  # (a journal of ours, damaged or not: a broker was here before)
            with os.fdopen(os.dup(fd), "rb") as f:
                state = orjson.loads(f.read())
        except (OSError, ValueError) as e:  # a damaged journal must not stop the broker
            log.error("cannot read the state a previous broker left (%s); starting without it", e)
            return {}
        finally:
            os.close(fd)
        return state if isinstance(state, dict) else {}

    def _not_ours(self) -> dict[str, Any]:
        """Remove what is at the journal's name (another user's, in a sticky /dev/shm, stays
        where the server may not remove it, and journal writes then fail, said)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        return {}

    def get(self, topic: str, default: Any = None) -> Any:
        return self.state.get(topic, default)

    def set(self, topic: str, value: Any) -> None:
        if topic in self.state and self.state[topic] == value:
            return
        self.state[topic] = value
        self._write()

    def _write(self) -> None:
        tmp = ""
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=os.path.basename(self.path) + ".")
            with os.fdopen(fd, "wb") as f:  # (mkstemp: O_EXCL, mode 0600)
                f.write(orjson.dumps(self.state))
            os.replace(tmp, self.path)
        except OSError as e:  # /dev/shm full: serving goes on, a restart would lose this change
            log.error("cannot record server state for a broker restart: %s", e)
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
