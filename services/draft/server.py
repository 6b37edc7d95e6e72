"""DraftService server: build, register health + reflection, start, serve, stop."""
from __future__ import annotations

import logging

from echospec.v1 import draft_pb2, draft_pb2_grpc
from echospec.services.rpc import grpc_util, inproc
from echospec.services.common.config import DraftConfig
from echospec.services.draft.proposer import check_min_n
from echospec.services.draft.servicer import DraftServicer

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
log = logging.getLogger("echospec.draft")


def start(config: DraftConfig, rpc_metrics=None) -> tuple[grpc_util.ServerHandle, DraftServicer]:
    """Start the draft server (health SERVING once started: it needs no warm-up).

    Args:
        config: the settings; ``metrics_port >= 0`` also serves /metrics there.
        rpc_metrics: a metrics.RpcMetrics shared with other servers of this process, or None.
    Returns:
        (handle, servicer); ``handle.port`` is the bound port.
    Raises:
        PortInUseError: host:port (or the metrics port) cannot be bound.
        ProposerError: min_n outside [1, 64]. ValueError: shared memory bounds below 1.
    """
    check_min_n(config.min_n)  # ProposerError names the bad value
    if config.shared_max_tokens < 1 or config.shared_max_namespaces < 1:
        raise ValueError(f"shared memory bounds must be >= 1, got shared_max_tokens="
                         f"{config.shared_max_tokens} shared_max_namespaces={config.shared_max_namespaces}")
    handle = grpc_util.build_server(config.host, config.port, config.max_workers,
                                    config.max_message_bytes, [SERVICE_NAME],
                                    config.max_concurrent_rpcs, rpc_metrics,
                                    tls=grpc_util.Tls.of(config),
                                    internal_key=config.internal_key)
    servicer = DraftServicer(config)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, handle.server)
    if config.metrics_port >= 0:
        try:
            handle.serve_metrics(config.metrics_host, config.metrics_port)
        except BaseException:
            handle.server.stop(0)
            raise
        log.info("draft metrics on http://%s/metrics",
                 grpc_util.host_port(config.metrics_host, handle.metrics_port))
    handle.server.start()
    handle.set_serving()
    # a verifier of this process runs its draft streams here directly (inproc.py); a stopped
    # server is passed over (its handle says so) and a new one on the address replaces it
    inproc.register(grpc_util.host_port(config.host, handle.port), servicer, handle)
    log.info("draft service listening on %s (suffix index, shortest match %d; shared memory "
             "%d tokens x %d namespaces)", grpc_util.host_port(config.host, handle.port), config.min_n,
             config.shared_max_tokens, config.shared_max_namespaces)
    return handle, servicer


def serve(config: DraftConfig) -> None:
    """Start and block until SIGINT/SIGTERM, then stop with config.grace_s."""
    handle, _ = start(config)
    grpc_util.wait_for_termination(handle, config.grace_s)
