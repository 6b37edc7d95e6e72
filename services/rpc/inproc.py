"""Calls between services of the same process, without the network: a coordinator's
GenerateTokens to its verifier, and a verifier's ProposeStream to its draft service.

In one process (`echospec serve` without --processes) a coordinator's generation would otherwise
cross loopback gRPC to its verifier: each message serialized, sent over HTTP/2 and handed between
gRPC's threads on both sides, on the same cores as the engine. A verifier started in this process
registers its servicer and server handle under its address; the coordinator's pool then calls
GenerateTokens on it directly (`LocalVerifierStub`) and every other method over gRPC. A draft
service registers the same way, and a verifier's draft link runs its ProposeStream directly
(`LocalDraftStub`): a proposal waited for then costs two thread hand-offs (about 0.05 ms) where
loopback gRPC in one process took 0.5-1 ms, its request waiting for the GIL behind the other
servers' threads.

The call keeps what the coordinator relies on: an iterator of GenerateTokensResponse, cancel(),
the deadline, and failures as grpc.RpcError with code() and details(). The verifier's server
counts it like a call from the network (grpc_util.ConcurrencyLimit.local_stream: admission,
metrics, the shutdown message and the end of the grace period).
"""
from __future__ import annotations

import inspect
import threading
import time
from typing import Any, Callable, Iterator

import grpc

_LOCK = threading.Lock()
_LOCAL: dict[str, tuple[Any, Any]] = {}   # address -> (servicer, grpc_util.ServerHandle)

GENERATE_TOKENS = "/echospec.v1.VerifierService/GenerateTokens"
PROPOSE_STREAM = "/echospec.v1.DraftService/ProposeStream"


def register(address: str, servicer: Any, handle: Any) -> None:
    """Serve this process's GenerateTokens calls to ``address`` ("host:port") on ``servicer``."""
    with _LOCK:
        _LOCAL[address] = (servicer, handle)


def unregister(address: str, servicer: Any) -> None:
    """Calls to ``address`` go over gRPC again (the server is stopping)."""
    with _LOCK:
        if _LOCAL.get(address, (None,))[0] is servicer:
            del _LOCAL[address]


def local(address: str) -> tuple[Any, Any] | None:
    with _LOCK:
        return _LOCAL.get(address)


class LocalRpcError(grpc.RpcError):
    """An in-process call's status, as grpc.RpcError reports it: code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """The part of grpc.ServicerContext that the verifier's GenerateTokens and
    grpc_util.ConcurrencyLimit use, for a call made in this process."""

    def __init__(self, timeout: float | None):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._code: grpc.StatusCode | None = None     # set by abort
        self.status: tuple[grpc.StatusCode, str] | None = None   # set once the call has ended

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            if self.status is None:
                self._callbacks.append(fn)
                return True
        return False

    def is_active(self) -> bool:
        return self.status is None

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort(self, code: grpc.StatusCode, details: str):
        self._code = code
        raise _Aborted(code, details)

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """End the call (the first status stays) and run its termination callbacks once."""
        with self._lock:
            if self.status is not None:
                return
            self.status = (code, details)
            fns, self._callbacks = self._callbacks, []
        for fn in fns:
            fn()


class LocalCall:
    """One in-process streaming call (GenerateTokens by default): iterate it (once) for the
    responses; cancel() ends it from any thread, and the deadline ends it with
    DEADLINE_EXCEEDED, as gRPC would.

    Args:
        method: the full method name (admission, metrics); behavior: the servicer's handler
            (default servicer.GenerateTokens); request: its request, or its request iterator
            (a bidi call). wake: called once when the call ends by cancel, deadline or the
            server's stop: a bidi caller ends its request iterator there, so a handler waiting
            for the next request sees the end at once.
    """

    def __init__(self, servicer: Any, handle: Any, request: Any, timeout: float | None,
                 method: str = GENERATE_TOKENS, behavior: Callable[..., Any] | None = None,
                 wake: Callable[[], None] | None = None):
        self._ctx = LocalContext(timeout)
        behavior = behavior or servicer.GenerateTokens
        self._run = lambda: handle.limit.local_stream(method, behavior, request, self._ctx)
        if wake is not None:
            self._ctx.add_callback(wake)
        self._timer = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self._ctx.end,
                                          (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._timer.daemon = True
            self._timer.start()

    def __iter__(self) -> Iterator[Any]:
        ctx = self._ctx
        messages = None
        try:
            if ctx.status is None:
                messages = self._run()
                for msg in messages:
                    if ctx.status is not None:
                        break
                    yield msg
        except _Aborted as exc:
            ctx.end(exc.code, exc.details)
        except Exception as exc:  # noqa: BLE001 - a handler's failure, reported as gRPC does
            ctx.end(grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {exc}")
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if messages is not None:
                if ctx.status is None and not _exhausted(messages):
                    ctx.end(grpc.StatusCode.CANCELLED, "the caller left the call")
                messages.close()   # a handler left early runs its cleanup now
        ctx.end(grpc.StatusCode.OK, "")
        code, details = ctx.status
        if code != grpc.StatusCode.OK:
            raise LocalRpcError(code, details)

    def cancel(self) -> None:
        self._ctx.end(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")


def _exhausted(gen: Any) -> bool:
    return inspect.getgeneratorstate(gen) == inspect.GEN_CLOSED


class LocalVerifierStub:
    """A VerifierServiceStub for ``address`` whose GenerateTokens runs on the verifier of this
    process while it is registered (else over gRPC); every other method is ``stub``'s."""

    def __init__(self, stub: Any, address: str):
        self._stub = stub
        self._address = address

    def GenerateTokens(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        found = local(self._address)
        if found is None or found[1].stopping or not hasattr(found[0], "GenerateTokens"):
            return self._stub.GenerateTokens(request, timeout=timeout)
        return LocalCall(found[0], found[1], request, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


class LocalDraftStub:
    """A DraftServiceStub for ``address`` whose ProposeStream runs on the draft service of this
    process while it is registered (else over gRPC); every other method is ``stub``'s.

    ProposeStream takes ``wake`` beside grpc's arguments (``takes_wake``): the bidi stream's
    function that ends its request iterator (services/rpc/streams.py). ``internal_key``: the key
    the caller sends; a draft service demanding another one is called over gRPC, which refuses
    the call as it refuses any caller without its key."""

    def __init__(self, stub: Any, address: str, internal_key: str = ""):
        self._stub = stub
        self._address = address
        self._internal_key = internal_key

    def ProposeStream(self, request_iterator: Any, timeout: float | None = None,  # noqa: N802
                      wake: Callable[[], None] | None = None) -> Any:
        found = local(self._address)
        if (found is None or found[1].stopping or not hasattr(found[0], "ProposeStream")
                or found[1].internal_key not in ("", self._internal_key)):
            return self._stub.ProposeStream(request_iterator, timeout=timeout)
        return LocalCall(found[0], found[1], request_iterator, timeout, PROPOSE_STREAM,
                         found[0].ProposeStream, wake)

    ProposeStream.takes_wake = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)
