"""A long-lived bidi stream over grpcio's public API, used by the verifier's draft link.

``BidiStream`` feeds a call from a queue: gRPC drains the request iterator on
its own thread, so ``send`` never blocks; ``recv`` waits for the next
response. Ending the stream (``close``: half-close) lets the server free its
session; ``cancel`` aborts it at once (from any thread).
"""
from __future__ import annotations

import queue
from typing import Any, Callable, Iterator

_END = None


class BidiStream:
    """A bidi call fed from a queue.

    Args:
        method: a stub's stream-stream callable (e.g. stub.ProposeStream).
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
