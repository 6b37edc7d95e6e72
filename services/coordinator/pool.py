"""The coordinator's verifiers: addresses, channels, health and load, refreshed in the background.

Targets (``--verifier``, repeatable):
    host:port            one verifier
    dns:///name:port     every address ``name`` resolves to (a Kubernetes headless
                         Service lists one address per ready verifier pod),
                         resolved again every ``resolve_s`` seconds: new
                         addresses join, vanished ones leave once their
                         generations end.

A monitor thread polls every verifier every ``poll_s`` seconds: grpc.health.v1
Check (SERVING or not) and GetConfig (its model, limits and load:
active_sessions, max_sessions, free_kv_tokens). A call that fails to reach a
verifier marks it unhealthy at once (``report_failure``); only a later poll
that finds it SERVING makes it a candidate again. The choice itself is
balancer.route (pure), over the prefixes each verifier is predicted to hold
(balancer.PrefixIndex: what generations sent there held; forgotten when the
verifier is found unhealthy or leaves).

``on_health(serving, why)`` is called whenever the pool goes from "some verifier healthy" to
"none" or back (the coordinator's own grpc.health.v1 status follows it, so a probe or the gateway
sees NOT_SERVING while no verifier is reachable). A verifier found unhealthy loses its last load
report (active sessions, free KV): those figures described a verifier that no longer answers.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.v1 import verifier_pb2, verifier_pb2_grpc
from echospec.services.rpc import grpc_util, inproc
from echospec.services.coordinator.balancer import Backend, PrefixIndex, block_hashes, route

log = logging.getLogger("echospec.coordinator")
WAIT_LOG_S = 10.0   # wait_healthy says what it waits for this often

VERIFIER_SERVICE = "echospec.v1.VerifierService"
DNS_PREFIX = "dns:///"

# (host, port) -> ["ip:port", ...]; raises OSError when the name does not resolve.
Resolver = Callable[[str, int], list[str]]


def attention_of(b: Backend) -> tuple[str, bool, str]:
    """What a verifier's attention keeps and reads: (kv_eviction, sparse_attention, kv_type)."""
    return (b.kv_eviction, b.sparse_attention, b.kv_type)


def describe_attention(a: tuple[str, bool, str]) -> str:
    """``attention_of``'s tuple in words for a log line."""
    eviction, sparse, kv_type = a
    return (f"KV eviction {eviction!r}, sparse attention {'on' if sparse else 'off'}, "
            f"KV type {kv_type}")


class NoVerifier(Exception):
    """No healthy verifier can take the generation (the message lists why each is out)."""


def _why_not(e: "_Entry", tried: bool) -> str:
    """Why a known verifier was not chosen, for NoVerifier's message."""
    b = e.backend
    if b.last_error:
        return b.last_error
    if tried:
        return "already tried for this request"
    if e.removed:
        return "no longer listed"
    if e.config is None or not b.healthy:
        return "not ready"
    return f"healthy, busy ({b.estimated_active}/{b.max_sessions} sessions)"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (getaddrinfo, TCP), as sorted unique "ip:port"."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({grpc_util.host_port(info[4][0], port) for info in infos})


def parse_target(target: str) -> tuple[str, str, int]:
    """("static", "host:port", 0) or ("dns", name, port).

    Raises:
        ValueError: an empty target, or a dns:/// target without name:port.
    """
    t = target.strip()
    if not t:
        raise ValueError("empty verifier target")
    if t.startswith(DNS_PREFIX):
        rest = t[len(DNS_PREFIX):]
        name, sep, port = rest.rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"verifier target {target!r}: expected dns:///name:port")
        return "dns", name, int(port)
    if "://" in t:
        raise ValueError(f"verifier target {target!r}: host:port or dns:///name:port")
    return "static", t, 0


@dataclass
class _Entry:
    backend: Backend
    channel: grpc.Channel
    stub: Any
    health: Any
    config: Any = None             # the last GetConfigResponse
    sources: set = field(default_factory=set)   # the targets that list this address
    removed: bool = False
    tls_mismatch: Any = None       # grpc_util.TlsMismatch of this address


class Lease:
    """One generation's hold on a verifier: its stub, released exactly once."""

    def __init__(self, pool: "VerifierPool", entry: _Entry, route: str = ""):
        self._pool = pool
        self._entry = entry
        self.address = entry.backend.address
        self.route = route            # why the balancer picked it ("prefix 512 tokens", ...)
        self.stub = entry.stub
        self.config = entry.config
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._entry)


class VerifierPool:
    """Every verifier the coordinator balances over.

    Args:
        targets: host:port and dns:///name:port strings (at least one).
        max_message_bytes: the channels' message cap.
        poll_s: health + load poll period. resolve_s: DNS re-resolution period.
        resolver: (host, port) -> addresses; default system_resolver (getaddrinfo).
        metrics: a PromMetrics with the per-verifier series, or None.
        tls: TLS settings of the channels to the verifiers (None: plain text).
        prefix_slack: balancer.route's slack: the prefix holder serves a prompt unless it has
            more than this many active sessions above the least-loaded verifier (< 0: off).
    Raises:
        ValueError: a malformed target.
    """

    def __init__(self, targets: Sequence[str], max_message_bytes: int, poll_s: float = 1.0,
                 resolve_s: float = 10.0, resolver: Resolver | None = None, metrics: Any = None,
                 tls: grpc_util.Tls | None = None, internal_key: str = "",
                 prefix_slack: int = -1):
        if not targets:
            raise ValueError("no verifier target")
        self._targets = [parse_target(t) for t in targets]
        self._max_message_bytes = max_message_bytes
        self._tls = tls
        self._internal_key = internal_key   # sent on every call to a verifier ("": none)
        self.poll_s = max(0.05, poll_s)
        self.resolve_s = max(0.05, resolve_s)
        self._resolver = resolver or system_resolver
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.prefix_slack = prefix_slack
        self._prefix = PrefixIndex()   # guarded by _lock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_resolve = 0.0
        self.on_health: Callable[[bool, str], None] | None = None
        self._published: bool | None = None
        self._publish_lock = threading.Lock()
        self.resolve()

    # -- membership -------------------------------------------------------------------------
    def resolve(self) -> None:
        """Resolve every target now; add new addresses, retire vanished ones.

        A name that fails to resolve keeps its previous addresses (logged), so a
        DNS hiccup never empties the pool.
        """
        wanted: dict[str, set[str]] = {}
        failed: set[str] = set()
        for kind, name, port in self._targets:
            src = name if kind == "static" else f"{DNS_PREFIX}{name}:{port}"
            if kind == "static":
                wanted.setdefault(name, set()).add(src)
                continue
            try:
                addrs = self._resolver(name, port)
            except OSError as exc:
                log.warning("verifier name %s:%d does not resolve (%s); keeping its last addresses",
                            name, port, exc)
                failed.add(src)
                continue
            for a in addrs:
                wanted.setdefault(a, set()).add(src)
        self._last_resolve = time.monotonic()
        to_close = []
        with self._lock:
            for addr, e in self._entries.items():
                if e.sources & failed:
                    wanted.setdefault(addr, set()).update(e.sources & failed)
            for addr, srcs in wanted.items():
                e = self._entries.get(addr)
                if e is None:
                    ch = grpc_util.channel(addr, self._max_message_bytes, self._tls,
                                           self._internal_key)
                    # GenerateTokens to a verifier of this process skips the network
                    stub = inproc.LocalVerifierStub(verifier_pb2_grpc.VerifierServiceStub(ch), addr)
                    e = _Entry(Backend(addr, last_error="not polled yet"), ch,
                               stub, health_pb2_grpc.HealthStub(ch),
                               tls_mismatch=grpc_util.TlsMismatch(addr, self._tls))
                    self._entries[addr] = e
                    log.info("verifier %s joined (%s)", addr, ", ".join(sorted(srcs)))
                    self._wake.set()
                elif e.removed:
                    e.removed = False
                    log.info("verifier %s is listed again", addr)
                e.sources = srcs
            for addr, e in list(self._entries.items()):
                if addr not in wanted and not e.removed:
                    e.removed = True
                    _mark_down(e.backend, "no longer listed by its DNS name")
                    self._prefix.forget(addr)
                    log.info("verifier %s left (no longer resolved)", addr)
                if e.removed and e.backend.in_flight == 0:
                    to_close.append(self._entries.pop(addr))
        for e in to_close:
            e.channel.close()
            if self._metrics is not None:
                self._metrics.verifier_forget(e.backend.address)
        self._publish()

    # -- health and load ----------------------------------------------------------------------
    def poll(self) -> None:
        """Poll every verifier once (health Check, then GetConfig) and update its record."""
        with self._lock:
            entries = [e for e in self._entries.values() if not e.removed]
        timeout = max(0.5, min(2.0, 2 * self.poll_s))
        for e in entries:
            b = e.backend
            with self._lock:
                mine = b.in_flight
            try:
                h = e.health.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                   timeout=timeout)
                if h.status != health_pb2.HealthCheckResponse.SERVING:
                    raise _NotServing(health_pb2.HealthCheckResponse.ServingStatus.Name(h.status))
                cfg = e.stub.GetConfig(verifier_pb2.GetConfigRequest(), timeout=timeout)
            except (grpc.RpcError, _NotServing) as exc:
                why = exc.args[0] if isinstance(exc, _NotServing) else \
                    f"{exc.code().name}: {exc.details()}"
                hint = "" if isinstance(exc, _NotServing) else e.tls_mismatch.hint(exc.code())
                if hint:
                    why = f"{hint} ({why})"
                with self._lock:
                    if b.healthy:
                        log.warning("verifier %s is unhealthy (%s)", b.address, why)
                    _mark_down(b, why)
                    self._prefix.forget(b.address)
            else:
                with self._lock:
                    if not b.healthy:
                        log.info("verifier %s is healthy (%d/%d sessions active)", b.address,
                                 cfg.active_sessions, cfg.max_sessions)
                        b.recoveries += 1
                    e.config = cfg
                    b.healthy = True
                    b.last_error = ""
                    b.reported_active = cfg.active_sessions
                    b.max_sessions = cfg.max_sessions
                    b.free_kv_tokens = cfg.free_kv_tokens
                    b.in_flight_at_report = mine
                    attention = (cfg.kv_eviction, cfg.sparse_attention, cfg.kv_type or "f16")
                    if attention_of(b) != attention:
                        b.kv_eviction, b.sparse_attention, b.kv_type = attention
                        self._warn_mixed_attention(b)
            self._export(b)
        self._publish()

    def _warn_mixed_attention(self, b: Backend) -> None:
        """Log when ``b`` attends otherwise than a verifier already reported (KV eviction, sparse
        attention or the KV cache's type; lock held): a generation moved between them continues
        with another attention, so its output is not the one it would have been, and one past
        n_ctx fails on a verifier that keeps every position."""
        mine = attention_of(b)
        for e in self._entries.values():
            o = e.backend
            if o is b or not o.kv_eviction or e.removed or attention_of(o) == mine:
                continue
            log.warning("verifier %s attends with %s, verifier %s with %s: a generation moved "
                        "between them does not continue as it began (give every verifier the "
                        "same --kv-sinks / --kv-window, --sparse-attention and --kv-type)",
                        b.address, describe_attention(mine), o.address,
                        describe_attention(attention_of(o)))
            return

    def report_failure(self, address: str, why: str) -> None:
        """A call could not reach ``address``: out of the candidates until a poll finds it SERVING."""
        with self._lock:
            e = self._entries.get(address)
            if e is None:
                return
            if e.backend.healthy:
                log.warning("verifier %s failed a call (%s); avoided until its health returns",
                            address, why)
            _mark_down(e.backend, why)
            self._prefix.forget(address)
        self._export(e.backend)
        self._publish()
        self._wake.set()

    def serving(self) -> bool:
        """True while at least one listed verifier is healthy."""
        with self._lock:
            return any(e.backend.healthy and not e.removed for e in self._entries.values())

    def watch(self, on_health: Callable[[bool, str], None]) -> None:
        """Call ``on_health(serving, why)`` now with the current state, then on every change:
        serving is False while no verifier is healthy (why: each verifier's last error)."""
        with self._publish_lock:
            self.on_health = on_health
            self._published = None
        self._publish()

    def _publish(self) -> None:
        """Call on_health when serving() changed since the last call (in order: one at a time)."""
        with self._publish_lock:
            now = self.serving()
            if now == self._published:
                return
            self._published = now
            with self._lock:
                why = "; ".join(f"{a}: {e.backend.last_error or 'excluded'}"
                                for a, e in sorted(self._entries.items())) or "none listed"
            if self.on_health is not None:
                self.on_health(now, why)

    def _export(self, b: Backend) -> None:
        if self._metrics is not None:
            self._metrics.verifier_state(b.address, b.healthy, b.reported_active, b.max_sessions,
                                         b.free_kv_tokens, b.in_flight)

    # -- choice -------------------------------------------------------------------------------
    def acquire(self, namespace: str = "", exclude: Iterable[str] = (),
                prompt: Sequence[int] = ()) -> Lease:
        """Lease the verifier balancer.route picks for ``prompt`` (its reason on Lease.route).

        Raises:
            NoVerifier: no healthy verifier outside ``exclude`` (the message says
                what each known verifier's last error was).
        """
        hashes = block_hashes(prompt, self._prefix.block) if self.prefix_slack >= 0 else []
        with self._lock:
            entries = {a: e for a, e in self._entries.items() if not e.removed and e.config is not None}
            # a verifier without a prefix cache (GetConfig.prefix_cache false) keeps nothing
            held = {a: self._prefix.match(a, hashes, len(prompt)) for a, e in entries.items()
                    if hashes and e.config.prefix_cache}
            b, why = route([e.backend for e in entries.values()], held, self.prefix_slack,
                           namespace, exclude)
            if b is None:
                skip = set(exclude)
                known = ", ".join(f"{a} ({_why_not(e, a in skip)})"
                                  for a, e in sorted(self._entries.items())) or "none"
                raise NoVerifier(f"no verifier can take this generation (known: {known})")
            e = entries[b.address]
            b.in_flight += 1
            b.served += 1
        self._export(b)
        return Lease(self, e, why)

    def remember(self, address: str, tokens: Sequence[int]) -> None:
        """A generation on ``address`` ended with ``tokens`` in its KV cache (prompt + output
        except the last token): later prompts sharing their prefix prefer it."""
        if self.prefix_slack < 0:
            return
        with self._lock:
            e = self._entries.get(address)
            if e is not None and e.backend.healthy and not e.removed:
                self._prefix.remember(address, tokens)

    def _release(self, e: _Entry) -> None:
        with self._lock:
            e.backend.in_flight -= 1
            close = e.removed and e.backend.in_flight == 0 and \
                self._entries.get(e.backend.address) is e
            if close:
                del self._entries[e.backend.address]
        self._export(e.backend)
        if close:
            e.channel.close()
            if self._metrics is not None:
                self._metrics.verifier_forget(e.backend.address)

    def recoveries(self, address: str) -> int:
        """How often a poll found ``address`` SERVING after it was down (-1: not listed)."""
        with self._lock:
            e = self._entries.get(address)
            return -1 if e is None else e.backend.recoveries

    def has_other(self, address: str, exclude: Iterable[str] = ()) -> bool:
        """True when a healthy verifier other than ``address`` (and outside ``exclude``) is listed."""
        with self._lock:
            return any(e.backend.healthy and not e.removed and e.config is not None
                       and a != address and a not in exclude for a, e in self._entries.items())

    def others(self, address: str) -> int:
        """The verifier's active sessions besides one generation of ours on it (its last report,
        corrected by this coordinator's generations since; 0 for an unknown address)."""
        with self._lock:
            e = self._entries.get(address)
            return 0 if e is None else max(0, e.backend.estimated_active - 1)

    def any_config(self) -> Any:
        """The GetConfig of a healthy verifier (the first by address), else of any polled one, else None."""
        with self._lock:
            es = sorted(self._entries.values(), key=lambda e: (not e.backend.healthy, e.backend.address))
            for e in es:
                if e.config is not None and not e.removed:
                    return e.config
        return None

    def backends(self) -> list[Backend]:
        """Copies of the current records, by address."""
        with self._lock:
            return [Backend(**vars(e.backend)) for _, e in sorted(self._entries.items())
                    if not e.removed]

    def addresses(self) -> list[str]:
        with self._lock:
            return sorted(a for a, e in self._entries.items() if not e.removed)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Poll once now, then keep polling (and re-resolving) on a daemon thread."""
        self.poll()
        self._thread = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._thread.start()

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until at least one verifier is healthy.

        Raises:
            TimeoutError: none within timeout_s (names each verifier's last error).
        """
        t0 = time.monotonic()
        deadline, said = t0 + timeout_s, t0
        while True:
            with self._lock:
                if any(e.backend.healthy and not e.removed for e in self._entries.values()):
                    return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no verifier SERVING after {timeout_s:.0f} s: {self.state_text()}")
            if now - said >= WAIT_LOG_S:   # a verifier loading a large model takes minutes
                said = now
                log.info("waiting for a verifier to be SERVING (%.0f s of %.0f s): %s", now - t0,
                         timeout_s, self.state_text())
            if self._thread is None:
                self.poll()
            time.sleep(min(0.05, self.poll_s))

    def state_text(self) -> str:
        """Each verifier with its last error: "127.0.0.1:50053 (UNAVAILABLE: ...)"."""
        with self._lock:
            return ", ".join(f"{a} ({e.backend.last_error or 'no answer yet'})"
                             for a, e in sorted(self._entries.items())) or "none resolved"

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._lock:
                    empty = not any(not e.removed for e in self._entries.values())
                # an empty pool (a headless Service with no ready pod yet) re-resolves every poll
                if empty or time.monotonic() - self._last_resolve >= self.resolve_s:
                    self.resolve()
                self.poll()
            except Exception:   # noqa: BLE001 - the monitor must outlive any one bad poll
                log.exception("verifier pool poll failed")

    def close(self) -> None:
        """Stop the monitor and close every channel."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for e in entries:
            e.channel.close()


class _NotServing(Exception):
    pass


def _mark_down(b: Backend, why: str) -> None:
    """Out of the candidates, with its last load report cleared (caller holds the pool lock)."""
    b.healthy = False
    b.last_error = why
    b.reported_active = 0
    b.free_kv_tokens = 0
    b.in_flight_at_report = 0
