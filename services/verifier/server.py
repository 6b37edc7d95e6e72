"""VerifierService server: bind (health NOT_SERVING), load + warm the model, SERVING."""
from __future__ import annotations

import logging

from echospec.v1 import verifier_pb2, verifier_pb2_grpc
from echospec.services.rpc import grpc_util, inproc
from echospec.services.common.config import VerifierConfig
from echospec.services.verifier.servicer import VerifierServicer
from echospec.services.verifier.sessions import VerifierCore

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
log = logging.getLogger("echospec.verifier")


class VerifierServer:
    """A running verifier: server handle, servicer, core."""

    def __init__(self, handle: grpc_util.ServerHandle, servicer: VerifierServicer, core: VerifierCore):
        self.handle = handle
        self.servicer = servicer
        self.core = core
        self.port = handle.port

    def stop(self, grace_s: float | None = None, reason: str = "") -> None:
        """Graceful stop: NOT_SERVING, drain streams (then UNAVAILABLE naming ``reason`` for the
        calls left, grpc_util.ServerHandle.stop), free every session and the model."""
        inproc.unregister(grpc_util.host_port(self.core.config.host, self.port), self.servicer)
        g = self.core.config.grace_s if grace_s is None else grace_s
        self.handle.stop(g, reason).wait()
        self.core.close()


def _draft_opener(config: VerifierConfig):
    """(timeout) -> DraftLink on config.draft_target; None when no draft service is configured."""
    if not config.draft_target:
        return None
    from echospec.v1 import draft_pb2_grpc
    from echospec.services.verifier.draft_link import DraftLink, ReplyTimeout

    tls = grpc_util.Tls.of(config)
    # a draft service of this process is called directly (inproc.py), any other over gRPC
    stub = inproc.LocalDraftStub(draft_pb2_grpc.DraftServiceStub(
        grpc_util.channel(config.draft_target, config.max_message_bytes, tls,
                          config.internal_key)), config.draft_target, config.internal_key)
    mismatch = grpc_util.TlsMismatch(config.draft_target, tls)
    reply = ReplyTimeout()   # shared: a stuck draft service costs each later generation less
    return lambda timeout, **setup: DraftLink(stub, timeout, tls_mismatch=mismatch,
                                              reply_timeout=reply, **setup)


def start(config: VerifierConfig, rpc_metrics=None) -> VerifierServer:
    """Bind, load the GGUF into the engine, warm up (measures T), then SERVING.

    Args:
        config: the settings; ``metrics_port >= 0`` also serves /metrics there.
        rpc_metrics: a metrics.RpcMetrics shared with other servers of this process, or None.
    Raises:
        PortInUseError: host:port (or the metrics port) cannot be bound.
        EngineError: the model cannot be loaded (the server is stopped first).
    """
    handle = grpc_util.build_server(config.host, config.port, config.max_workers,
                                    config.max_message_bytes, [SERVICE_NAME],
                                    config.max_concurrent_rpcs, rpc_metrics,
                                    tls=grpc_util.Tls.of(config),
                                    internal_key=config.internal_key)
    servicer = VerifierServicer(None, _draft_opener(config))
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, handle.server)
    if config.metrics_port >= 0:   # before the model loads: a busy port is found at once
        try:
            handle.serve_metrics(config.metrics_host, config.metrics_port)
        except BaseException:
            handle.server.stop(0)
            raise
        log.info("verifier metrics on http://%s/metrics",
                 grpc_util.host_port(config.metrics_host, handle.metrics_port))
    handle.server.start()
    try:
        core = VerifierCore(config)
        core.warm_up()
        if config.grammar_warm_up:
            core.warm_up_grammar()
    except BaseException:
        handle.stop(0)
        raise
    servicer.core = core
    handle.set_serving()
    # a coordinator of this process calls GenerateTokens directly (inproc.py)
    inproc.register(grpc_util.host_port(config.host, handle.port), servicer, handle)
    log.info("verifier listening on %s (model %s, n_ctx %d, T %.2f ms)",
             grpc_util.host_port(config.host, handle.port), config.model, config.n_ctx, core.t_ms)
    n_train = core.model.info.n_ctx_train
    if 0 < n_train < config.n_ctx:
        log.warning("n_ctx %d is more than the %d tokens the model was trained for: positions past "
                    "%d are extrapolated and the output there is likely poor", config.n_ctx,
                    n_train, n_train)
    return VerifierServer(handle, servicer, core)


def serve(config: VerifierConfig) -> None:
    """Start and block until SIGINT/SIGTERM, then stop gracefully."""
    srv = start(config)
    try:
        grpc_util.wait_for_termination(srv.handle, config.grace_s)
    finally:
        srv.core.close()
