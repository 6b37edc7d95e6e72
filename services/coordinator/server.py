"""CoordinatorService server: bind (NOT_SERVING), load the tokenizer and chat
template, wait for the verifier, then SERVING."""
from __future__ import annotations

import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common import grpc_util
from services.common.chat_template import ChatTemplate
from services.common.config import CoordinatorConfig
from services.common.tokenizer import Tokenizer, read_tokenizer_metadata
from services.coordinator.servicer import CoordinatorServicer, RequestError

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
log = logging.getLogger("echospec.coordinator")


class CoordinatorServer:
    """A running coordinator: server handle, servicer and its channels."""

    def __init__(self, handle: grpc_util.ServerHandle, servicer: CoordinatorServicer,
                 channels: list[grpc.Channel]):
        self.handle = handle
        self.servicer = servicer
        self.port = handle.port
        self._channels = channels
        self.metrics_http = None       # prometheus-client's HTTP server, when metrics are on
        self.metrics_port = 0

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, drain for grace_s, close the downstream channels."""
        g = self.servicer.config.grace_s if grace_s is None else grace_s
        self.handle.stop(g).wait()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
            self.metrics_http = None
        for ch in self._channels:
            ch.close()


def wait_serving(channel: grpc.Channel, service: str, timeout_s: float) -> None:
    """Poll grpc.health.v1 on ``channel`` until ``service`` is SERVING.

    Raises:
        TimeoutError: not SERVING within timeout_s seconds (names the service).
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        time.sleep(0.05)
    raise TimeoutError(f"{service or 'server'} not SERVING after {timeout_s:.0f} s ({last})")


def start(config: CoordinatorConfig, verifier_wait_s: float = 120.0) -> CoordinatorServer:
    """Bind, load tokenizer + chat template from config.model, wait for the verifier, SERVING.

    The draft service is not waited for: without it generations decode plainly.

    Raises:
        PortInUseError: host:port cannot be bound.
        ValueError / FileNotFoundError: the GGUF's tokenizer cannot be read.
        TimeoutError: the verifier did not become SERVING in verifier_wait_s.
    """
    if not 1 <= config.k <= config.k_max:
        raise ValueError(f"k = {config.k}: drafts per round must be in [1, k_max = {config.k_max}]")
    if not 1 <= config.max_tokens <= config.max_tokens_limit:
        raise ValueError(f"max_tokens = {config.max_tokens}: must be in [1, {config.max_tokens_limit}]")
    handle = grpc_util.build_server(config.host, config.port, config.max_workers,
                                    config.max_message_bytes, [SERVICE_NAME],
                                    config.max_concurrent_rpcs)
    vch = grpc_util.channel(config.verifier_target, config.max_message_bytes)
    dch = grpc_util.channel(config.draft_target, config.max_message_bytes)
    try:
        meta = read_tokenizer_metadata(config.model)   # one pass over the GGUF's metadata
        tokenizer = Tokenizer(meta)
        template = ChatTemplate.from_metadata(meta)
        servicer = CoordinatorServicer(config, tokenizer, template, vch, dch)
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, handle.server)
        handle.server.start()
        wait_serving(vch, "echospec.v1.VerifierService", verifier_wait_s)
        servicer.verifier_config(refresh=True)
    except BaseException:
        handle.server.stop(0)
        vch.close()
        dch.close()
        raise
    metrics_http, mport = None, 0
    if servicer.metrics is not None:
        try:
            metrics_http, mport = servicer.metrics.serve(config.host, config.metrics_port)
        except OSError as exc:
            handle.server.stop(0)
            vch.close()
            dch.close()
            raise grpc_util.PortInUseError(
                f"metrics port {config.host}:{config.metrics_port}: {exc.strerror}") from None
        log.info("coordinator metrics on http://%s:%d/metrics", config.host, mport)
    handle.set_serving()
    log.info("coordinator listening on %s:%d (verifier %s, draft %s, spec default %s)",
             config.host, handle.port, config.verifier_target, config.draft_target,
             "on" if config.spec else "off")
    srv = CoordinatorServer(handle, servicer, [vch, dch])
    srv.metrics_http, srv.metrics_port = metrics_http, mport
    return srv


def serve(config: CoordinatorConfig) -> None:
    """Start and block until SIGINT/SIGTERM, then stop gracefully."""
    srv = start(config)
    grpc_util.wait_for_termination(srv.handle, config.grace_s)
    for ch in srv._channels:
        ch.close()
