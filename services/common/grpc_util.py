"""gRPC helpers shared by the three services: server construction with health
and reflection, channel options, graceful stop, and status helpers.

Every server: grpc.health.v1 says NOT_SERVING until ``set_serving`` (the model
is loaded and warm), reflection lists its services (grpcurl list/describe),
messages above ``max_message_bytes`` are refused by gRPC with
RESOURCE_EXHAUSTED ("Received message larger than max ..."), and ``stop``
flips health to NOT_SERVING before draining with a grace period.
"""
from __future__ import annotations

import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


class PortInUseError(RuntimeError):
    """The server could not bind host:port (taken or not permitted)."""


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options capping message sizes (bytes) both ways."""
    return [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
    ]


def channel(target: str, max_message_bytes: int) -> grpc.Channel:
    """An insecure channel to ``target`` ("host:port") with message caps and keepalive."""
    opts = message_options(max_message_bytes) + [
        ("grpc.keepalive_time_ms", 30000),
        ("grpc.enable_retries", 0),
        # loopback: reconnect quickly after a restart of the peer
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    return grpc.insecure_channel(target, options=opts)


@dataclass
class ServerHandle:
    """A started (or startable) server with its health servicer and bound port."""

    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]

    def set_serving(self) -> None:
        """Health: SERVING for "" and every service name."""
        for name in ("",) + self.service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        """Health: NOT_SERVING for "" and every service name."""
        for name in ("",) + self.service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace_s: float) -> threading.Event:
        """NOT_SERVING, then stop accepting RPCs and drain for grace_s seconds.

        Returns the event set when the server has fully stopped.
        """
        self.set_not_serving()
        return self.server.stop(grace_s)


def build_server(host: str, port: int, max_workers: int, max_message_bytes: int,
                 service_names: Iterable[str]) -> ServerHandle:
    """Create a server bound to host:port with health (NOT_SERVING) and reflection.

    Register the service's servicers on ``handle.server`` before ``start()``.

    Args:
        host: bind address ("127.0.0.1" by default in every config).
        port: TCP port; 0 picks a free one (see ``handle.port``).
        max_workers: thread pool size (each open stream holds one thread).
        max_message_bytes: cap on received and sent message size.
        service_names: fully qualified names ("echospec.v1.DraftService").
    Raises:
        PortInUseError: the address could not be bound.
    """
    names = tuple(service_names)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=message_options(max_message_bytes)
                         + [("grpc.so_reuseport", 0)],
                         maximum_concurrent_rpcs=None)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(addr)
    except RuntimeError as exc:
        raise PortInUseError(f"cannot bind {addr}: {exc}") from None
    if bound == 0:
        raise PortInUseError(f"cannot bind {addr} (port taken or not permitted)")
    handle = ServerHandle(server=server, health=hs, port=bound, service_names=names)
    handle.set_not_serving()
    return handle


def wait_for_termination(handle: ServerHandle, grace_s: float) -> None:
    """Block until SIGINT/SIGTERM, then stop gracefully (main thread only)."""
    done = threading.Event()

    def _on_signal(signum, frame):  # noqa: ARG001
        done.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        handle.stop(grace_s).wait()


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str):
    """Abort the RPC with ``code`` and ``message`` (raises; never returns)."""
    context.abort(code, message)


def is_unavailable(exc: BaseException) -> bool:
    """True for an RpcError meaning the peer is gone or unreachable."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)
