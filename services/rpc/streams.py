"""A long-lived bidi stream over grpcio's public API, used by the verifier's draft link.

``BidiStream`` feeds a call from a queue: gRPC drains the request iterator on
its own thread, so ``send`` never blocks. A reader thread takes each response
as it arrives into a second queue, so the read is already done when ``recv``
asks for it: a proposal that arrived while the engine computed costs ``recv``
a queue get, not a receive operation started then and a hand-off from gRPC's
polling thread (about 0.1 ms a round). Ending the stream (``close``:
half-close) lets the server free its session; ``cancel`` aborts it at once
(from any thread), or, once the stream is closed, gives the server
``CLOSE_GRACE_S`` to read what was sent and end the call itself.
"""
from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from typing import Any, Callable, Iterator

import grpc

_END = None

# seconds a half-closed call may still take to end by itself once ``cancel`` is asked for: the
# server reads the requests sent before the half-close (a draft session's last output, which its
# namespace keeps) and ends the call; a server that does not is cancelled then
CLOSE_GRACE_S = 2.0


class _Reaper:
    """Cancels the half-closed calls that have not ended by their time (one thread for all,
    running while any waits)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, "BidiStream"]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._running = False

    def add(self, stream: "BidiStream", delay: float) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), stream))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="bidi-stream-reaper", daemon=True).start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._heap:
                    self._running = False
                    return
                when = self._heap[0][0]
                now = time.monotonic()
                if when > now:
                    self._cv.wait(when - now)
                    continue
                stream = heapq.heappop(self._heap)[2]
            if not stream.ended.is_set():
                stream._call.cancel()


_REAPER = _Reaper()


class _Ended:
    """The reader's last item: what every ``recv`` raises from then on."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class BidiStream:
    """A bidi call fed from a queue, its responses read ahead by a thread.

    Args:
        method: a stub's stream-stream callable (e.g. stub.ProposeStream).
        timeout: seconds until the call's deadline (None: no deadline).
    """

    def __init__(self, method: Callable[..., Any], timeout: float | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._end: BaseException | None = None
        self._peeked: Any = None       # a response (or _Ended) taken off the queue by poll
        self.ended = threading.Event()   # set once the call has ended (its status read)
        self._reaping = False
        if getattr(method, "takes_wake", False):   # an in-process call (services/rpc/inproc.py)
            self._call = method(self._requests(), timeout=timeout, wake=self._end_requests)
        else:
            self._call = method(self._requests(), timeout=timeout)
        self._closed = False
        threading.Thread(target=self._read, name="bidi-stream-reader", daemon=True).start()

    def _requests(self) -> Iterator[Any]:
        while True:
            msg = self._q.get()
            if msg is _END:
                return
            yield msg

    def _end_requests(self) -> None:
        """End the request iterator (the call ended: nothing more will be sent)."""
        self._q.put(_END)

    def _read(self) -> None:
        """Every response into the queue, then how the call ended (its status, or
        StopIteration when the server ended it with OK)."""
        try:
            for resp in self._call:
                self._responses.put(resp)
            self._responses.put(_Ended(StopIteration()))
        except grpc.RpcError as exc:   # the call itself: code() and details() of the status
            self._responses.put(_Ended(exc))
        except Exception as exc:  # noqa: BLE001  any other failure still ends a waiting recv
            self._responses.put(_Ended(exc))
        finally:
            self.ended.set()

    def send(self, msg: Any) -> None:
        """Queue one request (non-blocking)."""
        if not self._closed:
            self._q.put(msg)

    def recv(self, timeout: float | None = None) -> Any:
        """Wait for the next response, at most ``timeout`` seconds (None: until one comes).

        Raises:
            grpc.RpcError: the call failed (status code and details from the peer).
            StopIteration: the server ended the stream.
            TimeoutError: no response within ``timeout`` (the call goes on: cancel it, or a
                late response is the next recv's).
        """
        if self._end is None:
            item, self._peeked = self._peeked, None
            try:
                if item is None:
                    item = self._responses.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no response within {timeout:g} s") from None
            if not isinstance(item, _Ended):
                return item
            self._end = item.exc
        raise self._end

    def buffered(self) -> int:
        """Responses (or the call's end) read ahead and not yet taken by ``recv``."""
        return self._responses.qsize() + (self._peeked is not None)

    def poll(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds for a response (or the call's end) that ``recv`` would
        return at once; True when there is one."""
        if self._end is not None or self._peeked is not None:
            return True
        try:
            self._peeked = self._responses.get(timeout=timeout) if timeout > 0 else \
                self._responses.get_nowait()
        except queue.Empty:
            return False
        return True

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
        """Cancel the call (frees the server side at once); a closed stream's call is left
        CLOSE_GRACE_S to end by itself first (the server reads what was sent before the
        half-close), then cancelled. Idempotent."""
        if self._closed:
            if not self._reaping and not self.ended.is_set():
                self._reaping = True
                _REAPER.add(self, CLOSE_GRACE_S)
            return
        self._call.cancel()   # first: a waiting recv then sees CANCELLED, not the half-close's end
        self.close()
