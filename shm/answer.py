"""The answer descriptor: what a worker or the broker writes back for one request, in one fixed
binary layout that only this module knows.

An answer block is the descriptor, then (64-byte aligned) the bytes of the outputs it carries.
Layout, little-endian:

- header (``_HEADER``, 41 bytes): magic, flags (refused, final, error, document), trace stamp
  count, a model's error code (``ErrorCode`` + 1; 0: none), output count, the output table's
  length, the model version served (-1: not said; a version may be 0), the response count of a
  stream's end, and the byte lengths of the error, parameters, document and step traces;
- the output table, per output: name length, datatype code (``DATATYPES``), dimension count and
  in-region flag (``_META``), the name (UTF-8), its dimensions (int64 each), its data offset
  (from the data start) and size (``_PLACE``);
- the trace stamps (int64 each), the error text (UTF-8), the response parameters (a JSON object,
  only when there are any), a control answer's JSON document, and the traces of a traced
  ensemble request's steps, per step: name length, parent, version and seven stamps (``_STEP``),
  then the model's name (UTF-8).

Answers come from memory another process wrote (a worker may crash, or a model scribble), so
``decode_answer`` checks every count and length against the end of the block before it reads,
and raises ``AnswerCorrupt`` for anything no producer writes. Error answers (refusals included) and
the broker's control answers are answers too: an error text, or a JSON document.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple, Sequence

import orjson

ALIGN = 64  # where an answer's tensor data starts
_PAD = ALIGN - 1
_MAGIC = 0x4E41  # "AN"
# magic, flags, trace stamps, error code, outputs, table bytes, version, responses, error, params, document
# and step trace bytes
_HEADER = struct.Struct("<HBBBIIqIIIII")
_HEADER_SIZE = _HEADER.size
_unpack_header = _HEADER.unpack_from
_pack_header = _HEADER.pack
_META = struct.Struct("<IBB?")  # an output's name length, datatype code, dimension count, in-region flag
_PLACE = struct.Struct("<QQ")  # an output's data offset and size
_STEP = struct.Struct("<Hiq7q")  # a step trace's name length, parent, version and stamps

# A single-answer request to a decoupled model is refused (501) in the words of Triton's HTTP
# frontend, which the other frontends and the local client put in their own.
DECOUPLED_REFUSAL = "HTTP end point doesn't support models with decoupled transaction policy"
NO_VERSION = -1  # an answer that names no version: refused before one was chosen, or not a model's
REFUSED = 1  # the request was refused before its model ran (Triton's InferAsync failing)
FINAL = 2  # a stream's end: no response follows
_ERROR = 4
_DOCUMENT = 8

# Wire datatypes by code (their order is the layout's: append only).
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES", "BF16")
_CODES = {name: code for code, name in enumerate(DATATYPES)}

# Output tables seen lately, decoded and encoded: a model whose outputs keep their shapes writes
# the same table for every request, whatever its inputs, and it is then read without a loop in
# Python. Bounded: emptied when full.
_TABLES_MAX = 256
_decoded: dict[bytes, tuple[tuple["OutputTensor", ...], int]] = {}
_encoded: dict[tuple, bytes] = {}


class ErrorCode(enum.IntEnum):
    """The code of an error a model answers with, as Triton numbers them (TRITONSERVER_Error_Code,
    ``pb_utils.TritonError.<NAME>``). Each frontend answers it as Triton's does: HTTP folds four of
    them into 400, gRPC keeps each apart (server/frontend/error_status.py, server/grpc/status.py)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


_ERROR_CODES = tuple(ErrorCode)


class AnswerCorrupt(ValueError):
    """An answer block holds what no producer writes."""


class OutputTensor(NamedTuple):
    """One output of an answer: its bytes lie at ``offset`` from the answer's data start, or,
    ``in_region``, where the request asked (a region, or room reserved in its own block)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    size: int
    in_region: bool = False


class StepTrace(NamedTuple):
    """The trace of one request an ensemble made of a composing model, as Triton writes it: a
    trace of its own whose ``parent_id`` is the ensemble request's. ``parent``: -1 for a step of
    the request's own ensemble, else the index (in the same answer) of the nested ensemble step
    that made it."""

    model: str
    version: int
    parent: int
    # REQUEST_START, QUEUE_START, COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START,
    # COMPUTE_END, REQUEST_END (0: not taken)
    stamps: tuple[int, ...]


STEP_STAMPS = 7


def add_step(traces: list[StepTrace], step: StepTrace, nested: Sequence[StepTrace] = ()) -> None:
    """Append the trace of a request made on behalf of another (an ensemble's step, a BLS call)
    to ``traces``, then those of the requests it made in turn (``nested``, whose ``parent`` counts
    within them), under it."""
    at = len(traces)
    traces.append(step)
    traces.extend(s._replace(parent=at if s.parent < 0 else at + 1 + s.parent) for s in nested)


class AnswerDescriptor(NamedTuple):
    """One answer: outputs, response parameters, or an error; a stream's end (``final``, with the
    count of responses sent before it); trace stamps; or a control request's JSON document."""

    outputs: tuple[OutputTensor, ...] | list[OutputTensor] = ()
    version: int = NO_VERSION  # the model version that answered (a version may be 0)
    params: dict | None = None  # the response's parameters
    error: str | None = None
    refused: bool = False  # an error from before the model ran
    trace: tuple[int, ...] = ()  # QUEUE_START (0: direct), COMPUTE_START, _INPUT_END, _OUTPUT_START, _END
    final: bool = False  # a stream's end
    responses: int = 0  # a stream's end: how many responses came before it
    document: Any = None  # a control request's answer
    # The code of a model's own error (its error response, or a step's in an ensemble), which the
    # frontends answer with as Triton does; None for the server's errors, which carry their status.
    code: ErrorCode | None = None
    steps: tuple[StepTrace, ...] = ()  # a traced ensemble request's steps

    @classmethod
    def failure(cls, message: str, refused: bool = False) -> "AnswerDescriptor":
        """An error answer; ``refused``: from before the model ran."""
        return cls(error=message, refused=refused)

    @classmethod
    def of_document(cls, doc: Any) -> "AnswerDescriptor":
        """A control request's answer: its JSON document, or its error (``{"error": text}``)."""
        error = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(error, str):
            return cls(document=doc)
        return cls(error=error, document=doc if len(doc) > 1 else None)

    def served_version(self, default: str = "") -> str:
        """The version that answered, as the protocols spell it; ``default`` when none is named."""
        return str(self.version) if self.version >= 0 else default

    def control_document(self) -> Any:
        """What a control request's caller reads: the document, or ``{"error": text}``."""
        if self.document is not None:
            return self.document
        return {"error": self.error} if self.error is not None else {}

    # -- bytes ------------------------------------------------------------------------------------
    def encode(self) -> bytes:
        """The descriptor's bytes (``write_answer`` places them)."""
        outputs, version, params, error, refused, trace, final, responses, document, code, steps = self
        if not (error is not None or refused or final or responses or document is not None or steps):
            return encode_outputs(outputs, version, params, trace)
        flags = (REFUSED if refused else 0) | (FINAL if final else 0)
        error_raw = b""
        if error is not None:
            flags |= _ERROR
            error_raw = error.encode(errors="replace")
        params_raw = orjson.dumps(params) if params else b""
        document_raw = b""
        if document is not None:
            flags |= _DOCUMENT
            document_raw = orjson.dumps(document)
        table = _table(outputs) if outputs else b""
        coded = 0 if code is None or error is None else code + 1  # (a code is that of an error)
        steps_raw = _steps(steps) if steps else b""
        return b"".join((_pack_header(_MAGIC, flags, len(trace), coded, len(outputs),
                                      len(table), version, responses, len(error_raw), len(params_raw),
                                      len(document_raw), len(steps_raw)),
                         table, struct.pack(f"<{len(trace)}q", *trace), error_raw, params_raw, document_raw,
                         steps_raw))


def _steps(steps: Sequence[StepTrace]) -> bytes:
    parts = []
    for model, version, parent, stamps in steps:
        name = model.encode()
        padded = (tuple(stamps) + (0,) * STEP_STAMPS)[:STEP_STAMPS]
        parts.append(_STEP.pack(len(name), parent, version, *padded) + name)
    return b"".join(parts)


def _read_steps(raw: bytes) -> tuple[StepTrace, ...]:
    """The step traces in ``raw``; AnswerCorrupt where a length runs past it or a parent is not
    an earlier step."""
    steps: list[StepTrace] = []
    pos = 0
    while pos < len(raw):
        if pos + _STEP.size > len(raw):
            raise AnswerCorrupt("an answer's step traces are cut short")
        name_len, parent, version, *stamps = _STEP.unpack_from(raw, pos)
        pos += _STEP.size
        if pos + name_len > len(raw) or not -1 <= parent < len(steps):
            raise AnswerCorrupt("an answer's step trace runs past its section or names no earlier parent")
        steps.append(StepTrace(_utf8(raw[pos:pos + name_len]), version, parent, tuple(stamps)))
        pos += name_len
    return tuple(steps)


def encode_outputs(outputs: Sequence[OutputTensor], version: int, params: dict | None = None,
                   trace: Sequence[int] = ()) -> bytes:
    """The bytes of a model's answer (``AnswerDescriptor(outputs, version, params, trace=trace)``),
    without making the descriptor first: every answer a worker writes takes this path."""
    table = _table(outputs) if outputs else b""
    if not (params or trace):
        return _pack_header(_MAGIC, 0, 0, 0, len(outputs), len(table), version, 0, 0, 0, 0, 0) + table
    params_raw = orjson.dumps(params) if params else b""
    return b"".join((_pack_header(_MAGIC, 0, len(trace), 0, len(outputs), len(table), version, 0, 0,
                                  len(params_raw), 0, 0),
                     table, struct.pack(f"<{len(trace)}q", *trace), params_raw))


_new = tuple.__new__


def decode_answer(buf: Any, offset: int, end: int | None = None) -> tuple[AnswerDescriptor, int]:
    """The answer at ``offset`` of ``buf`` and where its data starts; nothing is read at or past
    ``end`` (default: the buffer's end), and every output's bytes lie before it."""
    if end is None or end > len(buf):
        end = len(buf)
    if offset < 0 or offset > end - _HEADER_SIZE:
        raise AnswerCorrupt(f"an answer at {offset} does not fit before {end}")
    magic, flags, nstamps, coded, n, table_len, version, responses, error_len, params_len, doc_len, steps_len = \
        _unpack_header(buf, offset)
    if magic != _MAGIC:
        raise AnswerCorrupt(f"no answer at {offset} (magic {magic:#x})")
    rest = nstamps * 8 + error_len + params_len + doc_len + steps_len
    data = offset + ((_HEADER_SIZE + table_len + rest + _PAD) & ~_PAD)
    if data > end:
        raise AnswerCorrupt(f"an answer at {offset} runs past {end}")
    pos = offset + _HEADER_SIZE
    if n:
        raw = buf[pos:pos + table_len].tobytes()
        known = _decoded.get(raw)
        if known is None:
            known = _read_table(raw, n)
            if len(_decoded) >= _TABLES_MAX:
                _decoded.clear()
            _decoded[raw] = known
        outputs, need = known
        if need > end - data or len(outputs) != n:
            raise AnswerCorrupt(f"an answer's outputs run past its block ({need} bytes, {end - data} there)")
    elif table_len:
        raise AnswerCorrupt("an answer without outputs has an output table")
    else:
        outputs = ()
    if not (flags or rest or coded):
        return _new(AnswerDescriptor, (outputs, version, None, None, False, (), False, responses, None, None,
                                       ())), data
    pos += table_len
    trace = struct.unpack_from(f"<{nstamps}q", buf, pos) if nstamps else ()
    pos += nstamps * 8
    if flags & _ERROR:
        error: str | None = _utf8(bytes(buf[pos:pos + error_len]))
    elif error_len or coded:
        raise AnswerCorrupt("an answer has error text or an error code but no error flag")
    else:
        error = None
    if coded > len(_ERROR_CODES):
        raise AnswerCorrupt(f"an answer's error code {coded - 1} is unknown")
    code = _ERROR_CODES[coded - 1] if coded else None
    pos += error_len
    params = _json(buf, pos, params_len) if params_len else None
    if params is not None and not isinstance(params, dict):
        raise AnswerCorrupt("an answer's parameters are not a JSON object")
    pos += params_len
    if flags & _DOCUMENT:
        document = _json(buf, pos, doc_len)
    elif doc_len:
        raise AnswerCorrupt("an answer has a document but no document flag")
    else:
        document = None
    pos += doc_len
    steps = _read_steps(bytes(buf[pos:pos + steps_len])) if steps_len else ()
    return _new(AnswerDescriptor, (outputs, version, params, error, bool(flags & REFUSED), trace,
                                   bool(flags & FINAL), responses, document, code, steps)), data


def _table(outputs: Any) -> bytes:
    """The output table's bytes: per output its name length, datatype code, dimension count and
    in-region flag, its name, its dimensions, its data offset and size."""
    try:
        key: tuple | None = tuple(outputs)
        raw = _encoded.get(key)  # type: ignore[arg-type]
    except TypeError:  # a shape given as a list
        key, raw = None, None
    if raw is not None:
        return raw
    parts = []
    for name, datatype, shape, offset, size, in_region in outputs:
        encoded = name.encode(errors="replace")
        parts += (_META.pack(len(encoded), _CODES[datatype], len(shape), in_region), encoded,
                  struct.pack(f"<{len(shape)}q", *shape), _PLACE.pack(offset, size))
    raw = b"".join(parts)
    if key is not None:
        if len(_encoded) >= _TABLES_MAX:
            _encoded.clear()
        _encoded[key] = raw
    return raw


def _read_table(raw: bytes, n: int) -> tuple[tuple[OutputTensor, ...], int]:
    """An output table's outputs, and the bytes of data they need after the data start."""
    outputs = []
    need = pos = 0
    try:
        for _ in range(n):
            name_len, code, ndim, in_region = _META.unpack_from(raw, pos)
            pos += _META.size
            if code >= len(DATATYPES):
                raise AnswerCorrupt(f"an output's datatype code {code} is unknown")
            name = _utf8(raw[pos:pos + name_len])
            if len(name.encode()) != name_len:
                raise AnswerCorrupt("an output's name runs past the table")
            pos += name_len
            shape = struct.unpack_from(f"<{ndim}q", raw, pos)
            pos += ndim * 8
            offset, size = _PLACE.unpack_from(raw, pos)
            pos += _PLACE.size
            if not in_region:
                need = max(need, offset + size)
            outputs.append(OutputTensor(name, DATATYPES[code], shape, offset, size, in_region))
    except struct.error as e:
        raise AnswerCorrupt(f"an answer's output table is cut short: {e}") from None
    if pos != len(raw):
        raise AnswerCorrupt("an answer's output table has bytes left over")
    return tuple(outputs), need


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise AnswerCorrupt(f"an answer's text is not UTF-8: {e}") from None


def _json(buf: Any, pos: int, n: int) -> Any:
    try:
        return orjson.loads(buf[pos:pos + n])
    except orjson.JSONDecodeError as e:
        raise AnswerCorrupt(f"an answer's JSON does not parse: {e}") from None


def answer_room(descriptor_bytes: int) -> int:
    """Bytes an answer's descriptor takes before its 64-byte aligned tensor data."""
    return (descriptor_bytes + ALIGN - 1) & ~(ALIGN - 1)


def write_answer(buf: Any, offset: int, raw: bytes) -> int:
    """Place an encoded descriptor at ``offset`` (a 64-byte aligned block); returns where its
    tensor data starts."""
    buf[offset:offset + len(raw)] = raw
    return offset + answer_room(len(raw))


def refusal(message: str, version: int = NO_VERSION) -> AnswerDescriptor:
    """The answer of a request refused before its model ran; ``version``: the version whose
    scheduler refused it (``NO_VERSION``: refused before one was chosen, which no trace records)."""
    return AnswerDescriptor(error=message, refused=True, version=version)
