"""The gateway's connection limits (services/gateway/conn.py): a client that sends its headers or
its body slowly is cut at the deadline with a 408, and connections over the cap get a 503. The
gateway runs against a coordinator address nothing listens on: these limits act before the app."""
from __future__ import annotations

import socket
import time

import pytest

from echospec.services.common.config import GatewayConfig
from echospec.services.gateway import server as gserver
from ports import unused_port


def _dead_target() -> str:
    return f"127.0.0.1:{unused_port()}"   # nothing listens there (tests/ports.py)


@pytest.fixture()
def gateway(request):
    kw = getattr(request, "param", {})
    g = gserver.start(GatewayConfig(port=0, coordinator_target=_dead_target(), **kw))
    yield g
    g.stop(0)


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            return out
        if not chunk:
            return out
        out += chunk


def _trickle(sock: socket.socket, pieces: list[bytes], every_s: float) -> tuple[float, bytes]:
    """Send one piece every ``every_s`` until the server answers or closes; returns (seconds
    from the first piece until then, what the server sent)."""
    t0 = time.monotonic()
    sock.settimeout(every_s)
    got = b""
    for piece in pieces:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            got = sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        break   # an answer or the close
    elapsed = time.monotonic() - t0
    return elapsed, got + _read_until_closed(sock, 2.0)


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 2.0}], indirect=True)
def test_a_slow_header_client_is_cut_at_the_header_timeout(gateway):
    """One header line a second would have held the connection forever: at 2 s it gets a 408
    naming the setting and the connection closes, although bytes kept arriving."""
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        lines = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n"]
        lines += [f"X-Slow-{i}: {i}\r\n".encode() for i in range(20)]
        elapsed, got = _trickle(s, lines, 1.0)
    assert 1.8 <= elapsed <= 4.0, elapsed
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert b"connection: close" in got.lower()
    assert b"request line and headers within 2 s (--header-timeout-s)" in got


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 30.0, "body_timeout_s": 1.5}],
                         indirect=True)
def test_a_slow_body_is_cut_at_the_body_timeout(gateway):
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 64\r\n\r\n")
        elapsed, got = _trickle(s, [b"{"] + [b" "] * 40, 0.5)
    assert 1.3 <= elapsed <= 3.5, elapsed
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert b"request body within 1.5 s (--body-timeout-s)" in got


def _get_health(s: socket.socket) -> bytes:
    """GET /health on a kept-alive connection: the status line and the JSON body the app
    answers (the coordinator is down: 503 with its status)."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(4096)
    assert body.startswith(b'{"status":'), (head, body)   # the app's answer, not a refusal
    return head


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 2.0}], indirect=True)
def test_the_header_deadline_starts_again_after_each_response(gateway):
    """A kept-alive connection whose requests each come within the deadline of the previous
    response stays open for longer than the deadline (the coordinator is down: /health is 503)."""
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        for _ in range(3):
            assert _get_health(s).startswith(b"HTTP/1.1 503"), "not answered"
            time.sleep(1.2)
        assert _get_health(s).startswith(b"HTTP/1.1 503")


@pytest.mark.parametrize("gateway", [{"max_connections": 3, "header_timeout_s": 30.0}],
                         indirect=True)
def test_connections_over_the_cap_are_refused_with_503(gateway):
    held = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(3)]
    try:
        time.sleep(0.3)   # the gateway has taken the three
        with socket.create_connection(("127.0.0.1", gateway.port)) as extra:
            got = _read_until_closed(extra, 5.0)
        assert got.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), got
        assert b"most connections at once (3, --max-connections)" in got
        # the held ones still work, and a freed place is taken again
        assert _get_health(held[0]).startswith(b"HTTP/1.1 503")
        held.pop().close()
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", gateway.port)) as again:
            assert _get_health(again).startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()


def test_serve_offers_the_limits_and_refuses_unusable_ones():
    from echospec import cli
    from echospec.cli import serve
    from echospec.services.common.config import check_ranges

    args = cli.parse_args(["serve", "--http-port", "0", "--http-header-timeout-s", "3",
                           "--http-body-timeout-s", "7", "--http-max-connections", "5"])
    g = serve.configs_of(args).gateway
    assert (g.header_timeout_s, g.body_timeout_s, g.max_connections) == (3.0, 7.0, 5)
    with pytest.raises(ValueError, match=r"--header-timeout-s / ECHOSPEC_HEADER_TIMEOUT_S 0\.0"):
        check_ranges(GatewayConfig(header_timeout_s=0.0))
    with pytest.raises(ValueError, match=r"--max-connections / ECHOSPEC_MAX_CONNECTIONS 0"):
        check_ranges(GatewayConfig(max_connections=0))
