"""``request.get_response_sender()``: Triton's ``InferenceResponseSender``, with its rules and texts.

Triton (python_backend ``response_sender.cc``, r24.10) checks each ``send(response=None, flags=0)``:
the flags must be 0 or ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; flags 0 needs a response; a model
that is not decoupled sends exactly one response, and the final flag with it or after it; nothing
goes after the final flag. A refused send raises ``TritonModelException`` in the model.

What a send delivers goes to the sender's ``deliver(response, final)``: for a decoupled model the
request's stream (the worker's StreamSender, workers/stream.py); for any other a ``Reply``, which
hands the one response over once the final flag comes, during ``execute`` or after it returned
(workers/late_answers.py).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ..backend import Response
from ..late_answers import Deferred
from .convert import to_response
from .pb_utils import TRITONSERVER_RESPONSE_COMPLETE_FINAL as FINAL
from .pb_utils import TritonModelException

UNSUPPORTED_FLAG = "Unable to send response. Unsupported flag provided."
NO_RESPONSE = "Inference Response object must be provided when the response flags is set to zero."
MORE_THAN_ONE = "Unable to send response. Non-decoupled model cannot send more than one response."
FINAL_FIRST = "Unable to send response. Non-decoupled model cannot send complete final before sending a response."
CLOSED = "Unable to send response. Response sender has been closed."
# Not Triton's (its client waits for good): execute() returned None, or None for this request, and
# the model never asked for the sender, so no response can come; usually a missing `return`.
NOT_RETURNED = ("execute() returned no response for this request and the model never took its response sender "
                "(request.get_response_sender()): a model that is not decoupled returns a list of one "
                "pb_utils.InferenceResponse per request")

Deliver = Callable[[Response | None, bool], None]


class ResponseSender:
    """A request's sender. Sends are taken one at a time (a model may send from several threads),
    so responses reach the client in the order their sends were accepted."""

    __slots__ = ("_deliver", "_cancel", "_decoupled", "_lock", "_sent", "_closed", "__weakref__")

    def __init__(self, deliver: Deliver, cancel: Any, decoupled: bool) -> None:
        self._deliver = deliver
        self._cancel = cancel  # the request's CancelFlag (workers/backend.py)
        self._decoupled = decoupled
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False

    def send(self, response: Any = None, flags: int = 0) -> None:
        if flags != FINAL and flags != 0:
            raise TritonModelException(UNSUPPORTED_FLAG)
        if flags == 0 and response is None:
            raise TritonModelException(NO_RESPONSE)
        final = flags == FINAL
        with self._lock:
            self._count(response is not None, final)
            self._deliver(to_response(response) if response is not None else None, final)

    def returned(self) -> None:
        """``execute`` returned a response for this request: counted as a send with the final
        flag (Triton's stub does the same, so a sender that already sent refuses it)."""
        with self._lock:
            self._count(True, True)

    def _count(self, has_response: bool, final: bool) -> None:
        if not self._decoupled:
            if has_response and self._sent > 0:
                raise TritonModelException(MORE_THAN_ONE)
            if not has_response and final and self._sent == 0:
                raise TritonModelException(FINAL_FIRST)
        if self._closed:
            raise TritonModelException(CLOSED)
        self._closed = final
        self._sent += 1

    def handed_out(self) -> None:
        """The model asked for this sender (``request.get_response_sender()``): a non-decoupled
        request's ``Reply`` then waits for its sends, not for ``execute``'s return."""
        if not self._decoupled:
            self._deliver.handed_out()  # type: ignore[attr-defined] - a Reply (backend.py)

    def close(self) -> None:
        """``execute`` raised: its requests are answered with the error, and nothing more may be
        sent (as Triton's stub closes every sender of the batch)."""
        with self._lock:
            self._closed = True

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (it disconnected, timed out or cancelled):
        the model may stop sending; what it still sends is freed unread."""
        return self._cancel is not None and self._cancel.is_set()


class Reply(Deferred):
    """Where a non-decoupled model's sends go: the request's ``Deferred``, which keeps the response
    until the final flag finishes it (a send's rules are checked by the sender first)."""

    __slots__ = ("_first", "_handed")

    def __init__(self) -> None:
        super().__init__()
        self._first: Response | None = None
        self._handed = False  # the model asked for the request's sender

    def handed_out(self) -> None:
        self._handed = True

    def abandon(self) -> None:
        """The sender is gone with no final flag: a model that never asked for it returned no
        response for the request (a missing ``return``, most likely), and is told so."""
        if self._handed:
            super().abandon()
        else:
            self.finish(Response(error=NOT_RETURNED, status=500))

    def __call__(self, response: Response | None, final: bool) -> None:
        if response is not None:
            self._first = response
        if final and self._first is not None:
            self.finish(self._first)

    def answer(self) -> Response | Deferred:
        """The response if the final flag came, else itself, for the worker to wait on."""
        return self.response if self.done and self.response is not None else self
