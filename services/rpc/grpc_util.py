"""gRPC helpers shared by the three services: server construction with health
and reflection, channel options, graceful stop, and status helpers.

Every server: grpc.health.v1 says NOT_SERVING until ``set_serving`` (the model
is loaded and warm), reflection serves every symbol of its services (grpcurl
list/describe), messages above ``max_message_bytes`` are refused by gRPC with
RESOURCE_EXHAUSTED ("Received message larger than max ..."), at most
``max_concurrent_rpcs`` service RPCs run at once (more get RESOURCE_EXHAUSTED
at once; the other ``max_workers - max_concurrent_rpcs`` threads keep health
and reflection answering under a full load of open streams), and ``stop``
flips health to NOT_SERVING before draining with a grace period.

Security (both optional, see ``Tls`` and ``ApiKeyAuth``): a server with a certificate listens with
TLS only (and with a client CA demands client certificates: mTLS, for the internal ports); a server
with an API key refuses service RPCs without ``authorization: Bearer <key>`` with UNAUTHENTICATED,
while health and reflection stay open for probes.

A request whose bytes do not parse (a string field that is not UTF-8, from a raw client) gets
INVALID_ARGUMENT naming the field (``DecodeErrors``), not grpcio's INTERNAL.
"""
from __future__ import annotations

import collections
import logging
import math
import signal
import threading
import time
import weakref
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from echospec.services.common.config import setting_name


# Symbols whose file reflection must find (grpcurl describe): a method, a field and a nested enum
# value, of a proto always loaded here (grpc_health).
_MEMBER_PROBES = ("grpc.health.v1.Health.Check", "grpc.health.v1.HealthCheckRequest.service",
                  "grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING")


def pool_finds_members(pool: Any = None) -> bool:
    """True when ``pool`` (the default descriptor pool: None) finds the file of a method, a field
    and an enum value by name. protobuf's upb backend finds none but the field (grpc/grpc#34743),
    so grpc_reflection's servicer answers NOT_FOUND for them; while that holds,
    ``reflection_servicer`` adds the lookup."""
    pool = descriptor_pool.Default() if pool is None else pool
    try:
        for name in _MEMBER_PROBES:
            pool.FindFileContainingSymbol(name)
    except KeyError:
        return False
    return True


class _MemberReflectionServicer(reflection.ReflectionServicer):
    """grpc_reflection's servicer, asked for the parent (service, message or enum) of a member
    symbol the pool does not find by name, so ``grpcurl describe
    echospec.v1.CoordinatorService.Generate`` works. Public API only: the request is rewritten
    before the base servicer sees it and the response carries the client's request back."""

    def __init__(self, service_names: Iterable[str], pool: Any = None):
        super().__init__(service_names, pool)
        self._symbols = descriptor_pool.Default() if pool is None else pool

    def ServerReflectionInfo(self, request_iterator, context):
        asked: list = []

        def requests():
            for request in request_iterator:
                asked.append(request)
                parent = (self._parent_of(request.file_containing_symbol)
                          if request.HasField("file_containing_symbol") else None)
                if parent is None:
                    yield request
                else:
                    yield reflection_pb2.ServerReflectionRequest(host=request.host,
                                                                 file_containing_symbol=parent)
        for response in super().ServerReflectionInfo(requests(), context):   # one per request
            response.original_request.CopyFrom(asked.pop(0))
            yield response

    def _parent_of(self, name: str) -> str | None:
        """The full name of the service, message or enum ``name`` is a member of (a method, a
        field, a oneof, a nested type or enum, an enum value), when the pool does not find
        ``name`` itself; else None."""
        try:
            self._symbols.FindFileContainingSymbol(name)
            return None
        except KeyError:
            pass
        parent, _, member = name.rpartition(".")
        if not parent:
            return None
        lookups = (
            (self._symbols.FindServiceByName, lambda d: (d.methods_by_name,)),
            (self._symbols.FindMessageTypeByName,
             lambda d: (d.fields_by_name, d.nested_types_by_name, d.enum_types_by_name,
                        d.oneofs_by_name)),
            (self._symbols.FindEnumTypeByName, lambda d: (d.values_by_name,)),
        )
        for find, members in lookups:
            try:
                d = find(parent)
            except KeyError:
                continue
            if any(member in m for m in members(d)):
                return d.full_name
        return None


def reflection_servicer(service_names: Iterable[str]) -> reflection.ReflectionServicer:
    """grpc_reflection's servicer for ``service_names``, with the member lookup while the default
    descriptor pool needs it (``pool_finds_members``)."""
    names = tuple(service_names)
    if pool_finds_members():
        return reflection.ReflectionServicer(names)
    return _MemberReflectionServicer(names)


def _kind(handler: grpc.RpcMethodHandler) -> str:
    """The handler's RPC kind: "unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    return ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
            else "stream_unary" if handler.stream_unary else "stream_stream")


def _with_behavior(handler: grpc.RpcMethodHandler, kind: str, behavior,
                   request_deserializer=None) -> grpc.RpcMethodHandler:
    """A new handler of ``kind`` running ``behavior``, with ``handler``'s serializers (its request
    deserializer unless one is given), built by grpc's public ``grpc.<kind>_rpc_method_handler``."""
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(behavior, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _refusing(handler, code: grpc.StatusCode, message: str):
    """``handler`` with its behaviour replaced by an abort with ``code`` and ``message``."""
    kind = _kind(handler)
    if kind.endswith("_stream"):
        def stream(request, context):
            context.abort(code, message)
            yield  # pragma: no cover - abort raises
        return _with_behavior(handler, kind, stream)

    def unary(request, context):
        context.abort(code, message)
    return _with_behavior(handler, kind, unary)


class ApiKeyAuth(grpc.ServerInterceptor):
    """Refuse every RPC but health and reflection with UNAUTHENTICATED unless its metadata holds
    ``authorization: Bearer <api_key>`` (services/common/auth.py).

    It sits inside the concurrency limit (after it in the server's interceptor list): the limit
    counts every call it admits and releases the slot when the handler ends, so the refusal,
    which ends at once, gives its slot back and is recorded under UNAUTHENTICATED. (Outside the
    limit, a refusal would drop the limit's counted handler and leak its slot.)"""

    def __init__(self, api_key: str, tenants: Any = None):
        from echospec.services.common import auth
        self._auth = auth
        self.api_key = api_key
        self.tenants = tenants   # a tenants.Tenants: its keys are taken too (None: api_key alone)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self._auth.is_open_method(method):
            return handler
        header = self._auth.metadata_authorization(handler_call_details.invocation_metadata)
        if self.api_key and self._auth.authorized(header, self.api_key):
            return handler
        if self.tenants is not None and self.tenants.tenant_of(header) is not None:
            return handler
        why = "no API key" if header is None else "wrong API key"
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                         f"{why}: send metadata `authorization: Bearer <key>`")


class _Undecodable:
    """What the lenient deserializer returns for bytes protobuf refused: the client's message."""

    def __init__(self, message: str):
        self.message = message


class DecodeErrors(grpc.ServerInterceptor):
    """Answer a request whose bytes protobuf cannot parse with INVALID_ARGUMENT naming the field
    (services/rpc/wire.py: "messages[0].content is not valid UTF-8 ..."), not grpcio's
    INTERNAL "Exception deserializing request!".

    grpcio deserializes before any handler runs, so this swaps the method's deserializer for one
    that returns an ``_Undecodable`` instead of raising, and the behaviour aborts on it. Both are
    public: the handler's ``request_deserializer`` and ``grpc.*_rpc_method_handler``. It is the
    innermost interceptor: the others wrap its behaviour and keep its deserializer."""

    def __init__(self, prefix: str = "/echospec."):
        self.prefix = prefix

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or \
                not method.startswith(self.prefix):
            return handler
        desc = _input_descriptor(method)
        if desc is None:
            return handler
        from echospec.services.rpc import wire
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return parse(data)
            except Exception as exc:   # protobuf's DecodeError; any refusal is the request's fault
                return _Undecodable(wire.explain(desc, bytes(data), exc))

        kind = _kind(handler)
        behavior = getattr(handler, kind)
        if handler.request_streaming:
            def requests_of(iterator, context):
                for request in iterator:
                    if isinstance(request, _Undecodable):
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request

            def checked(iterator, context):
                return behavior(requests_of(iterator, context), context)
        else:
            def checked(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return behavior(request, context)
        return _with_behavior(handler, kind, checked, request_deserializer=lenient)


def _input_descriptor(method: str):
    """The request message descriptor of "/package.Service/Method" (None when the default
    descriptor pool does not know it)."""
    service, _, name = method.lstrip("/").partition("/")
    try:
        return descriptor_pool.Default().FindMethodByName(f"{service}.{name}").input_type
    except KeyError:
        return None


@dataclass(frozen=True)
class Tls:
    """TLS settings of one service: PEM file paths, "" for none.

    cert, key: the certificate chain and key this service presents, as a server and, when a
        peer asks for one (mTLS), as a client. For mTLS one certificate serves both ways when it
        allows both uses (extended key usage serverAuth and clientAuth, or none).
    client_ca: the server demands client certificates signed by this CA (mTLS).
    ca: the CA that signed the certificates of the services this one calls; "" calls them
        over plain text.
    """

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    ca: str = ""

    @classmethod
    def of(cls, config: Any) -> "Tls":
        """The tls_cert, tls_key, tls_client_ca and tls_ca fields of a service config."""
        return cls(config.tls_cert, config.tls_key, config.tls_client_ca, config.tls_ca)

    def validate(self) -> None:
        """Raises ValueError naming the setting when a file is missing, a pair is incomplete, or
        a file holds no usable PEM (gRPC reports that only as "cannot bind", with
        TSI_INVALID_ARGUMENT in its own log; uvicorn as an ssl.SSLError traceback)."""
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{setting_name('tls_cert')} and {setting_name('tls_key')} go together (give both or "
                             f"neither)")
        if self.client_ca and not self.cert:
            raise ValueError(f"{setting_name('tls_client_ca')} (mTLS) needs {setting_name('tls_cert')} and "
                             f"{setting_name('tls_key')}")
        for name, path in (("tls_cert", self.cert), ("tls_key", self.key),
                           ("tls_client_ca", self.client_ca), ("tls_ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{setting_name(name)} {path}: no such file")
        import ssl

        def reason(exc: Exception) -> str:
            if isinstance(exc, ssl.SSLError):
                return exc.reason or "OpenSSL cannot read it"   # e.g. KEY_VALUES_MISMATCH
            return exc.strerror or str(exc)

        if self.cert:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                    self.cert, self.key, password=lambda: b"")   # never prompt on a terminal
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"{setting_name('tls_cert')} {self.cert}, {setting_name('tls_key')} {self.key}: "
                                 f"not a PEM certificate "
                                 f"chain and its unencrypted private key ({reason(exc)})") from None
        for name, path in (("tls_client_ca", self.client_ca), ("tls_ca", self.ca)):
            if path:
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
                except (ssl.SSLError, OSError) as exc:
                    raise ValueError(f"{setting_name(name)} {path}: not a PEM CA certificate "
                                     f"({reason(exc)})") from None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials of a TLS listener (None: plain text)."""
        if not self.cert:
            return None
        self.validate()
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials of a channel to a TLS server signed by ``ca``, presenting cert/key when
        set (None: plain text)."""
        if not self.ca:
            return None
        self.validate()
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None)


class _Slot:
    """One admitted call's place under a ConcurrencyLimit (see intercept_service)."""
    __slots__ = ("__weakref__",)


class ConcurrencyLimit(grpc.ServerInterceptor):
    """Admit at most `limit` concurrent RPCs of the services under `prefix`; refuse the rest
    with RESOURCE_EXHAUSTED at once. Health and reflection are not counted.

    The count is taken when the call arrives (the server's polling thread, before the call
    waits for a worker) and given back when the RPC terminates, whatever the reason.
    """

    def __init__(self, limit: int, prefix: str = "/echospec.", metrics=None):
        self.limit = limit
        self.prefix = prefix
        self.metrics = metrics      # metrics.RpcMetrics or None
        self._lock = threading.Lock()
        self.active = 0
        self._local: set = set()    # the contexts of in-process calls running (local_stream)
        # set by ServerHandle.stop when the grace period ends: every stream still running ends
        # with UNAVAILABLE and this message at its next message (Shutdown.check in servicers
        # that run long unary calls)
        self.shutdown = Shutdown()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        kind = _kind(handler)
        behavior = getattr(handler, kind)
        method = handler_call_details.method
        release = self._admit(method)
        if release is None:
            return self._refuse(handler, method)
        # A call cancelled while its request message is still on its way never runs its handler
        # (grpc drops it), so neither the handler's callback nor its finally gives the slot back.
        # The slot object lives exactly as long as the wrapped handler: when grpc lets go of a
        # handler it never ran, the finalizer releases the slot (after a run: a no-op).
        slot = _Slot()
        weakref.finalize(slot, release)
        return _with_behavior(handler, kind, self._counted(kind, behavior, release, slot))

    def _admit(self, method: str):
        """Count a call of ``method`` in: its release function, or None when `limit` calls are
        already running (recorded as RESOURCE_EXHAUSTED)."""
        with self._lock:
            admitted = self.active < self.limit
            if admitted:
                self.active += 1
        if not admitted:
            if self.metrics is not None:
                self.metrics.finished_rpc(method, "RESOURCE_EXHAUSTED", None)
            return None
        if self.metrics is not None:
            self.metrics.started(method)
        return self._finisher(method, time.monotonic())

    def local_stream(self, method: str, behavior, request, context) -> Iterator:
        """A server-streaming handler called from this process (services/rpc/inproc.py) under
        the same rules as a call from the network: admitted or refused with RESOURCE_EXHAUSTED,
        counted in the metrics and in `active` (a stopping server waits for it), checked against
        the shutdown message between messages, and ended by `end_local` when the server's grace
        period is over. ``context`` is inproc's ServicerContext stand-in."""
        release = self._admit(method)
        if release is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._refusal(method))
        with self._lock:
            self._local.add(context)
        if not context.add_callback(lambda: self._forget_local(context)):
            self._forget_local(context)
        return self._counted("unary_stream", behavior, release, None)(request, context)

    def _forget_local(self, context) -> None:
        with self._lock:
            self._local.discard(context)

    def end_local(self, message: str) -> None:
        """End every in-process call still running with UNAVAILABLE and ``message`` (what gRPC
        does to the network's calls when a stopping server's grace period is over)."""
        with self._lock:
            live = list(self._local)
        for context in live:
            context.end(grpc.StatusCode.UNAVAILABLE, message)

    def _finisher(self, method: str, t0: float):
        """release(context, error) once: give the slot back and record the RPC's status code
        (CANCELLED without a context: the call ended before its handler ran)."""
        done = threading.Lock()

        def release(context=None, error: bool = False) -> None:
            if not done.acquire(blocking=False):
                return
            with self._lock:
                self.active -= 1
            if self.metrics is not None:
                code = status_name(context, error) if context is not None else "CANCELLED"
                self.metrics.finished_rpc(method, code, time.monotonic() - t0)
        return release

    def _counted(self, kind: str, behavior, release, slot: "_Slot"):
        if kind.endswith("_stream"):
            def stream(request, context, _slot=slot):   # the handler holds its slot
                if not context.add_callback(lambda: release(context)):
                    release(context)
                error = True
                messages = None
                try:
                    messages = behavior(request, context)
                    for message in messages:
                        self.shutdown.check(context)
                        yield message
                    error = False
                finally:
                    close = getattr(messages, "close", None)
                    if close is not None:   # a generator left early: run its cleanup now
                        close()
                    release(context, error)
            return stream

        def unary(request, context, _slot=slot):
            if not context.add_callback(lambda: release(context)):
                release(context)
            error = True
            try:
                out = behavior(request, context)
                error = False
                return out
            finally:
                release(context, error)
        return unary

    def _refusal(self, method: str) -> str:
        return (f"{method}: {self.limit} RPCs already in progress on this server "
                f"(max_concurrent_rpcs); retry later")

    def _refuse(self, handler, method: str):
        return _refusing(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, self._refusal(method))


DEADLINE_SLACK_S = 0.05
"""A call that ends this close to its deadline ended by the deadline: the client's timer starts
when it sends the call, the server's when the call arrives, so the client's deadline fires first
and its cancel can reach the server a few ms before the server's own deadline."""


def status_name(context: grpc.ServicerContext, error: bool = False) -> str:
    """The status an RPC ends (or ended) with, as a grpc.StatusCode name: the code the handler
    set (abort), else CANCELLED / DEADLINE_EXCEEDED when the call is no longer active (within
    DEADLINE_SLACK_S of its deadline: DEADLINE_EXCEEDED), else UNKNOWN when the handler raised
    (`error`), else OK."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code.name
    if not context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"
    return "UNKNOWN" if error else "OK"


class Shutdown:
    """The message calls still running at the end of a server's grace period get: ``check``
    aborts the calling RPC with UNAVAILABLE and it once ``message`` is set (ServerHandle.stop).
    Stream handlers are checked between messages by ConcurrencyLimit; a servicer with a long
    unary call (the coordinator's Complete) calls ``check`` itself as its work advances."""

    def __init__(self):
        self.message = ""

    def check(self, context: grpc.ServicerContext) -> None:
        """Abort the RPC of ``context`` with UNAVAILABLE when the server is cancelling its calls."""
        if self.message:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.message)


CANCEL_WINDOW_S = 0.5   # after the grace period: time for streams to end with the shutdown message
_stop_log = logging.getLogger("echospec.shutdown")


class PortInUseError(RuntimeError):
    """The server could not bind host:port (taken or not permitted)."""


class InternalKeyAuth(grpc.ServerInterceptor):
    """The internal ports' ApiKeyAuth: refuse every RPC but health and reflection with
    UNAUTHENTICATED unless its metadata holds ``echospec-internal-key: <internal_key>``
    (auth.INTERNAL_KEY_METADATA), which the coordinator sends to the verifier and the verifier to
    the draft service. Inside the concurrency limit, as ApiKeyAuth."""

    def __init__(self, internal_key: str):
        from echospec.services.common import auth
        self._auth = auth
        self.internal_key = internal_key

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self._auth.is_open_method(method):
            return handler
        name = self._auth.INTERNAL_KEY_METADATA
        value = self._auth.metadata_value(handler_call_details.invocation_metadata, name)
        if self._auth.internal_key_ok(value, self.internal_key):
            return handler
        why = "no internal key" if value is None else "wrong internal key"
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                         f"{why}: this port is for the echospec services, which send metadata "
                         f"`{name}` (--internal-key / ECHOSPEC_INTERNAL_KEY)")


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the internal key) to every call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata,
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options capping message sizes (bytes) both ways."""
    return [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of every channel between the services: message caps, keepalive, fast reconnect."""
    return message_options(max_message_bytes) + [
        ("grpc.keepalive_time_ms", 30000),
        ("grpc.enable_retries", 0),
        # loopback: reconnect quickly after a restart of the peer
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def channel(target: str, max_message_bytes: int, tls: Tls | None = None,
            internal_key: str = "") -> grpc.Channel:
    """A channel to ``target`` ("host:port") with message caps and keepalive: TLS when
    ``tls.ca`` is set (see Tls.channel_credentials), else plain text; every call carries
    ``internal_key`` (InternalKeyAuth's metadata) when it is not ""."""
    creds = tls.channel_credentials() if tls is not None else None
    if creds is not None:
        ch = grpc.secure_channel(target, creds, options=channel_options(max_message_bytes))
    else:
        ch = grpc.insecure_channel(target, options=channel_options(max_message_bytes))
    if internal_key:
        from echospec.services.common.auth import INTERNAL_KEY_METADATA
        ch = grpc.intercept_channel(ch, _AddMetadata(((INTERNAL_KEY_METADATA, internal_key),)))
    return ch


class TlsMismatch:
    """Why a channel to ``target`` does not connect, when the cause is likely TLS on one side
    only: the service's own channel uses TLS exactly when ``tls.ca`` is set (``channel``), and
    a probe (echospec_client/tls_probe.py: one TCP connection and ClientHello) asks what the
    peer speaks. The probe runs at most once per ``every_s`` seconds; ``hint`` returns the last
    answer in between, so a poll loop can call it on every failure."""

    def __init__(self, target: str, tls: "Tls | None", every_s: float = 10.0,
                 timeout_s: float = 1.0):
        self.target = target
        self.uses_tls = bool(tls is not None and tls.ca)
        self.every_s = every_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._at = -math.inf
        self._hint = ""

    def hint(self, code: grpc.StatusCode | None = None) -> str:
        """"" or "the server at X speaks TLS but this service connects in plain text: set
        tls_ca ..." (or the reverse); a status code other than UNAVAILABLE gives "" without a
        probe (the peer answered, so the protocols match)."""
        if code is not None and code != grpc.StatusCode.UNAVAILABLE:
            return ""
        with self._lock:
            now = time.monotonic()
            if now - self._at < self.every_s:
                return self._hint
            self._at = now
        from echospec_client import tls_probe
        found = tls_probe.mismatch(self.target, self.uses_tls, self.timeout_s)
        if found:
            found = found.replace("this client", "this service") + (
                ": unset tls_ca (--tls-ca / ECHOSPEC_TLS_CA) or serve it with TLS"
                if self.uses_tls else
                ": set tls_ca (--tls-ca / ECHOSPEC_TLS_CA) to the CA that signed its certificate")
        with self._lock:
            self._hint = found
        return found


@dataclass
class ServerHandle:
    """A started (or startable) server with its health servicer and bound port."""

    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    limit: ConcurrencyLimit
    rpc_metrics: object                  # metrics.RpcMetrics
    metrics_http: object = None          # the /metrics server when this service runs one
    metrics_port: int = 0
    stopping: bool = False               # stop() was called: health stays NOT_SERVING
    internal_key: str = ""               # what its InternalKeyAuth demands ("": none; inproc.py)
    _health_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def serve_metrics(self, host: str, port: int, extra_registries=()) -> int:
        """Serve /metrics (this server's RPC metrics plus `extra_registries`) on host:port.

        Returns the bound port. Raises PortInUseError naming the metrics port."""
        from echospec.services.common.metrics import serve_metrics
        try:
            self.metrics_http, self.metrics_port = serve_metrics(
                host, port, [self.rpc_metrics.registry, *extra_registries])
        except OSError as exc:
            raise PortInUseError(f"metrics port {host}:{port}: {exc.strerror}") from None
        return self.metrics_port

    def set_serving(self) -> bool:
        """Health: SERVING for "" and every service name; a no-op once stop() was called.
        Returns whether it now says SERVING."""
        with self._health_lock:
            if self.stopping:
                return False
            for name in ("",) + self.service_names:
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            return True

    def set_not_serving(self) -> None:
        """Health: NOT_SERVING for "" and every service name."""
        with self._health_lock:
            for name in ("",) + self.service_names:
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def name(self) -> str:
        """The service's short name: "coordinator" for echospec.v1.CoordinatorService."""
        if not self.service_names:
            return "server"
        return self.service_names[0].rpartition(".")[2].removesuffix("Service").lower() or "server"

    def stop(self, grace_s: float, reason: str = "") -> threading.Event:
        """NOT_SERVING, stop accepting RPCs, let the calls in flight finish for grace_s seconds,
        then end the rest with UNAVAILABLE and a message saying the server is shutting down and
        why (not grpcio's bare "Cancelling all calls"); one log line says what stopped, why and
        how many calls finished or were cancelled.

        Args:
            grace_s: seconds the calls in flight get to finish (0: cancel them at once).
            reason: why it stops, for the message and the log ("SIGTERM"; "" says "stopped").
        Returns:
            The event set when the server has fully stopped (at most grace_s + CANCEL_WINDOW_S
            seconds from now when calls were in flight).
        """
        with self._health_lock:
            self.stopping = True
        self.set_not_serving()
        why = reason or "stopped"
        in_flight = self.limit.active
        message = (f"the {self.name} service is shutting down ({why}); this call was still "
                   f"running when its {grace_s:g} s grace period for calls in flight ended and "
                   f"is cancelled: send it again once the service is back, or to another one")
        if grace_s > 0 and in_flight:
            stopped = self.server.stop(grace_s + CANCEL_WINDOW_S)
            done = threading.Event()   # set once the server stopped and the line is logged
            threading.Thread(target=self._drain,
                             args=(grace_s, why, in_flight, message, stopped, done),
                             name=f"{self.name}-drain", daemon=True).start()
        else:
            self.limit.shutdown.message = message
            self.limit.end_local(message)
            done = self.server.stop(grace_s)
            _stop_log.log(logging.WARNING if in_flight else logging.INFO,
                          "%s service on port %d stopped (%s): %s", self.name, self.port, why,
                          f"{in_flight} call(s) in flight cancelled at once (no grace period)"
                          if in_flight else "no call was in flight")
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
            self.metrics_http = None
        return done

    def _drain(self, grace_s: float, why: str, in_flight: int, message: str,
               stopped: threading.Event, done: threading.Event) -> None:
        """Wait for the calls in flight for grace_s, then cancel the rest with ``message``; log
        the outcome and set ``done`` once the server has ``stopped``."""
        deadline = time.monotonic() + grace_s
        while self.limit.active and time.monotonic() < deadline and not stopped.is_set():
            time.sleep(0.02)
        left = self.limit.active
        if left:
            self.limit.shutdown.message = message
            self.limit.end_local(message)
        stopped.wait()   # grpcio cancels what is left CANCEL_WINDOW_S after the grace period
        _stop_log.log(logging.WARNING if left else logging.INFO,
                      "%s service on port %d stopped (%s): %d call(s) were in flight; %d "
                      "finished within the %g s grace period%s", self.name, self.port, why,
                      in_flight, in_flight - left, grace_s,
                      f", {left} cancelled with UNAVAILABLE (shutting down)" if left else "")
        done.set()


def host_port(host: str, port: int) -> str:
    """"host:port" for a gRPC target or URL, an IPv6 literal in brackets ("[::1]:50051")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build_server(host: str, port: int, max_workers: int, max_message_bytes: int,
                 service_names: Iterable[str], max_concurrent_rpcs: int | None = None,
                 rpc_metrics=None, tls: Tls | None = None, api_key: str = "",
                 internal_key: str = "", tenants: Any = None) -> ServerHandle:
    """Create a server bound to host:port with health (NOT_SERVING) and reflection.

    Register the service's servicers on ``handle.server`` before ``start()``.

    Args:
        host: bind address ("127.0.0.1" by default in every config).
        port: TCP port; 0 picks a free one (see ``handle.port``).
        max_workers: thread pool size (each open stream holds one thread).
        max_message_bytes: cap on received and sent message size.
        service_names: fully qualified names ("echospec.v1.DraftService").
        max_concurrent_rpcs: service RPCs admitted at once, in [1, max_workers - 1]; the rest of
            the pool answers health, reflection and the RESOURCE_EXHAUSTED refusals. None:
            max_workers - max(1, max_workers // 8).
        rpc_metrics: the metrics.RpcMetrics to record into (shared by the servers of one
            process); None: a new one (``handle.rpc_metrics``).
        tls: listen with TLS (mTLS with ``tls.client_ca``) when ``tls.cert`` is set; else plain.
        api_key: non-empty: service RPCs need ``authorization: Bearer <api_key>`` (ApiKeyAuth).
        internal_key: non-empty: service RPCs need ``echospec-internal-key: <internal_key>``
            (InternalKeyAuth; the verifier's and the draft service's ports).
        tenants: a tenants.Tenants whose keys ApiKeyAuth takes besides api_key (the coordinator
            with --api-keys-file).
    Raises:
        PortInUseError: the address could not be bound.
        ValueError: max_concurrent_rpcs not below max_workers; a TLS file missing.
    """
    names = tuple(service_names)
    if max_concurrent_rpcs is None:
        max_concurrent_rpcs = max_workers - max(1, max_workers // 8)
    if not 1 <= max_concurrent_rpcs < max_workers:
        raise ValueError(f"max_concurrent_rpcs = {max_concurrent_rpcs} must be in [1, max_workers - 1 = "
                         f"{max_workers - 1}]")
    from echospec.services.common.metrics import RpcMetrics
    rpc_metrics = rpc_metrics if rpc_metrics is not None else RpcMetrics()
    limit = ConcurrencyLimit(max_concurrent_rpcs, metrics=rpc_metrics)
    creds = tls.server_credentials() if tls is not None else None   # ValueError before binding
    interceptors = ([limit] + ([ApiKeyAuth(api_key, tenants)] if api_key or tenants else [])
                    + ([InternalKeyAuth(internal_key)] if internal_key else []) + [DecodeErrors()])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors,
                         options=message_options(max_message_bytes)
                         + [("grpc.so_reuseport", 0)],
                         maximum_concurrent_rpcs=None)
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection_servicer(names + (health.SERVICE_NAME, reflection.SERVICE_NAME)), server)
    addr = host_port(host, port)
    try:
        bound = (server.add_secure_port(addr, creds) if creds is not None
                 else server.add_insecure_port(addr))
    except RuntimeError as exc:
        raise PortInUseError(f"cannot bind {addr}: {exc}") from None
    if bound == 0:
        raise PortInUseError(f"cannot bind {addr} (port taken or not permitted)")
    handle = ServerHandle(server=server, health=hs, port=bound, service_names=names, limit=limit,
                          rpc_metrics=rpc_metrics, internal_key=internal_key)
    handle.set_not_serving()
    return handle


def wait_for_termination(handle: ServerHandle, grace_s: float) -> None:
    """Block until SIGINT/SIGTERM, then stop gracefully (main thread only): calls in flight get
    grace_s seconds, the rest end with UNAVAILABLE naming the signal and, under `echospec serve
    --processes`, why it stopped the stack (ServerHandle.stop, lifecycle.stop_reason)."""
    from echospec.services.rpc.lifecycle import stop_reason
    done = threading.Event()
    received = []

    def _on_signal(signum, frame):  # noqa: ARG001
        received.append(signal.Signals(signum).name)
        done.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        why = stop_reason(received[0]) if received else "stopped"
        _stop_log.info("%s service on port %d stopping (%s); calls in flight get %g s",
                       handle.name, handle.port, why, grace_s)
        handle.stop(grace_s, why).wait()
