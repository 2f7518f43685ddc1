"""``pb_utils.InferenceRequest``: the requests ``execute`` receives, and the ones a model builds to
call another model (BLS, ``exec``/``async_exec``), with the options such a call takes.
"""
from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from . import runtime
from .errors import TritonModelException, not_supported
from .flags import TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
from .parameters import parameters_to_json
from .tensor import Tensor

if TYPE_CHECKING:
    from shmserve.workers.backend import Request


class MemoryType(enum.IntEnum):
    """Preferred memory for BLS outputs (``PreferredMemory``)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1

    def __str__(self) -> str:  # as Triton's (a pybind11 enum's), where IntEnum's reads "1"
        return f"MemoryType.{self.name}"


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


class PreferredMemory:
    """Where BLS output tensors should be placed; accepted and recorded so
    Triton model code runs unchanged, though BLS outputs here are always numpy
    arrays in CPU memory."""

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = MemoryType(preferred_memory_type)
        self.preferred_device_id = int(preferred_device_id)

    def __repr__(self) -> str:
        return (f"PreferredMemory({self.preferred_memory_type.name}, "
                f"{self.preferred_device_id})")


class InferenceTrace:
    """Trace handle; shmserve has no OpenTelemetry context to propagate, so
    ``get_context()`` returns None (what Triton returns when tracing is off). A traced request's
    handle collects the traces of the BLS requests made with it (``trace=request.trace()``), which
    its answer carries: each is a trace of its own whose parent is that request, as in Triton."""

    _children: Optional[list] = None  # a traced request's: its BLS requests' traces (shm/answer.py StepTrace)

    def __init__(self, context: Optional[str] = None) -> None:
        self._context = context or None

    def get_context(self) -> Optional[str]:
        return self._context

    @classmethod
    def _traced(cls) -> "InferenceTrace":
        """Worker hook: the handle of a request sampled for tracing."""
        trace = cls()
        trace._children = []
        trace._lock = threading.Lock()
        return trace

    def _add_child(self, step: Any, nested: Any = ()) -> None:
        """BLS hook: a child request's trace, then its own children's (an ensemble's steps, whose
        ``parent`` counts within them), placed after it."""
        from shmserve.shm.answer import add_step

        with self._lock:
            add_step(self._children, step, nested)


_REQUIRED: Any = object()


def _text(value: Any) -> Any:
    """``bytes`` as the str it encodes (UTF-8); anything else unchanged, for the type checks."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


def _check_required(inputs: Any, requested_output_names: Any, model_name: Any) -> None:
    """The three arguments Triton's binding requires by keyword (after two with defaults)."""
    for arg_name, value in (("inputs", inputs),
                            ("requested_output_names", requested_output_names),
                            ("model_name", model_name)):
        if value is _REQUIRED:
            raise TypeError(f"InferenceRequest() missing required argument '{arg_name}'")
        if value is None:
            raise TypeError(f"InferenceRequest() argument '{arg_name}' must not be None")


def _check_correlation_id(correlation_id: Any) -> None:
    if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
        raise TritonModelException("Correlation ID must be integer or string")
    if isinstance(correlation_id, int) and correlation_id < 0:
        raise TritonModelException("Correlation ID must be an unsigned integer or string")


def _unsigned(arg_name: str, value: Any) -> int:
    """``flags`` and ``timeout`` are unsigned in Triton's binding (uint32, uint64 microseconds):
    a negative value is refused with a TypeError there, and so here."""
    number = int(value)
    if number < 0:
        raise TypeError(f"InferenceRequest() argument '{arg_name}' must be an unsigned integer, got {number}")
    return number


def _by_name(inputs: list[Tensor]) -> dict[str, Tensor]:
    """The inputs by name (the first of a repeated name wins)."""
    by_name: dict[str, Tensor] = {}
    for t in inputs:
        if not isinstance(t, Tensor):
            raise TypeError(f"inputs must be Tensor objects, got {type(t).__name__}")
        by_name.setdefault(t.name(), t)
    return by_name


def _output_names(requested_output_names: Iterable[Any]) -> list[str]:
    """The names as str, each once, in the order given."""
    names: list[str] = []
    for n in map(_text, requested_output_names):
        if not isinstance(n, str):
            raise TypeError("requested_output_names must be strings")
        if n not in names:
            names.append(n)
    return names


class InferenceRequest:
    """One inference request: those handed to ``execute`` (the worker builds them with
    ``_incoming``), and those a model builds to call another model with ``exec``.
    """

    _response_sender: Any = None  # set by the worker for the requests handed to ``execute``
    # Fields alike for every request the worker builds (``_incoming``); ``__init__`` and
    # ``_set_cancelled`` set the instance's own, and ``trace()`` makes a request's trace handle
    # when it is first asked for.
    _model_version = -1
    _timeout = 0
    _preferred_memory: Optional[PreferredMemory] = None
    _trace: Optional[InferenceTrace] = None
    _cancelled = False
    _cancel: Any = None  # the worker's CancelFlag of an incoming request (its client may cancel it)

    def __init__(  # Triton's signature
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = _REQUIRED,
        requested_output_names: Iterable[str] = _REQUIRED,
        model_name: str = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Optional[PreferredMemory] = None,
        trace: Optional[InferenceTrace] = None,
        parameters: Optional[Mapping[str, Any]] = None,
    ) -> None:
        _check_required(inputs, requested_output_names, model_name)
        # Strings may come as bytes (e.g. a BYTES input's as_numpy()[0]), as Triton's binding takes them.
        request_id, model_name = _text(request_id), _text(model_name)
        if not isinstance(request_id, str):
            raise TypeError("request_id must be a str")
        _check_correlation_id(correlation_id)
        if not isinstance(model_name, str):
            raise TypeError("model_name must be a str")
        input_list = list(inputs)
        self._inputs_by_name = _by_name(input_list)
        self._requested_output_names = _output_names(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = input_list
        self._model_name = model_name
        self._model_version = int(model_version)
        self._flags = _unsigned("flags", flags)
        self._timeout = _unsigned("timeout", timeout)
        self._preferred_memory = preferred_memory
        self._trace = trace if trace is not None else InferenceTrace()
        self._parameters = parameters_to_json(parameters)
        self._cancelled = False

    @classmethod
    def _incoming(cls, model_name: str, inputs: list[Tensor], request: Request) -> "InferenceRequest":
        """Worker hook: ``request`` as the server validated it (its inputs' names are distinct),
        with ``inputs`` its arrays wrapped as Tensors, built without ``__init__``'s argument
        checks: the same fields, the same values (those alike for every such request are the
        class's)."""
        self = cls.__new__(cls)
        self._request_id = request.id
        self._correlation_id = request.correlation_id
        self._inputs = inputs
        self._inputs_by_name = {t._name: t for t in inputs}
        self._requested_output_names = list(dict.fromkeys(request.requested_outputs))
        self._model_name = model_name
        self._flags = int(request.flags)
        self._timeout = request.timeout_us
        parameters = request.parameters
        self._parameters = parameters_to_json(parameters, compact=True) if parameters else "{}"
        if request.traced:
            self._trace = InferenceTrace._traced()
        return self

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> set[str]:
        """A set, as in Triton (order carries no meaning)."""
        return set(self._requested_output_names)

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        """Timeout in microseconds; 0 means none."""
        return self._timeout

    def parameters(self) -> str:
        """Request parameters as a JSON object string (use json.loads)."""
        return self._parameters

    def trace(self) -> InferenceTrace:
        if self._trace is None:
            self._trace = InferenceTrace()  # each request its own, as in Triton
        return self._trace

    def is_cancelled(self) -> bool:
        """Whether the client cancelled this request (Triton's semantics: the model may check
        and stop early; a response it still returns is discarded by the client)."""
        return self._cancelled or (self._cancel is not None and self._cancel.is_set())

    def _set_cancelled(self, cancelled: bool = True) -> None:
        """Worker hook: mark the request cancelled by the client."""
        self._cancelled = bool(cancelled)

    def set_release_flags(self, flags: int) -> None:
        """RELEASE_ALL is the default and accepted; rescheduling is not."""
        if int(flags) & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise not_supported("Request rescheduling (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)")

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model (BLS) and wait for its response; with
        ``decoupled=True``, an iterator over the (zero or more) responses of a decoupled model."""
        bls = runtime.executor("BLS is only available inside a model's execute()")
        return bls.stream(self) if decoupled else bls.execute(self)

    def async_exec(self, decoupled: bool = False) -> Any:
        """The awaitable form of ``exec`` (for ``async def execute``); with ``decoupled=True`` it
        resolves, once the request is sent, to the same iterator as ``exec`` (``for``/``next()``
        as in Triton, ``async for``, and ``cancel()``)."""
        bls = runtime.executor("BLS is only available inside a model's execute()")
        return bls.stream_async(self) if decoupled else bls.execute_async(self)

    def get_response_sender(self) -> Any:
        """The sender of this request's responses (``send(response, flags)``, from any thread,
        also after ``execute`` returned): a decoupled model sends any number, a non-decoupled one
        exactly one, then ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` (with it or in a later send),
        and returns None for it from ``execute`` (Triton 24.06+; see python_backend/sender.py).
        Only requests handed to ``execute`` have one."""
        sender = self._response_sender
        if sender is None:
            raise TritonModelException("get_response_sender() is only available for the requests "
                                       "handed to execute()")
        sender.handed_out()
        return sender

    def __repr__(self) -> str:
        return (f"InferenceRequest(model_name={self._model_name!r}, "
                f"request_id={self._request_id!r}, inputs={[t.name() for t in self._inputs]})")


def get_input_tensor_by_name(inference_request: Any, name: str) -> Optional[Tensor]:
    """Input Tensor called ``name``, or None when the request lacks it."""
    by_name = getattr(inference_request, "_inputs_by_name", None)
    if by_name is not None:
        return by_name.get(name)
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None
