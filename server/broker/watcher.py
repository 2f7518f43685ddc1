"""``--model-control-mode=poll``: watchdog observers on the repositories, debounced.

Every file-system event under a repository names a model (the first folder of its path). The
broker reloads a model once its folder has been quiet for the debounce time, so a folder still
being copied is not loaded half-written (publishing by atomic rename avoids even that wait).
Dot-folders and editor temporaries are ignored. Changes no event reports (network mounts,
linked folders) reach the same table from the periodic scan (repository_scan.py).
"""
from __future__ import annotations

import os
import threading
import time
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from shmserve.shm.waker import Waker

DEBOUNCE_S = 0.2
_TEMP_SUFFIXES = ("~", ".swp", ".swx", ".swo", ".tmp", ".part", ".crdownload")


def ignored(name: str) -> bool:
    """Hidden folders, editor temporaries, and the bytecode Python writes when it imports model.py."""
    return (name.startswith(".") or name.startswith("#") or name.endswith(_TEMP_SUFFIXES)
            or name == "__pycache__" or name.endswith(".pyc"))


class _Handler(FileSystemEventHandler):
    def __init__(self, repo: str, watcher: "RepositoryWatcher") -> None:
        self.repo = os.path.abspath(repo)
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads (our own workers load the models) change nothing
        if event.event_type == "modified" and event.is_directory:
            # An entry inside was created, removed or renamed: that entry has its own event,
            # judged by its own name (so an editor's 'config.pbtxt~' reloads nothing).
            return
        for path in (event.src_path, getattr(event, "dest_path", "") or ""):
            if not path:
                continue
            rel = os.path.relpath(os.fsdecode(path), self.repo)
            if rel == "." or rel.startswith(".."):
                continue
            parts = rel.split(os.sep)
            if any(ignored(p) for p in parts):
                continue
            self.watcher.changed(parts[0], os.path.join("", *parts[1:]))


class RepositoryWatcher:
    def __init__(self, repositories: list[str], waker: Waker, keep_paths: bool = False,
                 debounce_s: float = DEBOUNCE_S) -> None:
        self.waker = waker  # the broker's doorbell: a change wakes its loop
        self.debounce_s = debounce_s
        self._changes: dict[str, float] = {}  # model -> its last change (monotonic), not yet due
        # With the periodic scan: the paths events named per model, until the scan takes them.
        self._paths: dict[str, set[str]] | None = {} if keep_paths else None
        self._lock = threading.Lock()
        self.observer = Observer()
        for repo in repositories:
            self.observer.schedule(_Handler(repo, self), repo, recursive=True)
        self.observer.daemon = True
        self.observer.start()

    def changed(self, model: str, path: str | None = None) -> None:
        """``model`` changed: at ``path`` in its folder ('' the folder itself) for an event, None
        for the scan."""
        with self._lock:
            self._changes[model] = time.monotonic()
            if path is not None and self._paths is not None:
                self._paths.setdefault(model, set()).add(path)
        self.waker.post()

    def take_event_paths(self) -> dict[str, set[str]]:
        """The paths events named since the last call, per model."""
        with self._lock:
            if self._paths is None:
                return {}
            paths, self._paths = self._paths, {}
        return paths

    def due(self) -> list[str]:
        """Models whose folders have been quiet for the debounce time (each reported once)."""
        now = time.monotonic()
        with self._lock:
            ready = [m for m, t in self._changes.items() if now - t >= self.debounce_s]
            for m in ready:
                del self._changes[m]
        return ready

    def next_due(self) -> float | None:
        with self._lock:
            if not self._changes:
                return None
            return max(0.0, min(self._changes.values()) + self.debounce_s - time.monotonic())

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=2)
