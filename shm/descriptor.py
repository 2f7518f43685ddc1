"""The inference request descriptor: what a client (frontend, local program, model) asks a model
for, as it lies at the start of its request block in the client's arena, before the tensor bytes.

Defined once here, typed; nothing else knows its bytes. The layout (little-endian):

- a header (``_HEADER``, 88 bytes): magic, option bits, sequence flags, the counts of inputs,
  outputs and dimensions, priority, timeout (us), send time (ns, at ``SENT_AT``: a reserved
  request is stamped when sent), a numeric sequence id, the response ring's offset, and the byte
  lengths of the model, version, request id, text sequence id and model parameters, and of all
  the text;
- one record per input (``_INPUT``, 28 bytes: name and region lengths, datatype code, rank, byte
  size, offset in the block's tensor bytes or in the region), then one per requested output
  (``_OUTPUT``, 32 bytes: name and region lengths, classification count, where its bytes go,
  byte size, offset);
- every input's dimensions (int64), in order;
- the text (UTF-8): model, version, request id, text sequence id, the model parameters (a JSON
  object, only when there are any), then each input's and each output's name and region.

A client writes it and may write anything: ``decode`` reads it as untrusted bytes, bounds-checked
against the block, counts and lengths capped by what the block can hold, and raises
``DescriptorError`` for anything no shmserve client writes. What it *says* (models, shapes,
sizes, regions) is checked later, as a request error.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import orjson

# Wire datatypes by code (the order is part of the layout: append only).
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES")
_CODES = {name: code for code, name in enumerate(DATATYPES)}
MAGIC = 0x31515253  # "SRQ1"

# Option bits of the header.
TRACED = 1  # the frontend traces it: broker and worker add their timestamps to the answer
STREAMED = 2  # a streaming request: its response ring lies at ``stream`` past the tensor bytes' start
OUTPUTS_LISTED = 4  # the request names its outputs (else: all of the model's)
TEXT_SEQUENCE_ID = 8  # the sequence id is a string
_KNOWN_BITS = TRACED | STREAMED | OUTPUTS_LISTED | TEXT_SEQUENCE_ID

# Sequence flags (Triton's): the first and the last request of a sequence.
SEQUENCE_START = 1
SEQUENCE_END = 2

# Where an output's bytes go.
OUT_ANSWER = 0  # in the answer (the producer's arena)
OUT_BLOCK = 1  # into room reserved in the request's own block
OUT_REGION = 2  # into a registered shared-memory region

_HEADER = struct.Struct("<IIIIIIQQQQQIIIIII")
SENT_AT = 40  # the send time's offset in the header
_SENT = struct.Struct("<Q")
_INPUT = struct.Struct("<IIBB2xQQ")
_OUTPUT = struct.Struct("<IIIB4xQQ")
_DIM = struct.Struct("<q")
_LITTLE = sys.byteorder == "little"
_LAYOUTS: dict[tuple[int, int, int], struct.Struct] = {}  # (inputs, outputs, dimensions) -> their records


class DescriptorError(ValueError):
    """Bytes that are not a request descriptor (its reader treats the client as broken)."""


@dataclass(slots=True)
class InputTensor:
    """An input: its bytes lie in the request's block at ``data`` past the tensor bytes' start,
    or in the registered region ``region`` at ``offset``."""

    name: str
    datatype: str
    shape: list[int]
    size: int
    data: int = 0
    region: str = ""
    offset: int = 0


@dataclass(slots=True)
class RequestedOutput:
    """An output the request asks for: into its answer, into room reserved in its block at
    ``data`` past the tensor bytes' start, or into the registered region ``region``; ``classes``
    > 0 asks for Triton's classification (the top N) instead of the tensor."""

    name: str
    classes: int = 0
    region: str = ""
    offset: int = 0
    size: int = 0
    data: int | None = None


@dataclass(slots=True)
class InferRequest:
    """One inference request. ``outputs`` None: every output of the model. ``stream``: the
    response ring's offset past the tensor bytes' start (a streaming request), else None."""

    model: str
    version: str = ""
    inputs: list[InputTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None
    id: str = ""
    parameters: dict[str, Any] | None = None
    sequence_id: int | str = 0
    sequence_flags: int = 0
    priority: int = 0
    timeout_us: int = 0
    sent_ns: int = 0
    traced: bool = False
    stream: int | None = None

    def regions(self) -> set[str]:
        """The registered regions the request names."""
        named = {t.region for t in self.inputs if t.region}
        named.update(o.region for o in self.outputs or () if o.region)
        return named

    def encode(self) -> bytes:
        """The descriptor's bytes. Raises ValueError for a value its layout cannot hold."""
        seq = self.sequence_id
        text_seq = isinstance(seq, str)
        params = orjson.dumps(self.parameters) if self.parameters else b""
        texts = [self.model.encode(), self.version.encode(), self.id.encode(),
                 seq.encode() if text_seq else b"", params]  # type: ignore[union-attr]
        bits = (TRACED if self.traced else 0) | (STREAMED if self.stream is not None else 0) | \
            (OUTPUTS_LISTED if self.outputs is not None else 0) | (TEXT_SEQUENCE_ID if text_seq else 0)
        outputs = self.outputs or ()
        fields: list[Any] = [MAGIC, bits, self.sequence_flags, len(self.inputs), len(outputs), 0, self.priority,
                             self.timeout_us, self.sent_ns, 0 if text_seq else seq, self.stream or 0,
                             len(texts[0]), len(texts[1]), len(texts[2]), len(texts[3]), len(params), 0]
        dims: list[int] = []
        try:
            for t in self.inputs:
                name, region = t.name.encode(), t.region.encode()
                texts += (name, region)
                fields += (len(name), len(region), _CODES[t.datatype], len(t.shape), t.size,
                           t.offset if region else t.data)
                dims += t.shape
            for o in outputs:
                name, region = o.name.encode(), o.region.encode()
                texts += (name, region)
                fields += (len(name), len(region), o.classes,
                           OUT_REGION if region else OUT_ANSWER if o.data is None else OUT_BLOCK, o.size,
                           o.offset if region else o.data or 0)
            blob = b"".join(texts)
            fields[5], fields[16] = len(dims), len(blob)
            # One pack of the fixed part (struct keeps the formats it compiled), then the text.
            return struct.pack(f"<IIIIIIQQQQQIIIIII{'IIBB2xQQ' * len(self.inputs)}{'IIIB4xQQ' * len(outputs)}"
                               f"{len(dims)}q", *fields, *dims) + blob
        except (struct.error, KeyError, TypeError) as e:
            raise ValueError(f"the request cannot be encoded: {e}") from None


def stamp_sent(buf: memoryview, at: int, sent_ns: int) -> None:
    """Set the send time of the descriptor written at ``at`` (a request reserved before it is sent)."""
    _SENT.pack_into(buf, at + SENT_AT, sent_ns)


def _records(buf: memoryview, at: int, n_in: int, n_out: int, n_dims: int) -> tuple:
    """The input and output records and the dimensions at ``at``, one flat tuple (bounds checked
    by the caller). A request of few tensors takes one unpack of a layout compiled once."""
    if n_in <= 8 and n_out <= 8 and n_dims <= 32:
        layout = _LAYOUTS.get((n_in, n_out, n_dims))
        if layout is None:
            layout = _LAYOUTS[n_in, n_out, n_dims] = struct.Struct(
                f"<{_INPUT.format[1:] * n_in}{_OUTPUT.format[1:] * n_out}{n_dims}q")
        return layout.unpack_from(buf, at)
    # (any count the block holds: no format of a length the client chose is compiled)
    out: list = []
    for rec in _INPUT.iter_unpack(buf[at:at + n_in * _INPUT.size]):
        out += rec
    at += n_in * _INPUT.size
    for rec in _OUTPUT.iter_unpack(buf[at:at + n_out * _OUTPUT.size]):
        out += rec
    at += n_out * _OUTPUT.size
    out += memoryview(bytes(buf[at:at + 8 * n_dims])).cast("q") if _LITTLE else \
        [v for (v,) in _DIM.iter_unpack(buf[at:at + 8 * n_dims])]
    return tuple(out)


def decode(buf: memoryview, start: int, end: int) -> InferRequest:
    """The descriptor in ``buf[start:end]``, read as untrusted bytes. Raises DescriptorError."""
    try:
        return _decode(buf, start, end)
    except (struct.error, UnicodeDecodeError, orjson.JSONDecodeError) as e:
        raise DescriptorError(str(e)) from None
    except IndexError:
        raise DescriptorError("a datatype code past the known ones") from None


def _decode(buf: memoryview, start: int, end: int) -> InferRequest:
    pos = start + _HEADER.size
    if pos > end:
        raise DescriptorError(f"{end - start} bytes cannot hold its header")
    (magic, bits, seq_flags, n_in, n_out, n_dims, priority, timeout_us, sent_ns, seq, stream,
     model_len, version_len, id_len, seq_len, params_len, blob_len) = _HEADER.unpack_from(buf, start)
    if magic != MAGIC or bits & ~_KNOWN_BITS or (n_out and not bits & OUTPUTS_LISTED):
        raise DescriptorError(f"magic {magic:#x}, option bits {bits:#x}, {n_out} outputs")
    outputs_at = pos + n_in * _INPUT.size
    dims_at = outputs_at + n_out * _OUTPUT.size
    blob_at = dims_at + 8 * n_dims
    if blob_at + blob_len > end:
        raise DescriptorError(f"{n_in} inputs, {n_out} outputs, {n_dims} dimensions and {blob_len} bytes of text "
                              f"past its block")
    text = str(buf[blob_at:blob_at + blob_len], "utf-8")
    blob = None if len(text) == blob_len else bytes(buf[blob_at:blob_at + blob_len])  # None: ASCII
    # byte offsets are character offsets in ASCII text (the usual case); otherwise each piece is decoded
    records = _records(buf, pos, n_in, n_out, n_dims)
    dims = list(records[-n_dims:]) if n_dims else []
    grouped = zip(*[iter(records)] * 6)  # one record's six fields at a time: inputs, then outputs
    at = model_len + version_len + id_len
    if at + seq_len + params_len > blob_len:
        raise DescriptorError("its strings past its text")
    if blob is None:
        version_at = model_len + version_len
        model, version, rid = text[:model_len], text[model_len:version_at], text[version_at:at]
    else:
        model, version = blob[:model_len].decode(), blob[model_len:model_len + version_len].decode()
        rid = blob[model_len + version_len:at].decode()
    sequence_id: int | str = seq
    if bits & TEXT_SEQUENCE_ID:
        sequence_id = text[at:at + seq_len] if blob is None else blob[at:at + seq_len].decode()
    at += seq_len
    params = None
    if params_len:
        params = orjson.loads(buf[blob_at + at:blob_at + at + params_len])
        if not isinstance(params, dict):
            raise DescriptorError("its parameters are not a JSON object")
        at += params_len
    inputs = []
    d = 0
    for name_len, region_len, code, ndim, size, where in islice(grouped, n_in):
        name_end = at + name_len
        name = text[at:name_end] if blob is None else blob[at:name_end].decode()
        if region_len:
            at = name_end + region_len
            region = text[name_end:at] if blob is None else blob[name_end:at].decode()
            inputs.append(InputTensor(name, DATATYPES[code], dims[d:d + ndim], size, 0, region, where))
        else:
            at = name_end
            inputs.append(InputTensor(name, DATATYPES[code], dims[d:d + ndim], size, where))
        d += ndim
    outputs: list[RequestedOutput] | None = None
    if bits & OUTPUTS_LISTED:
        outputs = []
        for name_len, region_len, classes, kind, size, where in islice(grouped, n_out):
            if kind > OUT_REGION or (kind == OUT_REGION) != (region_len > 0):
                raise DescriptorError(f"output kind {kind} with a region of {region_len} bytes")
            name_end = at + name_len
            name = text[at:name_end] if blob is None else blob[at:name_end].decode()
            if kind == OUT_ANSWER:
                outputs.append(RequestedOutput(name, classes))
            elif kind == OUT_BLOCK:
                outputs.append(RequestedOutput(name, classes, "", 0, size, where))
            else:
                region = text[name_end:name_end + region_len] if blob is None \
                    else blob[name_end:name_end + region_len].decode()
                outputs.append(RequestedOutput(name, classes, region, where, size))
            at = name_end + region_len
    if d != n_dims or at != blob_len:
        raise DescriptorError(f"its records take {d} of {n_dims} dimensions and {at} of {blob_len} bytes of text")
    return InferRequest(model, version, inputs, outputs, rid, params, sequence_id, seq_flags, priority, timeout_us,
                        sent_ns, bool(bits & TRACED), stream if bits & STREAMED else None)
