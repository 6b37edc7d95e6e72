"""The gateway's calls to the coordinator over gRPC (grpc.aio): the one module of the gateway that
imports grpc. Every failure comes out as UpstreamError with the gRPC status name.

Create an Upstream inside the event loop that uses it (grpc.aio binds a channel to its loop).
"""
from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc
from echospec.services.common import auth
from echospec.services.rpc import grpc_util
from echospec.services.common.config import GatewayConfig

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name


class UpstreamError(Exception):
    """A coordinator call failed; ``code`` is the grpc.StatusCode name ("INVALID_ARGUMENT", ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.prompt_index: int | None = None   # set by choices.py: the call's entry of a prompt list


_NO_CONNECTION = ("failed to connect", "Connection refused", "DNS resolution failed")


def _error(exc: grpc.aio.AioRpcError, target: str, timeout_s: float | None = None) -> UpstreamError:
    """The UpstreamError of a failed call to the coordinator at ``target``; ``timeout_s``: the
    gateway's deadline of a generation, named when it ran out."""
    code = exc.code()
    details = exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _NO_CONNECTION):
        # gRPC's own text lists addresses and socket errors; say first what it means
        details = f"the gateway cannot reach the coordinator at {target} ({details})"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
        details = (f"the generation did not finish within the gateway's request timeout of "
                   f"{timeout_s:g} s (--request-timeout-s, ECHOSPEC_REQUEST_TIMEOUT_S) ({details})")
    return UpstreamError(code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN", details)


class GenerationStream:
    """One Generate call: iterate for GenerateResponse messages; ``cancel()`` ends the call on the
    coordinator (which cancels the verifier's generation and frees its session)."""

    def __init__(self, call, target: str, timeout_s: float):
        self._call = call
        self._target = target
        self._timeout_s = timeout_s
        self._it = call.__aiter__()

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> coordinator_pb2.GenerateResponse:
        try:
            return await self._it.__anext__()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self._target, self._timeout_s) from None

    def cancel(self) -> None:
        self._call.cancel()


class Upstream:
    """Channel and stubs to the coordinator at ``config.coordinator_target``.

    TLS when ``config.tls_ca`` is set; ``config.api_key`` is sent as ``authorization: Bearer``
    metadata on every service call (health checks go without it).
    """

    def __init__(self, config: GatewayConfig):
        self.config = config
        tls = grpc_util.Tls(ca=config.tls_ca)
        creds = tls.channel_credentials()
        opts = grpc_util.channel_options(config.max_body_bytes + (1 << 20))
        if creds is not None:
            self.channel = grpc.aio.secure_channel(config.coordinator_target, creds, options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(config.coordinator_target, options=opts)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._info: coordinator_pb2.GetInfoResponse | None = None

    def _metadata(self, request_id: str, authorization: str | None = None
                  ) -> tuple[tuple[str, str], ...]:
        """x-request-id, and ``authorization`` (the client's own, given with tenants, for the
        coordinator to scope its namespace) or else config.api_key's."""
        md = (("x-request-id", request_id),)
        if authorization:
            md += (("authorization", authorization),)
        elif self.config.api_key:
            md += (("authorization", auth.bearer(self.config.api_key)),)
        return md

    async def close(self) -> None:
        await self.channel.close()

    async def complete(self, req: coordinator_pb2.CompleteRequest, request_id: str,
                       authorization: str | None = None) -> coordinator_pb2.GenerationResult:
        """One Complete call within config.request_timeout_s (``authorization``: the client's,
        sent on instead of config.api_key). Raises UpstreamError."""
        try:
            resp = await self.stub.Complete(req, timeout=self.config.request_timeout_s,
                                            metadata=self._metadata(request_id, authorization))
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.config.coordinator_target, self.config.request_timeout_s) from None
        return resp.result

    def generate(self, req: coordinator_pb2.GenerateRequest, request_id: str,
                 authorization: str | None = None) -> GenerationStream:
        """Start a Generate call (deadline config.request_timeout_s; ``authorization`` as in
        ``complete``); iterate the result."""
        return GenerationStream(self.stub.Generate(req, timeout=self.config.request_timeout_s,
                                                   metadata=self._metadata(request_id,
                                                                           authorization)),
                                self.config.coordinator_target, self.config.request_timeout_s)

    async def model_id(self, authorization: str | None = None) -> str:
        """config.model_name, else the stem of the coordinator's GGUF file name (GetInfo, once;
        the stem of a path too, from a coordinator that reported one; ``authorization`` as in
        ``complete``). Raises UpstreamError."""
        if self.config.model_name:
            return self.config.model_name
        if self._info is None:
            try:
                self._info = await self.stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10,
                                                     metadata=self._metadata("models",
                                                                             authorization))
            except grpc.aio.AioRpcError as exc:
                raise _error(exc, self.config.coordinator_target) from None
        return Path(self._info.model).stem or "echospec"

    async def max_tokens_limit(self, authorization: str | None = None) -> int | None:
        """The coordinator's max_tokens_limit (GetInfo, asked each time: a coordinator restarted
        with another limit is seen), None when it cannot be asked."""
        try:
            info = await self.stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=5,
                                           metadata=self._metadata("max_tokens_limit",
                                                                   authorization))
        except grpc.aio.AioRpcError:
            return None
        return info.max_tokens_limit or None

    async def health(self) -> str:
        """The coordinator's grpc.health.v1 status name ("SERVING", "NOT_SERVING", ...), or the
        gRPC status name of a failed check ("UNAVAILABLE", ...)."""
        try:
            r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                             timeout=5)
        except grpc.aio.AioRpcError as exc:
            return _error(exc, self.config.coordinator_target).code
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
