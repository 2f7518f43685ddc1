"""The worker processes, one per model instance: the spec each is started with (its stdin), stopping and
reaping them, and what the broker reads from their segments (statistics, custom metrics).

An instance's worker number names its segment and is never reused, so a number that is no
longer in ``workers`` means the worker was reaped and its segment unmapped.
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from typing import Iterator

import posix_ipc

from shmserve.shm import logs, space
from shmserve.shm.access import server_readers
from shmserve.shm.arena import free_block
from shmserve.shm.channel import WorkerSegment, control_name, lanes_name
from shmserve.shm.child_spec import spec_file
from shmserve.shm.extents import map_worker_extent, unlink_extents
from shmserve.shm.names import object_name, remove_stale, try_numbers, unlink_shm, warn_once
from shmserve.shm.protocol import EXTENT_SHIFT, ROLE_MASK, ROLE_WORKER, W_STOP
from shmserve.shm.segment import Segment, SegmentCache
from shmserve.shm.stats import VersionTotals
from shmserve.workers.shared_weights import candidates as weight_keys

from .models import Instance, ModelVersion
from .options import BrokerOptions
from .response_cache import load_key

log = logging.getLogger("shmserve.broker")

# OpenMP threads of a model (torch, numpy's BLAS) sleep when idle instead of spinning: a worker
# shares the cores with the frontends, the broker and other workers, and a spinning pool burns
# the CPU they need between small batches. An environment that sets it wins.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
STOP_GRACE_S = 1.0  # at shutdown, how long stopped workers may take at least before they are killed
WORKER_NUMBERS = 1 << 31  # a slot's answer names its worker in 32 bits (shm/protocol.py)
NAME_TRIES = 16  # worker numbers tried for one start (names another user made first are skipped)


class StartFailed(Exception):
    """An instance's worker could not be started: that instance fails (its load, its restart),
    never the broker. The text names the object and why."""


class Instances:
    def __init__(self, opts: BrokerOptions) -> None:
        self.opts = opts
        self.workers: dict[int, tuple[ModelVersion, Instance]] = {}  # live workers by number
        self.next_worker = 0
        self.far_workers: set[int] = set()  # numbers used out of sequence (the names ahead were squatted)

    def shm_shortfall(self, count: int) -> str | None:
        """Why /dev/shm cannot hold ``count`` more worker segments (None: it can). Checked for a
        whole load before any worker starts: a segment that does not fit would not fail when it
        is made, but kill its worker with SIGBUS when its arena fills (shm/space.py). A segment
        holds its arena's first extent; each extent it grows is counted when it is made."""
        if count <= 0:
            return None
        each = WorkerSegment.nbytes(self.opts.worker_arena_start_bytes, len(server_readers()))
        try:
            space.check(self.opts.server_id, count * each, "the load",
                        f" ({count} instance(s) of {space.mib(each)} each, growing up to "
                        f"--worker-arena-mb={self.opts.worker_arena_bytes >> 20} with answers: "
                        f"--backend-config=python,shm-default-byte-size="
                        f"{self.opts.worker_arena_start_bytes} sets the start)")
        except space.NoRoom as e:
            return str(e)
        return None

    @contextlib.contextmanager
    def counted(self, count: int) -> Iterator[str | None]:
        """``shm_shortfall(count)``, with the server's counting lock (shm/space.py) held until the
        block ends: the worker segments the block makes are those the check counted, with no
        worker's growth taking the same room in between."""
        with space.counting(self.opts.server_id):
            yield self.shm_shortfall(count)

    def spawn(self, mv: ModelVersion, name: str, index: int, kind: str, device: int) -> Instance:
        """Start a new instance of ``mv``."""
        inst = self._start(mv, name, index, kind, device)
        mv.instances.append(inst)
        return inst

    def restart(self, mv: ModelVersion, old: Instance) -> Instance:
        """Start a worker in place of ``old``, which exited."""
        inst = self._start(mv, old.name, old.index, old.kind, old.device_id)
        inst.restarts = old.restarts + 1
        mv.instances[mv.instances.index(old)] = inst
        return inst

    def _start(self, mv: ModelVersion, name: str, index: int, kind: str, device: int) -> Instance:
        """A new worker of ``mv``; StartFailed (naming the object and why) if it cannot start."""
        num, seg = self._segment(f"model '{mv.name}' version {mv.version} instance '{name}'")
        try:
            return self._launch(mv, name, index, kind, device, num, seg)
        except Exception as e:  # noqa: BLE001 - (a spec it cannot write, a process it cannot start)
            seg.close()
            seg.unlink()
            raise StartFailed(f"could not start model '{mv.name}' version {mv.version} instance '{name}': "
                              f"{type(e).__name__}: {e}") from e

    def _segment(self, who: str) -> tuple[int, WorkerSegment]:
        """A new worker segment and its number, which names it (and its control object and
        extents) to every process: the routes, the worker's spec and every slot carry the number.
        A stale object of the server's user at its names is removed; a name another user holds
        (a sticky /dev/shm: the server may not remove it) is skipped, after a few in sequence for
        random numbers, which no user can make in advance."""
        squatted: list[str] = []
        for num, in_sequence in try_numbers(self.next_worker, WORKER_NUMBERS, self.far_workers, tries=NAME_TRIES):
            seg_name = object_name(self.opts.server_id, "worker", num)
            readers = server_readers()
            for n in (seg_name, control_name(seg_name), *(lanes_name(seg_name, uid) for uid in readers)):
                remove_stale(n)
            try:
                seg = WorkerSegment.create(seg_name, self.opts.worker_arena_start_bytes, readers)
            except posix_ipc.ExistentialError:
                warn_once(seg_name, f"(or {control_name(seg_name)}, or a user's lanes object beside it) exists and "
                                    f"is not the server's to remove: {who} takes another worker number")
                squatted.append(seg_name)
                if in_sequence:
                    self.next_worker = num + 1
                continue
            except Exception as e:  # noqa: BLE001 - no room in /dev/shm, an error of the system
                raise StartFailed(f"could not start {who}: its segment {seg_name} could not be made: "
                                  f"{type(e).__name__}: {e}") from e
            if in_sequence:
                self.next_worker = num + 1
            else:
                self.far_workers.add(num)  # (never reused: the sequence skips it when it gets there)
            return num, seg
        raise StartFailed(f"could not start {who}: the {len(squatted)} worker segment names tried exist and are "
                          f"not the server's to remove ({', '.join(squatted[:3])}, ...): remove them")

    def _launch(self, mv: ModelVersion, name: str, index: int, kind: str, device: int, num: int,
                seg: WorkerSegment) -> Instance:
        # The worker spec: everything a worker process starts from (read by workers/worker.py).
        spec = {
            "server_id": self.opts.server_id, "num": num, "model": mv.name, "version": mv.version,
            "instance_name": name, "instance_index": index, "kind": kind, "device_id": device,
            "model_dir": mv.model_dir, "config": mv.config_dict, "backend": mv.backend,
            "strict": self.opts.strict_config, "broker_pid": os.getpid(),
            "default_max_batch_size": self.opts.default_max_batch_size,  # (ONNX auto-completion's)
            "log": logs.current(),  # the broker's log settings, which every process follows
            "instances": mv.planned_instances, "poll_us": self.opts.poll_us, "weights_key": mv.weights_key,
            # the response cache's key part for this load (0: the server has no cache)
            "cache_load": load_key(mv) if self.opts.response_cache_bytes else 0,
            # its output arena: the cap of all its extents and their least growth (shm/extents.py)
            "arena_cap": self.opts.worker_arena_bytes, "arena_growth": self.opts.worker_arena_growth_bytes,
            # the buckets of its latency histograms; None: not exported, not counted
            "latency_buckets": mv.stats.latency.buckets if self.opts.histogram_latencies else None,
        }
        with spec_file(spec) as stdin:  # not on argv: a large config override would not fit
            proc = subprocess.Popen([sys.executable, "-m", "shmserve.workers"], stdin=stdin, env=WORKER_ENV)
        inst = Instance(num=num, name=name, index=index, kind=kind, device_id=device, seg=seg, proc=proc)
        self.workers[num] = (mv, inst)
        return inst

    def live(self, inst: Instance) -> bool:
        """Whether the instance's worker is not reaped yet (its segment is still mapped)."""
        return inst.num in self.workers

    def stop(self, inst: Instance, graceful: bool = True) -> None:
        """Ask the worker to finish and exit, or kill it."""
        if inst.proc.poll() is None:
            if graceful and inst.seg.inbox.put(W_STOP, 0, 0, 0, 0):
                inst.seg.waker.post()
            else:
                inst.proc.kill()

    def reap(self, inst: Instance, mv: ModelVersion | None = None) -> None:
        """Forget an exited worker and remove its segment; its counts stay in ``mv``'s totals."""
        if mv is not None:
            mv.stats.add_area(inst.seg.stats)
        self.workers.pop(inst.num, None)
        inst.seg.close()
        inst.seg.unlink()
        unlink_extents(self.opts.server_id, inst.num)  # the extents its arena grew (a crash leaves them)

    def answer_segment(self, num: int, role: int, cache: SegmentCache) -> Segment | None:
        """The mapping that holds an answer of worker ``num`` (``role``: a slot's role word, which
        names the extent), grown extents mapped through ``cache``; None when that worker or
        extent is gone or not the server's."""
        live = self.workers.get(num)
        if live is None or role & ROLE_MASK != ROLE_WORKER:
            return None
        extent = role >> EXTENT_SHIFT
        if not extent:
            return live[1].seg.seg
        try:
            control = live[1].seg.control
            assert control is not None  # (the broker made it)
            return map_worker_extent(cache, self.opts.server_id, num, extent, control)
        except (OSError, ValueError):
            return None

    def forget_weights(self, mv: ModelVersion) -> None:
        """Remove the version's shared copy of its weights (workers/shared_weights.py); mappings
        that instances still hold stay valid until they exit."""
        if mv.weights_key:
            for key in weight_keys(mv.weights_key):  # (the names its instances passed over too)
                name = object_name(self.opts.server_id, "weights", key)
                unlink_shm(name)  # (one not there is no error)
                unlink_shm(name + ".lock")

    def stop_all(self, graceful: bool = True, deadline: float = 0.0) -> None:
        """Stop every worker (kill it when not ``graceful``), kill those that have not exited by
        ``deadline`` (the exit timeout's, as Triton's covers the models' unload too; at least
        ``STOP_GRACE_S`` from now, for the ``finalize`` of workers that were idle), and reap them all."""
        for _, inst in list(self.workers.values()):
            self.stop(inst, graceful)
        deadline = max(deadline, time.monotonic() + STOP_GRACE_S)
        for mv, inst in list(self.workers.values()):
            try:
                inst.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                inst.proc.kill()
                inst.proc.wait()
            self.reap(inst, mv)

    def wake_all(self) -> None:
        """Ring every worker (e.g. so that they unmap a departed client's segment now)."""
        for _, inst in self.workers.values():
            inst.seg.waker.notify()

    def want_wakeup(self, mv: ModelVersion) -> None:
        """Ask mv's live instances to ring the broker when they finish a batch."""
        for inst in mv.instances:
            if self.live(inst):
                inst.seg.want_wakeup = True

    def version_totals(self, mv: ModelVersion) -> VersionTotals:
        """What the broker counted itself for ``mv`` plus every live worker's statistics."""
        total = mv.stats.copy()
        for inst in list(mv.instances):
            if self.live(inst):
                total.add_area(inst.seg.stats)
        return total

    def custom_metric_docs(self) -> list[bytes]:
        """Every live worker's published custom metrics (scrape thread: a worker may go meanwhile)."""
        docs = []
        for _, inst in list(self.workers.values()):
            try:
                docs.append(inst.seg.custom_metrics.read(attempts=1000)[1])
            except (ValueError, TypeError):  # its segment was closed under us
                continue
        return docs


def take_message(inst: Instance, off: int, length: int) -> bytes:
    """A message's whole payload: the parts that came before it (W_MORE) and its own."""
    parts, inst.message_parts = inst.message_parts, []
    return b"".join([*parts, take_payload(inst, off, length)])


def take_payload(inst: Instance, off: int, length: int) -> bytes:
    """Copy a worker's message out of its control object and free the block (a held block stalls
    the arena)."""
    control = inst.seg.control
    assert control is not None  # (the broker made it)
    if not 0 < off <= off + length <= control.size:
        return b""
    data = bytes(control.buf[off:off + length])
    if length:
        free_block(control.buf, off)
    return data
