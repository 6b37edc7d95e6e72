"""The services' bidi stream client (services/rpc/streams.py, grpcio's public API)
against a real gRPC server on loopback: responses in order, append-only sends,
the peer's status, end of stream, cancel from another thread, deadline,
half-close. No timings are asserted here (speed lives in tools/perf/round_overhead.py).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from echospec.services.rpc import grpc_util, inproc
from echospec.services.rpc.streams import BidiStream

SERVICE = "echospec.test.Echo"
METHOD = f"/{SERVICE}/Echo"


class _Echo:
    """Echo each request; b"quiet:*" gets no response, b"abort" aborts with
    INVALID_ARGUMENT, b"end" ends the stream, b"slow" waits up to 5 s first."""

    def __init__(self):
        self.ended = threading.Event()
        self.got: list[bytes] = []

    def __call__(self, request_iterator, context):
        try:
            for m in request_iterator:
                self.got.append(m)
                if m.startswith(b"quiet:"):
                    continue
                if m == b"abort":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad message")
                if m == b"end":
                    return
                if m == b"slow":
                    t_end = time.monotonic() + 5
                    while context.is_active() and time.monotonic() < t_end:
                        time.sleep(0.01)
                yield b"re:" + m
        finally:
            self.ended.set()


class _EchoServicer:
    """The echo handler as a draft servicer's ProposeStream, for inproc.LocalDraftStub."""

    def __init__(self, handler):
        self.ProposeStream = handler


@pytest.fixture(params=["grpc", "in-process"])
def echo(request):
    """The echo method over loopback gRPC, or run in this process as a draft service's
    ProposeStream is (inproc.LocalDraftStub): the same stream semantics either way."""
    handler = _Echo()
    h = grpc_util.build_server("127.0.0.1", 0, 8, 1 << 20, [SERVICE])
    h.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.stream_stream_rpc_method_handler(handler)}),))
    h.server.start()
    address = f"127.0.0.1:{h.port}"
    ch = grpc_util.channel(address, 1 << 20)
    method = ch.stream_stream(METHOD)
    servicer = _EchoServicer(handler)
    if request.param == "in-process":
        inproc.register(address, servicer, h)
        fallback = type("Stub", (), {"ProposeStream": staticmethod(method)})()
        method = inproc.LocalDraftStub(fallback, address).ProposeStream
    yield method, handler
    inproc.unregister(address, servicer)
    ch.close()
    h.server.stop(0).wait()


KINDS = [BidiStream]


@pytest.mark.parametrize("cls", KINDS)
def test_responses_come_back_in_order(echo, cls):
    method, _ = echo
    s = cls(method)
    for i in range(50):
        assert s.request(b"m%d" % i) == b"re:m%d" % i
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_responses_are_read_ahead_before_recv_asks(echo, cls):
    """A response that arrives while the caller does something else (the engine's forward) is
    already taken off the call when recv asks: recv is a queue get, not a receive operation."""
    method, _ = echo
    s = cls(method)
    s.send(b"a")
    s.send(b"b")
    t_end = time.monotonic() + 10
    while s.buffered() < 2 and time.monotonic() < t_end:
        time.sleep(0.005)
    assert s.buffered() == 2
    assert s.recv() == b"re:a" and s.recv() == b"re:b"
    assert s.buffered() == 0
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_poll_says_whether_recv_would_wait_and_keeps_the_order(echo, cls):
    method, _ = echo
    s = cls(method)
    assert not s.poll() and not s.poll(0.02)       # nothing asked: nothing comes
    s.send(b"a")
    assert s.poll(10) and s.poll() and s.buffered() == 1
    s.send(b"b")
    assert s.recv() == b"re:a" and s.recv() == b"re:b"
    s.send(b"abort")
    assert s.poll(10)                               # the call's end counts: recv will not wait
    with pytest.raises(grpc.RpcError):
        s.recv()
    assert s.poll()
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_recv_gives_up_after_its_timeout_and_the_call_goes_on(echo, cls):
    method, _ = echo
    s = cls(method)
    s.send(b"quiet:1")
    with pytest.raises(TimeoutError):
        s.recv(timeout=0.05)
    assert s.request(b"a") == b"re:a"    # the call is still up
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_a_send_without_response_does_not_shift_later_replies(echo, cls):
    method, _ = echo
    s = cls(method)
    s.send(b"quiet:1")
    s.send(b"quiet:2")
    assert s.request(b"a") == b"re:a"
    s.send(b"quiet:3")
    assert s.request(b"b") == b"re:b"
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_the_peers_status_is_raised_with_code_and_details(echo, cls):
    method, _ = echo
    s = cls(method)
    assert s.request(b"x") == b"re:x"
    with pytest.raises(grpc.RpcError) as ei:
        s.request(b"abort")
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "bad message"
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_the_server_ending_the_stream_is_stop_iteration(echo, cls):
    method, _ = echo
    s = cls(method)
    with pytest.raises(StopIteration):
        s.request(b"end")
    s.close()


@pytest.mark.parametrize("cls", KINDS)
def test_cancel_from_another_thread_ends_a_waiting_recv(echo, cls):
    method, handler = echo
    s = cls(method)
    threading.Timer(0.2, s.cancel).start()
    with pytest.raises(grpc.RpcError) as ei:
        s.request(b"slow")
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    s.close()
    s.cancel()  # idempotent
    assert handler.ended.wait(10)


@pytest.mark.parametrize("cls", KINDS)
def test_the_deadline_ends_the_call(echo, cls):
    method, handler = echo
    s = cls(method, timeout=0.3)
    with pytest.raises(grpc.RpcError) as ei:
        s.request(b"slow")
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s.close()
    assert handler.ended.wait(10)


@pytest.mark.parametrize("cls", KINDS)
def test_close_half_closes_and_the_server_ends_the_stream(echo, cls):
    method, handler = echo
    s = cls(method)
    assert s.request(b"x") == b"re:x"
    s.close()
    s.close()  # idempotent
    assert handler.ended.wait(10)
    s.send(b"after close")  # ignored, no error


@pytest.mark.parametrize("cls", KINDS)
def test_cancel_after_close_lets_the_server_read_what_was_sent(echo, cls):
    # a draft session's last output goes out just before the half-close; the cancel that follows
    # the end of the verifier's call must not drop it (the namespace keeps what the server read)
    method, handler = echo
    s = cls(method)
    sent = [b"quiet:%d" % i for i in range(200)]
    for m in sent:
        s.send(m)
    s.close()
    s.cancel()
    assert handler.ended.wait(10)
    assert handler.got == sent


@pytest.mark.parametrize("cls", KINDS)
def test_a_closed_call_that_does_not_end_is_cancelled_after_the_grace(echo, cls, monkeypatch):
    from echospec.services.rpc import streams
    monkeypatch.setattr(streams, "CLOSE_GRACE_S", 0.2)
    method, handler = echo
    s = cls(method)
    s.send(b"slow")   # the server keeps the call for 5 s unless it is cancelled
    s.close()
    t0 = time.monotonic()
    s.cancel()
    s.cancel()   # idempotent: one cancel to come
    assert s.ended.wait(4) and handler.ended.wait(4)
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("cls", KINDS)
def test_after_the_end_every_recv_raises_the_same_status(echo, cls):
    method, _ = echo
    s = cls(method)
    with pytest.raises(grpc.RpcError):
        s.request(b"abort")
    s.send(b"x")  # ignored by the ended call, never a crash
    with pytest.raises(grpc.RpcError) as ei:
        s.recv()
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s.close()


def test_an_in_process_stream_ends_with_unavailable_when_its_server_stops():
    """The server's stop ends an in-process stream at once (as gRPC ends the network's), even one
    whose handler waits for the next request: a waiting recv gets UNAVAILABLE, not its timeout."""
    handler = _Echo()
    h = grpc_util.build_server("127.0.0.1", 0, 8, 1 << 20, [SERVICE])
    h.server.start()
    address = f"127.0.0.1:{h.port}"
    servicer = _EchoServicer(handler)
    inproc.register(address, servicer, h)
    try:
        method = inproc.LocalDraftStub(None, address).ProposeStream
        s = BidiStream(method)
        assert s.request(b"a") == b"re:a"
        s.send(b"quiet:1")
        threading.Timer(0.2, lambda: h.stop(0, "test")).start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            s.recv(timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down (test)" in ei.value.details()
        assert time.monotonic() - t0 < 5
        assert handler.ended.wait(10)
    finally:
        inproc.unregister(address, servicer)
        h.server.stop(0).wait()
