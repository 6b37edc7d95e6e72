"""Long-lived bidi stream clients used by the coordinator (one per generation).

Sync gRPC Python has no client-side write(): a stream's requests come from an
iterator that gRPC drains on its own thread. ``BidiStream`` feeds that
iterator from a queue, so ``send`` never blocks and ``recv`` waits for the
next response. Ending the stream (``close``: half-close) lets the server free
the session; ``cancel`` aborts it at once.
"""
from __future__ import annotations

import queue
from typing import Any, Callable, Iterator

import grpc

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
        self._stream = BidiStream(stub.VerifyStream, timeout)

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
        return self._request(self._pb.VerifyStreamRequest(step=self._pb.VerifyRequest(draft=draft)))

    def _request(self, msg: Any) -> Any:
        try:
            return self._stream.request(msg).result
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
        self._stream = BidiStream(stub.ProposeStream, timeout)
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
