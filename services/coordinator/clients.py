"""Long-lived bidi stream clients used by the coordinator (one per generation).

Two implementations of one interface (send, recv, request, close, cancel):

``DirectStream`` (the default) runs the call on the calling thread. It drives
the call's own completion queue: ``send`` starts the write at once and
``recv`` blocks in the queue until the response arrives. No other thread
takes part, so a round trip costs no thread hand-off on the client side.
(Sync gRPC's public stream API makes two per round trip: the queue-fed
request iterator is drained by a gRPC thread, and responses are delivered by
the channel's polling thread; together about 0.1-0.4 ms on a 2-core host,
see bench/round_overhead.py.) It uses grpcio's Cython call layer
(``grpc._cython.cygrpc`` segregated calls, the machinery of grpc's own
single-threaded unary-stream option); ``open_stream`` falls back to
``BidiStream`` when that layer is not there.

``BidiStream`` is the portable form: a queue-fed request iterator that gRPC
drains on its own thread; ``send`` never blocks and ``recv`` waits for the
next response.

Ending the stream (``close``: half-close) lets the server free the session;
``cancel`` aborts it at once (from any thread).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

import grpc

try:  # grpcio's call layer (see DirectStream); absent in other gRPC builds
    from grpc import _channel as _grpc_channel
    from grpc import _common as _grpc_common
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # pragma: no cover - depends on the installed grpcio
    _cygrpc = None

_END = None


class BidiStream:
    """A bidi call fed from a queue.

    Args:
        method: a stub's stream-stream callable (e.g. stub.VerifyStream).
        timeout: seconds until the call's deadline (None: no deadline).
    """

    def __init__(self, method: Callable[..., Any], timeout: float | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(self._requests(), timeout=timeout)
        self._closed = False

    def _requests(self) -> Iterator[Any]:
        while True:
            msg = self._q.get()
            if msg is _END:
                return
            yield msg

    def send(self, msg: Any) -> None:
        """Queue one request (non-blocking)."""
        if not self._closed:
            self._q.put(msg)

    def recv(self) -> Any:
        """Wait for the next response.

        Raises:
            grpc.RpcError: the call failed (status code and details from the peer).
            StopIteration: the server ended the stream.
        """
        return next(self._call)

    def request(self, msg: Any) -> Any:
        """send then recv."""
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        """Half-close: no more requests (the server then ends the stream). Idempotent."""
        if not self._closed:
            self._closed = True
            self._q.put(_END)

    def cancel(self) -> None:
        """Cancel the call (frees the server side at once). Idempotent."""
        self.close()
        self._call.cancel()


class StreamError(grpc.RpcError):
    """A DirectStream call ended with a non-OK status (``code()``, ``details()`` as grpc.Call)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_OP = _cygrpc.OperationType if _cygrpc is not None else None


class DirectStream:
    """A bidi call driven on the calling thread (see the module docstring).

    One thread owns the stream (send, recv, request, close); ``cancel`` may
    come from any thread. At most one write is in flight: ``send`` first
    collects the completion of the previous one (it has normally completed
    by the time its response is read).

    Args:
        method: a stub's stream-stream callable (e.g. stub.VerifyStream).
        timeout: seconds until the call's deadline (None: no deadline; a
            deadline of the enclosing server call still applies).
    Raises:
        TypeError: ``method`` is not a grpcio channel's stream-stream callable.
    """

    def __init__(self, method: Any, timeout: float | None = None):
        channel = getattr(method, "_channel", None)
        if _cygrpc is None or not hasattr(channel, "segregated_call"):
            raise TypeError("DirectStream needs a grpcio stream-stream callable")
        self._ser = method._request_serializer
        self._deser = method._response_deserializer
        deadline = None if timeout is None else time.time() + timeout
        flags = _grpc_channel._InitialMetadataFlags()
        ops = (((_cygrpc.SendInitialMetadataOperation(None, flags),), None),
               ((_cygrpc.ReceiveStatusOnClientOperation(0),), None),
               ((_cygrpc.ReceiveInitialMetadataOperation(0),), None))
        self._call = channel.segregated_call(
            _cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method._method, None,
            _grpc_channel._determine_deadline(deadline), None, None, ops, method._context,
            getattr(method, "_registered_call_handle", None))
        self._due = len(ops)          # batches started and not yet completed
        self._sending = False         # a write is in flight
        self._receiving = False       # a read is in flight
        self._response: bytes | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._closed = False
        self._lock = threading.Lock()  # close vs cancel

    def _operate(self, op: Any) -> bool:
        if self._due == 0:
            return False
        ok = self._call.operate((op,), None)
        if ok:
            self._due += 1
        return bool(ok)

    def _pump(self) -> None:
        """Wait for the next completed batch and record what it did."""
        event = self._call.next_event()
        self._due -= 1
        for op in event.batch_operations:
            kind = op.type()
            if kind == _OP.send_message:
                self._sending = False
            elif kind == _OP.receive_message:
                self._receiving = False
                self._response = op.message()
            elif kind == _OP.receive_status_on_client:
                code = _grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE.get(op.code())
                self._code = code if code is not None else grpc.StatusCode.UNKNOWN
                self._details = op.details() or ""
                if isinstance(self._details, bytes):
                    self._details = self._details.decode(errors="replace")

    def send(self, msg: Any) -> None:
        """Start writing one request (returns once the write is started)."""
        if self._closed or self._code is not None:
            return
        while self._sending and self._due:
            self._pump()
        self._sending = self._operate(_cygrpc.SendMessageOperation(_grpc_common.serialize(msg, self._ser), 0))

    def recv(self) -> Any:
        """Wait for the next response.

        Raises:
            grpc.RpcError: the call failed (StreamError: status code and details from the peer).
            StopIteration: the server ended the stream.
        """
        if not self._receiving and self._code is None:
            self._receiving = self._operate(_cygrpc.ReceiveMessageOperation(0))
        while self._receiving and self._due:
            self._pump()
        data, self._response = self._response, None
        if data is not None:
            return _grpc_common.deserialize(data, self._deser)
        while self._code is None and self._due:
            self._pump()
        if self._code is None or self._code == grpc.StatusCode.OK:
            raise StopIteration
        raise StreamError(self._code, self._details)

    def request(self, msg: Any) -> Any:
        """send then recv."""
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        """Half-close, then collect the call's end (the server ends the stream). Idempotent.

        Returns when the status has arrived: at once after a cancel, within a
        round trip from a live server, by the call's deadline at worst.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._code is None:
            while self._sending and self._due:
                self._pump()
            self._operate(_cygrpc.SendCloseFromClientOperation(0))
        while self._due:
            self._pump()

    def cancel(self) -> None:
        """Cancel the call (frees the server side at once); any thread. Idempotent."""
        if self._due:
            self._call.cancel(_cygrpc.StatusCode.cancelled, "cancelled by the coordinator")


def open_stream(method: Callable[..., Any], timeout: float | None = None) -> "DirectStream | BidiStream":
    """A DirectStream on ``method``, or a BidiStream where grpcio's call layer is unavailable."""
    try:
        return DirectStream(method, timeout)
    except TypeError:
        return BidiStream(method, timeout)


class VerifierFailure(Exception):
    """The verifier refused or failed a request: ``code`` is the grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"verifier: {details}")
        self.code = code
        self.details = details


class DraftUnavailable(Exception):
    """The draft service cannot be reached or failed; the reason is the message."""


def _verifier_failure(exc: grpc.RpcError) -> VerifierFailure:
    return VerifierFailure(exc.code(), exc.details() or str(exc.code()))


class VerifierLink:
    """One verifier session over a VerifyStream.

    Args:
        stub: VerifierServiceStub. timeout: the generation's deadline in seconds.
    """

    def __init__(self, stub: Any, timeout: float | None):
        from echospec.v1 import verifier_pb2
        self._pb = verifier_pb2
        self._stream = open_stream(stub.VerifyStream, timeout)

    def prefill(self, tokens: list[int], sampling: Any) -> Any:
        """Prefill the prompt; returns the StepResult (tokens = [first token]).

        Raises:
            VerifierFailure: the verifier's status (e.g. INVALID_ARGUMENT for a
                prompt that does not fit the context).
        """
        msg = self._pb.VerifyStreamRequest(
            prefill=self._pb.PrefillRequest(tokens=tokens, sampling=sampling))
        return self._request(msg)

    def step(self, draft: list[int]) -> Any:
        """Verify ``draft`` (K = 0: decode); returns the StepResult. Raises VerifierFailure."""
        self.send_step(draft)
        return self.recv_step()

    def send_step(self, draft: list[int]) -> None:
        """Start a step (verify ``draft``) without waiting: the verifier computes
        while the caller does other work; ``recv_step`` collects the result."""
        self._stream.send(self._pb.VerifyStreamRequest(step=self._pb.VerifyRequest(draft=draft)))

    def recv_step(self) -> Any:
        """The StepResult of the step started by ``send_step``. Raises VerifierFailure."""
        return self._recv()

    def _request(self, msg: Any) -> Any:
        self._stream.send(msg)
        return self._recv()

    def _recv(self) -> Any:
        try:
            return self._stream.recv().result
        except grpc.RpcError as exc:
            raise _verifier_failure(exc) from None
        except StopIteration:
            raise VerifierFailure(grpc.StatusCode.INTERNAL, "the verifier ended the stream") from None

    def close(self) -> None:
        self._stream.close()

    def cancel(self) -> None:
        self._stream.cancel()


class DraftLink:
    """One draft session over a ProposeStream, fed incrementally.

    Args:
        stub: DraftServiceStub. timeout: the generation's deadline in seconds.
    """

    def __init__(self, stub: Any, timeout: float | None, min_n: int = 0, max_n: int = 0):
        from echospec.v1 import draft_pb2
        self._pb = draft_pb2
        self._stream = open_stream(stub.ProposeStream, timeout)
        self._first = True
        self._min_n, self._max_n = min_n, max_n

    def _msg(self, append: list[int], k: int) -> Any:
        m = self._pb.ProposeStreamRequest(append=append, k=k)
        if self._first:
            m.min_n, m.max_n = self._min_n, self._max_n
            self._first = False
        return m

    def append(self, tokens: list[int]) -> None:
        """Append tokens to the draft history (no response, non-blocking)."""
        self._stream.send(self._msg(tokens, 0))

    def propose(self, append: list[int], n: int) -> list[int]:
        """Append ``append`` and propose up to n tokens (one round trip).

        Raises:
            DraftUnavailable: the stream failed (service down, refused, ended).
        """
        try:
            return list(self._stream.request(self._msg(append, n)).draft)
        except grpc.RpcError as exc:
            raise DraftUnavailable(f"draft service unreachable ({exc.code().name}:"
                                   f" {exc.details()})") from None
        except StopIteration:
            raise DraftUnavailable("draft service ended the stream") from None

    def close(self) -> None:
        self._stream.close()

    def cancel(self) -> None:
        self._stream.cancel()
