"""The gateway's HTTP server (uvicorn): ``start`` runs it on a thread of this process (the stack's
threads mode and the tests), ``serve`` in the main thread until SIGINT/SIGTERM (its own process).

The listening socket is bound before uvicorn starts, so a busy port is reported at once and port 0
picks a free one (``GatewayServer.port``). HTTPS when config.tls_cert is set, demanding client
certificates when config.tls_client_ca is. Read deadlines and the connection cap: conn.py. With
config.metrics_port >= 0 the gateway's own Prometheus /metrics (http_metrics.py) is served there,
on config.metrics_host.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
import threading
import time

import uvicorn

from echospec.services.rpc import grpc_util
from echospec.services.common.config import GatewayConfig
from echospec.services.rpc.grpc_util import PortInUseError
from echospec.services.gateway.app import create_app
from echospec.services.gateway.conn import ConnectionLimits, protocol_class
from echospec.services.gateway.http_metrics import HttpMetrics
from echospec.services.common.metrics import serve_metrics

log = logging.getLogger("echospec.gateway")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"gateway cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class _Metrics:
    """The gateway's /metrics (http_metrics.py) on config.metrics_port, when it is >= 0."""

    def __init__(self, config: GatewayConfig):
        self.metrics = HttpMetrics()
        self.http = None
        self.port = -1
        if config.metrics_port >= 0:
            try:
                self.http, self.port = serve_metrics(config.metrics_host, config.metrics_port,
                                                     [self.metrics.registry])
            except OSError as exc:
                raise PortInUseError(f"gateway metrics cannot bind "
                                     f"{grpc_util.host_port(config.metrics_host, config.metrics_port)}"
                                     f": {exc.strerror}") from None
            log.info("gateway metrics on http://%s/metrics",
                     grpc_util.host_port(config.metrics_host, self.port))

    def stop(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None


def _uvicorn_config(config: GatewayConfig, metrics: HttpMetrics | None = None) -> uvicorn.Config:
    tls = grpc_util.Tls(config.tls_cert, config.tls_key, config.tls_client_ca, config.tls_ca)
    tls.validate()   # ValueError naming the setting
    kw = {}
    if config.tls_cert:
        kw = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
        if config.tls_client_ca:
            kw.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    # uvicorn cancels what still runs timeout_graceful_shutdown after a stop begins (a truncated
    # response and a traceback): the app ends its own requests at config.grace_s, so give it more
    # h11 with read deadlines and a connection cap (conn.py); uvicorn's own limit_concurrency
    # would still accept every connection and answer only the requests that complete
    http = protocol_class(ConnectionLimits(config.header_timeout_s, config.body_timeout_s,
                                           config.max_connections))
    return uvicorn.Config(create_app(config, metrics), log_config=None, access_log=False, http=http,
                          log_level=config.log_level.lower(),
                          timeout_graceful_shutdown=config.grace_s + 1, lifespan="on", **kw)


class _Server(uvicorn.Server):
    """uvicorn's server that also starts the app's shutdown grace period (app.Shutdown) when it
    is asked to exit, by a signal or by ``stop``."""

    def begin_shutdown(self, reason: str) -> None:
        shutdown = getattr(self.config.app.state, "shutdown", None)
        if shutdown is not None:   # None before the lifespan has started
            shutdown.begin(reason)
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        shutdown = getattr(self.config.app.state, "shutdown", None)
        if shutdown is not None:
            shutdown.begin(signal.Signals(sig).name)


class GatewayServer:
    """A gateway running on its own thread and event loop."""

    def __init__(self, config: GatewayConfig, ready_timeout_s: float = 30.0):
        self._metrics = _Metrics(config)
        try:
            ucfg = _uvicorn_config(config, self._metrics.metrics)
            self._sock = _bind(config.host, config.port)
        except BaseException:
            self._metrics.stop()
            raise
        self.metrics_port = self._metrics.port   # -1: no /metrics
        self.config = config
        self.port = self._sock.getsockname()[1]
        self._server = _Server(ucfg)
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway did not start on {grpc_util.host_port(config.host, self.port)}")
            time.sleep(0.01)
        scheme = "https" if config.tls_cert else "http"
        log.info("gateway listening on %s://%s (coordinator %s, %s)", scheme,
                 grpc_util.host_port(config.host, self.port), config.coordinator_target,
                 "API key required" if config.api_key else "no API key")

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def stop(self, grace_s: float = 2.0, reason: str = "") -> None:
        """Stop accepting, let requests in progress end for up to grace_s, then end the rest with
        an error naming ``reason`` (e.g. "SIGTERM"; "" says "stopped"); close the socket."""
        self._server.config.timeout_graceful_shutdown = grace_s + 1
        shutdown = getattr(self._server.config.app.state, "shutdown", None)
        if shutdown is not None:
            shutdown.grace_s = grace_s
        self._server.begin_shutdown(reason)
        self._thread.join(grace_s + 5)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5)
        self._sock.close()
        self._metrics.stop()


def start(config: GatewayConfig) -> GatewayServer:
    """Start the gateway on a thread. Raises PortInUseError, ValueError (a TLS file missing)."""
    return GatewayServer(config)


def serve(config: GatewayConfig) -> None:
    """Run in the main thread until SIGINT/SIGTERM (uvicorn's handlers), then stop gracefully."""
    metrics = _Metrics(config)
    try:
        ucfg = _uvicorn_config(config, metrics.metrics)
        sock = _bind(config.host, config.port)
    except BaseException:
        metrics.stop()
        raise
    log.info("gateway listening on %s://%s (coordinator %s, %s)",
             "https" if config.tls_cert else "http", grpc_util.host_port(config.host, sock.getsockname()[1]),
             config.coordinator_target, "API key required" if config.api_key else "no API key")
    try:
        _Server(ucfg).run(sockets=[sock])
    finally:
        sock.close()
        metrics.stop()
