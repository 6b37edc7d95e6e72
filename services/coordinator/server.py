"""CoordinatorService server: bind (NOT_SERVING), load the tokenizer and chat
template, start the verifier pool and wait for one healthy verifier, then SERVING.
From then on health follows the verifiers: NOT_SERVING while none is healthy, SERVING
again when one is."""
from __future__ import annotations

import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc
from echospec.services.rpc import grpc_util
from echospec.services.text.chat_template import ChatTemplate, ChatTemplateError
from echospec.services.common.config import CoordinatorConfig
from echospec.services.common.tenants import Tenants
from echospec.services.common.metrics import PromMetrics
from echospec.services.text.tokenizer import Tokenizer, read_tokenizer_metadata
from echospec.services.coordinator.pool import Resolver, VerifierPool
from echospec.services.coordinator.servicer import CoordinatorServicer, RequestError

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
log = logging.getLogger("echospec.coordinator")


class CoordinatorServer:
    """A running coordinator: server handle, servicer and its channels."""

    def __init__(self, handle: grpc_util.ServerHandle, servicer: CoordinatorServicer,
                 pool: VerifierPool):
        self.handle = handle
        self.servicer = servicer
        self.port = handle.port
        self.pool = pool

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port (0: metrics off)."""
        return self.handle.metrics_port

    def stop(self, grace_s: float | None = None, reason: str = "") -> None:
        """NOT_SERVING, drain for grace_s (then UNAVAILABLE naming ``reason`` for the calls
        left, grpc_util.ServerHandle.stop), stop /metrics, close the verifier pool."""
        g = self.servicer.config.grace_s if grace_s is None else grace_s
        self.handle.stop(g, reason).wait()
        self.pool.close()
        self.servicer.watch.close()


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


def verifier_targets(config: CoordinatorConfig) -> list[str]:
    """config.verifier (host:port or dns:///name:port each), else [config.verifier_target]."""
    return list(config.verifier) or [config.verifier_target]


def verifiers_text(targets: list[str], addresses: list[str]) -> str:
    """"verifiers A B" for the startup line; the addresses the targets resolved to follow in
    parentheses only when they differ from the targets (a dns:/// name)."""
    text = "verifier" + ("s " if len(targets) > 1 else " ") + " ".join(targets)
    if sorted(targets) != sorted(addresses):
        text += f" (resolved to {' '.join(addresses) or 'no address yet'})"
    return text


def start(config: CoordinatorConfig, verifier_wait_s: float = 120.0, rpc_metrics=None,
          extra_registries=(), resolver: Resolver | None = None) -> CoordinatorServer:
    """Bind, load tokenizer + chat template from config.model, start the verifier pool, wait
    for one healthy verifier, SERVING.

    The draft service is not waited for: without it generations decode plainly.

    Args:
        config: the settings; ``metrics_port >= 0`` serves /metrics there (bound first, so a
            busy port is found before anything loads).
        verifier_wait_s: how long to wait for the verifier's SERVING.
        rpc_metrics: a metrics.RpcMetrics shared with other servers of this process, or None.
        extra_registries: more Prometheus registries for this /metrics (none so far).
        resolver: (host, port) -> ["ip:port", ...] for dns:/// verifier targets (default:
            getaddrinfo; tests pass a stand-in).
    Raises:
        PortInUseError: host:port (or the metrics port) cannot be bound.
        ValueError / FileNotFoundError: the GGUF's tokenizer cannot be read.
        TimeoutError: no verifier became SERVING in verifier_wait_s.
    """
    if not 1 <= config.k <= config.k_max:
        raise ValueError(f"k = {config.k}: drafts per round must be in [1, k_max = {config.k_max}]")
    if not 1 <= config.max_tokens <= config.max_tokens_limit:
        raise ValueError(f"max_tokens = {config.max_tokens}: must be in [1, {config.max_tokens_limit}]")
    tenants = Tenants.load(config.api_keys_file) if config.api_keys_file else None
    handle = grpc_util.build_server(config.host, config.port, config.max_workers,
                                    config.max_message_bytes, [SERVICE_NAME],
                                    config.max_concurrent_rpcs, rpc_metrics,
                                    tls=grpc_util.Tls.of(config), api_key=config.api_key,
                                    tenants=tenants)
    pool = None
    try:
        metrics = PromMetrics()
        pool = VerifierPool(verifier_targets(config), config.max_message_bytes,
                            config.verifier_poll_s, config.verifier_resolve_s, resolver, metrics,
                            tls=grpc_util.Tls.of(config), internal_key=config.internal_key,
                            prefix_slack=config.prefix_route_slack)
        if config.metrics_port >= 0:
            handle.serve_metrics(config.metrics_host, config.metrics_port,
                                 [metrics.registry, *extra_registries])
            log.info("coordinator metrics on http://%s/metrics",
                     grpc_util.host_port(config.metrics_host, handle.metrics_port))
        source = read_chat_template(config.chat_template) if config.chat_template else None
        try:
            meta = read_tokenizer_metadata(config.model)   # one pass over the GGUF's metadata
            tokenizer = Tokenizer(meta)
            template = ChatTemplate.from_metadata(meta, source)
        except ValueError as exc:   # ChatTemplateError too; the engine may load what this refuses
            if source is not None and isinstance(exc, ChatTemplateError):
                raise ValueError(f"--chat-template {config.chat_template}: {exc}") from exc
            raise ValueError(f"model {config.model} is unusable: its tokenizer or chat template: "
                             f"{exc}") from exc
        if template.missing is not None:
            log.warning("model %s has no chat template: requests with chat messages are refused "
                        "(give one with --chat-template FILE)", config.model)
        servicer = CoordinatorServicer(config, tokenizer, template, pool, metrics, tenants)
        servicer.shutdown = handle.limit.shutdown
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, handle.server)
        handle.server.start()
        pool.start()
        pool.wait_healthy(verifier_wait_s)
    except BaseException:
        handle.stop(0)
        if pool is not None:
            pool.close()
        raise
    handle.set_serving()
    pool.watch(_follow_verifiers(handle))
    log.info("coordinator listening on %s (model %s, %s, spec default %s, %s, "
             "%s)", grpc_util.host_port(config.host, handle.port), config.model,
             verifiers_text(verifier_targets(config), pool.addresses()), "on" if config.spec else "off",
             "TLS" if config.tls_cert else "plain text",
             "API key required" if config.api_key else "no API key")
    return CoordinatorServer(handle, servicer, pool)


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file.

    Raises:
        ValueError: the file cannot be read, is not UTF-8 or is empty (naming the option and path).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--chat-template {path}: cannot read the file: {why}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text


def _follow_verifiers(handle: grpc_util.ServerHandle):
    """The pool's on_health: the coordinator's health is NOT_SERVING while no verifier is
    healthy (readiness probes and the gateway's /health see it) and SERVING again once one is."""
    state = {"serving": True}

    def on_health(serving: bool, why: str) -> None:
        if serving == state["serving"]:
            return
        if serving:
            if handle.set_serving():
                state["serving"] = True
                log.info("coordinator SERVING again: a verifier is healthy")
        else:
            state["serving"] = False
            handle.set_not_serving()
            log.warning("coordinator NOT_SERVING: no verifier is healthy (%s)", why)
    return on_health


def serve(config: CoordinatorConfig) -> None:
    """Start and block until SIGINT/SIGTERM, then stop gracefully."""
    srv = start(config)
    grpc_util.wait_for_termination(srv.handle, config.grace_s)
    srv.pool.close()
    srv.servicer.watch.close()
