"""A worker's answers: a model's response encoded as an answer descriptor (shm/answer.py) and
output bytes, written as a block into the worker's own arena (or into the region the client
named), and the client's slot completed.

Completions wait until the round's counters are flushed (``send_completions``), so a client that
sees its answer also sees it counted in the metrics, and each client is woken once per round
however many of its requests the round answered.
"""
from __future__ import annotations

import base64
import logging
import time
from typing import Any, Callable

import posix_ipc

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.answer import AnswerDescriptor, OutputTensor, answer_room, encode_outputs, write_answer
from shmserve.shm.channel import NOTIFY_BROKER, ClientSegment
from shmserve.shm.copying import copy_into
from shmserve.shm.extents import GrowthRefused, OutputArenas
from shmserve.shm.protocol import NO_BLOCK_SHM_FULL, ROLE_WORKER, role_word
from shmserve.shm.region_io import StaleRegion, output_room_text
from shmserve.shm.space import NoRoom
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import byte_view, serialize_bytes, wire_datatype
from shmserve.shm.waker import Waker

from . import device_tensors
from .backend import Response
from .classification import ClassificationError, classify
from .cuda import CudaError
from .cuda import runtime as cuda_runtime
from .requests import RequestError
from .reshape import Reshapes

log = logging.getLogger("shmserve.worker")


class ModelInfo:
    """What encoding needs to know of the model an instance serves (set once it is loaded)."""

    __slots__ = ("version", "instance_name", "batched", "decoupled", "labels", "reshapes", "declared")

    def __init__(self, version: int, instance_name: str, batched: bool = False, decoupled: bool = False,
                 labels: dict[str, list[str]] | None = None, reshapes: Reshapes | None = None,
                 declared: frozenset[str] = frozenset()) -> None:
        self.version = version
        self.instance_name = instance_name
        self.batched = batched  # max_batch_size > 0: outputs' first dimension is the batch
        self.decoupled = decoupled  # responses may carry only some outputs
        self.labels = labels or {}  # output name -> its label_filename's lines (classification)
        self.reshapes = reshapes  # outputs whose config ``reshape`` the client does not see (reshape.py)
        # The outputs the config declares: a request that names none gets these of those the model
        # gave and no other, as Triton's Python backend silently prunes the rest.
        self.declared = declared

    def answered(self, outputs: dict[str, Any]) -> list[str]:
        """What a request that names no output gets of ``outputs``: those the config declares
        (all of them for a config that declares none)."""
        return [n for n in outputs if n in self.declared] if self.declared else list(outputs)


EXHAUSTED_EVERY_S = 10.0


class Answers:
    """One worker's output arena, and the answers of the current round waiting to be completed."""

    def __init__(self, num: int, model: ModelInfo, arena: OutputArenas, segments: SegmentCache,
                 broker_waker: Waker) -> None:
        self.num = num
        self.model = model
        self.arena = arena  # its extents (shm/extents.py)
        self.segments = segments  # other processes' segments outputs may be placed in
        self.broker_waker = broker_waker
        self.phases = (0, 0, 0)  # the running batch's start, inputs built, executed: trace timestamps
        # answers to complete once the counters are flushed: (client, slot, status, extent, offset, length)
        self._notes: list[tuple[ClientSegment, int, int, int, int, int]] = []
        self._later: list[Callable[[], None]] = []  # streams' ends that wait for the round's completions
        self._unproduced: set[str] = set()  # outputs asked for that the model left out (logged once each)
        self._exhausted = 0  # answers sent without a block since the last line that said so
        self._exhausted_said = -EXHAUSTED_EVERY_S  # when that line was logged

    def deliver(self, client: ClientSegment, entry: BatchEntry, status: int, answer: bytes,
                tensors: list[tuple[int, Any]]) -> int:
        """Write one response block (the encoded answer, then tensor bytes); its client hears of it
        in ``send_completions``. Returns the status it was answered with (``write_block``'s when it
        found no room)."""
        override, extent, off, total = self.write_block(client, entry, answer, tensors)
        self._notes.append((client, entry["slot"], override or status, extent, off, total))
        return override or status

    def later(self, send: Callable[[], None]) -> None:
        """Run ``send`` (a stream's end) with the round's completions; the worker's loop only."""
        self._later.append(send)

    def pending(self) -> bool:
        """Whether answers wait for ``send_completions``."""
        return bool(self._notes or self._later)

    def send_completions(self) -> None:
        """Complete the answered slots, then wake each client once (not once per response)."""
        if self._later:
            later, self._later = self._later, []
            for send in later:
                send()
        notes, self._notes = self._notes, []
        woken: list[ClientSegment] = []
        for client, slot, status, extent, off, total in notes:
            client.complete(slot, status, role_word(ROLE_WORKER, extent), self.num, off, total)
            if client not in woken:
                woken.append(client)
        for client in woken:
            (self.broker_waker if client.notify_kind == NOTIFY_BROKER else client.waker).notify()
        self.arena.tidy()  # a retired extent whose answers were all read is unlinked

    def encode(self, entry: BatchEntry, resp: Response) -> tuple[int, bytes, list[tuple[int, Any]]]:
        """(status, encoded answer, tensor chunks) of a response; outputs placed in regions are
        written now."""
        if resp.error is not None:  # (the model ran: its version and times, as a traced success has them)
            return resp.status, AnswerDescriptor(error=resp.error, code=resp.code, version=self.model.version,
                                                 trace=self.ran_stamps(entry)).encode(), []
        model = self.model
        wanted = entry.get("outputs")
        if wanted:  # in the order the model returned them, as Triton answers (a BLS caller indexes them)
            asked = {o["name"] for o in wanted}
            names = [n for n in resp.outputs if n in asked]
            names += [o["name"] for o in wanted if o["name"] not in resp.outputs]  # (left out, logged below)
        else:
            names = model.answered(resp.outputs)
        placed = {o["name"]: o for o in wanted or () if "seg" in o or "cuda" in o}
        classes = {o["name"]: o["class"] for o in wanted if "class" in o} if wanted else {}
        outs: list[OutputTensor] = []
        tensors, pos = [], 0
        try:
            for name in names:
                if name not in resp.outputs:
                    # Left out of the answer, as Triton does (a streamed response may carry only
                    # some outputs; a model may skip an optional one).
                    if not model.decoupled and name not in self._unproduced:
                        self._unproduced.add(name)
                        log.warning("output '%s' was requested but the model did not produce it: the answer "
                                    "leaves it out (logged once)", name)
                    continue
                arr = resp.outputs[name]
                if model.reshapes is not None:
                    arr = model.reshapes.client_output(name, arr)
                target = placed.get(name)
                if device_tensors.is_tensor(arr):  # a GPU model's output (or a bfloat16 one)
                    if target is not None and "cuda" in target and name not in classes:
                        self._place_on_device(name, target, arr)
                        outs.append(OutputTensor(name, device_tensors.wire_datatype(arr), tuple(arr.shape), 0,
                                                 device_tensors.nbytes(arr), True))
                        continue
                    arr = device_tensors.host_array(arr)
                if name in classes:
                    arr = classify(name, arr, classes[name], model.batched, model.labels.get(name))
                datatype = wire_datatype(arr)
                data = serialize_bytes(arr) if datatype == "BYTES" else byte_view(arr)
                n = len(data)
                if target is not None:
                    self._place(name, target, data)
                    outs.append(OutputTensor(name, datatype, arr.shape, 0, n, True))
                else:
                    outs.append(OutputTensor(name, datatype, arr.shape, pos, n))
                    tensors.append((n, data))
                    pos += n
        except (RequestError, ValueError, TypeError, RuntimeError, OSError, posix_ipc.Error) as e:
            # OSError/posix_ipc: the segment to write into is gone (its client died): nobody to tell.
            status = 400 if isinstance(e, (RequestError, CudaError, StaleRegion, ClassificationError)) else \
                503 if isinstance(e, NoRoom) else 500  # (/dev/shm full: retry later, as elsewhere)
            return status, AnswerDescriptor(error=str(e)).encode(), []
        if resp.steps and "trace_queued_ns" in entry:  # (a traced request's BLS calls: their own traces)
            return 200, AnswerDescriptor(tuple(outs), model.version, resp.parameters or None, trace=self.ran_stamps(entry),
                                         steps=resp.steps).encode(), tensors
        return 200, encode_outputs(outs, model.version, resp.parameters or None, self.ran_stamps(entry)), tensors

    def ran_stamps(self, entry: BatchEntry) -> tuple[int, ...]:
        """A traced request's stamps once the model ran it: QUEUE_START (0: direct), COMPUTE_START,
        _INPUT_END, _OUTPUT_START, _END; none when untraced (a stream's final answer times it:
        stream.py)."""
        if "trace_queued_ns" in entry and "stream" not in entry:
            return (entry["trace_queued_ns"], *self.phases, time.monotonic_ns())
        return ()

    def _place(self, name: str, target: dict, data: Any) -> None:
        """Write an output into the region (or device memory) the client named for it."""
        n = len(data)
        _check_room(name, target, n)
        if "cuda" in target:
            ptr = cuda_runtime().open(base64.b64decode(target["cuda"]), target["device"])
            cuda_runtime().to_device(ptr + target["off"], data)
        elif "ino" in target:  # a registered region (region_io.py: NoRoom where /dev/shm has no room for its pages)
            self.segments.regions.write(target, data)
        else:  # room the client reserved in its request's block
            seg = self.segments.get(target["seg"])
            copy_into(seg.buf[target["off"]:target["off"] + n], data)

    def _place_on_device(self, name: str, target: dict, t: Any) -> None:
        """Copy a tensor into the CUDA region the client named for it, device to device."""
        _check_room(name, target, device_tensors.nbytes(t))
        ptr = cuda_runtime().open(base64.b64decode(target["cuda"]), target["device"])
        device_tensors.copy_to_region(t, ptr + target["off"], target["device"])

    def write_block(self, client: ClientSegment, entry: BatchEntry, raw: bytes,
                    tensors: list[tuple[int, Any]]) -> tuple[int, int, int, int]:
        """(status override or 0, extent, offset, length) of a response block for ``client`` in our
        arena (in its user's own extents, where clients of other users connect), which grows for a
        response that does not fit (shm/extents.py); (503, 0, 0, 0) if not even an
        error fits: the slot is completed without a block, which its client reads as
        ``shm.protocol.NO_ROOM``, or with a length of ``NO_BLOCK_SHM_FULL`` where /dev/shm had no
        page, which it reads as saying so (no request is left unanswered)."""
        room = answer_room(len(raw))
        total = room + sum(n for n, _ in tensors)
        status, refused_status, shm_full = 0, 503, False
        try:
            extent, off = self.arena.alloc(total, entry["ticket"], client.seg.uid)
        except GrowthRefused as e:
            refused, refused_status, shm_full = str(e), e.status, e.shm_full  # (500: it could never fit)
            log.warning("%s", refused)
            extent, off = 0, -1
        else:
            refused = ""
        if off < 0:
            raw = AnswerDescriptor(error=refused or f"model instance '{self.model.instance_name}' has no room "
                                                   f"for a {total}-byte response in its output arena; retry later"
                                   ).encode()
            status, tensors = refused_status, []
            total = answer_room(len(raw))
            try:
                extent, off = self.arena.alloc(total, entry["ticket"], client.seg.uid)
            except GrowthRefused as e:
                off, shm_full = -1, shm_full or e.shm_full
            if off < 0:  # (the length word says why: shm.protocol.no_block_text)
                self._said_exhausted()
                return 503, 0, 0, NO_BLOCK_SHM_FULL if shm_full or self.arena.first.starved else 0
        buf = self.arena.buf(extent)
        pos = write_answer(buf, off, raw)
        for n, data in tensors:
            copy_into(buf[pos:pos + n], data)
            pos += n
        return status, extent, off, total


    def _said_exhausted(self) -> None:
        """One line per ``EXHAUSTED_EVERY_S`` at most, with the count: a full arena fails every
        response of a stream, and a line each would flood the log."""
        self._exhausted += 1
        now = time.monotonic()
        if now - self._exhausted_said >= EXHAUSTED_EVERY_S:
            log.error("output arena exhausted (%d bytes in use: answers its clients have not released yet); "
                      "%d response(s) answered 503 without a block since the last such line",
                      self.arena.bytes_in_use, self._exhausted)
            self._exhausted, self._exhausted_said = 0, now


def _check_room(name: str, target: dict, n: int) -> None:
    if n > target["size"]:
        raise RequestError(output_room_text(name, target["size"], n))
