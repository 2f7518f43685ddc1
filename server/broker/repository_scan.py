"""``--repository-poll-secs``: the periodic scan of poll mode, for what file events never report.

inotify hears nothing of changes made on another host to an NFS or FUSE mount, nor inside a
model folder that is a symbolic link (watchdog does not follow links). Every N seconds a thread
takes a snapshot of each model folder (the names, inodes, sizes and modification times of its
files) and reports a model whose snapshot differs from the last one to the same debounced
``RepositoryWatcher`` the events go to. The thread is its own because a stat on a slow mount may
take long, and the broker's loop must not wait for it; it touches nothing but the watcher's
locked table.

With cloud repositories (cloud_sync.py) each scan first re-syncs their local copies from the
store, so what changed in a bucket is found by the same comparison.

A change the events reported is not reported again: a changed path that an event named (or a
folder above it) was reloaded after that event, as the watcher debounces every event it hears.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Iterator

from .watcher import RepositoryWatcher, ignored

if TYPE_CHECKING:  # imported only with a cloud repository (its packages are optional)
    from .cloud_sync import CloudSyncs

log = logging.getLogger("shmserve.broker")

Entry = tuple[str, int, int, int]  # path in the model folder, inode, size, mtime (ns); a folder: (path, 0, -1, 0)


def walk_once(folder: str) -> Iterator[tuple[str, os.stat_result, list[str], list[str]]]:
    """``os.walk`` of ``folder`` following links, each folder once (links may loop): its path,
    stat, subfolders (prune them in place to skip some) and files."""
    seen: set[tuple[int, int]] = set()  # folders walked, as (device, inode)
    for root, dirs, files in os.walk(folder, followlinks=True):
        try:
            st = os.stat(root)
        except OSError:
            dirs.clear()
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        yield root, st, dirs, files


def folder_state(folder: str) -> frozenset[Entry]:
    """What the loads read in ``folder``, following links; ignored names (editor temporaries,
    bytecode, dot-files) left out, so they change nothing."""
    entries: set[Entry] = set()
    for root, _, dirs, files in walk_once(folder):
        dirs[:] = [d for d in dirs if not ignored(d)]
        rel_root = os.path.relpath(root, folder)
        for d in dirs:
            entries.add((os.path.normpath(os.path.join(rel_root, d)), 0, -1, 0))
        for f in files:
            if ignored(f):
                continue
            try:
                fst = os.stat(os.path.join(root, f))
            except OSError:
                continue  # removed meanwhile, or a dangling link
            entries.add((os.path.normpath(os.path.join(rel_root, f)), fst.st_ino, fst.st_size, fst.st_mtime_ns))
    return frozenset(entries)


def snapshot(repositories: list[str]) -> dict[str, frozenset[Entry]]:
    """Every model folder's state. A name in several repositories is taken from the first, as
    the loads do."""
    out: dict[str, frozenset[Entry]] = {}
    for repo in repositories:
        try:
            names = sorted(e.name for e in os.scandir(repo) if not ignored(e.name) and e.is_dir())
        except OSError as e:
            log.warning("repository scan: cannot read '%s': %s", repo, e)
            continue
        for name in names:
            if name not in out:
                out[name] = folder_state(os.path.join(repo, name))
    return out


def changed_paths(before: frozenset[Entry] | None, after: frozenset[Entry] | None) -> set[str]:
    """The paths in a model folder that differ ('' when the folder itself came or went)."""
    paths = {entry[0] for entry in (before or frozenset()) ^ (after or frozenset())}
    if (before is None) != (after is None):
        paths.add("")
    return paths


def covered(path: str, event_paths: set[str]) -> bool:
    """Whether an event named ``path`` or a folder above it."""
    return any(q == "" or path == q or path.startswith(q + os.sep) for q in event_paths)


class RepositoryScanner:
    def __init__(self, repositories: list[str], watcher: RepositoryWatcher, every_s: float,
                 cloud: CloudSyncs | None = None) -> None:
        self.repositories = repositories
        self.watcher = watcher
        self.every_s = every_s
        self.cloud = cloud
        self._last = snapshot(repositories)  # what the initial loads are about to read
        # The event paths of the previous scan too: an event can arrive after the scan that
        # read its change took the paths, and before the scan that finds the change.
        self._previous_events: dict[str, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repository-scan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.scan_once()
            except Exception:  # noqa: BLE001 - a failed scan must not end the scans that follow
                log.exception("repository scan failed")

    def scan_once(self) -> None:
        if self.cloud is not None:
            self.cloud.sync_all()
        now = snapshot(self.repositories)
        taken = self.watcher.take_event_paths()
        previous, self._previous_events = self._previous_events, taken
        last, self._last = self._last, now
        for name in sorted(last.keys() | now.keys()):
            paths = changed_paths(last.get(name), now.get(name))
            events = taken.get(name, set()) | previous.get(name, set())
            if paths and not all(covered(p, events) for p in paths):
                log.info("repository scan: '%s' changed", name)
                self.watcher.changed(name)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
