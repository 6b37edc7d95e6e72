"""The gateway's HTTP/1.1 connections: read deadlines and a cap on how many are open at once.

uvicorn closes a connection that sits idle between requests (``timeout_keep_alive``), but not one
that sends its request slowly: a client sending one header line every few seconds held its
connection for as long as it liked, and every one it opened was accepted. ``protocol_class``
builds uvicorn's h11 protocol with three limits (GatewayConfig):

    header_timeout_s  from the moment a connection opens (or its previous response ends) until
                      the request line and every header are in; the deadline is not moved by
                      the bytes that arrive, so a trickle cannot hold it open
    body_timeout_s    from the end of the headers until the whole body is in
    max_connections   connections open at once; one more is answered 503 and closed

A deadline that passes is answered ``408 Request Timeout`` (``Connection: close``, a plain-text
reason) and the connection is closed; a request whose body was late reaches the app as a client
disconnect. No gRPC import here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("echospec.gateway")

LOG_EVERY_S = 10.0   # at most one log line per kind of refusal this often (an attack is many)


@dataclass
class ConnectionLimits:
    """The limits of ``protocol_class`` (seconds; connections)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


class _Tally:
    """Counts refusals of one kind and logs them at most once per LOG_EVERY_S."""

    def __init__(self, what: str):
        self.what = what
        self.count = 0
        self._logged_at = float("-inf")

    def add(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("%s (%s; %d so far)", self.what, detail, self.count)
            self._logged_at = now


def _raw_response(status: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode("ascii", "replace")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode("ascii") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ConnectionLimits (set on the class by ``protocol_class``)."""

    limits: ConnectionLimits
    refused: _Tally
    late_headers: _Tally
    late_body: _Tally

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase = ""            # "headers", "body" or "" (the app has the request)
        self._deadline = None       # the TimerHandle of the phase's deadline
        if len(self.connections) > self.limits.max_connections:
            self.refused.add(f"max_connections {self.limits.max_connections}")
            transport.write(_raw_response(
                503, "Service Unavailable",
                f"the gateway holds its most connections at once ({self.limits.max_connections}, "
                f"--max-connections): retry later"))
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()   # may start the next request's cycle
        self._arm()

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _arm(self) -> None:
        """Keep the deadline of the phase the client is in: a new deadline when the phase
        changes, the same one while it lasts (bytes that arrive do not move it)."""
        if self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else ""
        if phase == self._phase:
            return
        self._cancel()
        self._phase = phase
        if phase:
            t = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(t, self._expired, phase, t)

    def _expired(self, phase: str, timeout_s: float) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._phase != phase:
            return
        flag = "--header-timeout-s" if phase == "headers" else "--body-timeout-s"
        what = ("its request line and headers" if phase == "headers"
                else "its request body")
        client = "%s:%d" % tuple(self.client[:2]) if self.client else "a client"
        (self.late_headers if phase == "headers" else self.late_body).add(
            f"last from {client}")
        self.transport.write(_raw_response(
            408, "Request Timeout",
            f"the client did not send {what} within {timeout_s:g} s ({flag})"))
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """A LimitedH11Protocol subclass bound to ``limits`` (uvicorn.Config's ``http``)."""
    return type("GatewayH11Protocol", (LimitedH11Protocol,), {
        "limits": limits,
        "refused": _Tally("refused a connection: the gateway holds its most connections at once"),
        "late_headers": _Tally("closed a connection whose request headers were late "
                               "(--header-timeout-s)"),
        "late_body": _Tally("closed a connection whose request body was late (--body-timeout-s)"),
    })
