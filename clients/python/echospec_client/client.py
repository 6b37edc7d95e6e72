"""`Client`: the echospec coordinator's gRPC API with typed results.

    from echospec_client import Client
    with Client("127.0.0.1:50051") as c:
        r = c.chat([{"role": "user", "content": "Say hi"}], max_tokens=32)
        print(r.text, r.finish_reason, r.stats.cached_prompt_tokens)

Timeouts: a call's `timeout` (seconds) bounds the wait for the connection and the call
together; the wait for the connection alone is also bounded by `connect_timeout`, so an
address where nothing listens fails in seconds with `ConnectError`, not at the call's
deadline. Server errors come back as `ClientError` with the gRPC status; arguments the
protocol cannot carry (a wrong type, a value outside its field's range) raise TypeError or
ValueError before anything is sent, and values the server refuses (max_tokens=-1, a NaN
temperature) come back as ClientError INVALID_ARGUMENT.
"""
from __future__ import annotations

import ipaddress
import json
import math
import numbers
import os
import re
import time
from dataclasses import dataclass, field, fields
from typing import Iterator, Mapping, NoReturn, Sequence, Union

import grpc

from echospec_client.limits import (FLOAT32_MAX, GRPC_URI_SCHEMES, INT32_MAX, INT32_MIN, MAX_KEY_CHARS,
                                    MAX_REQUEST_ID, MAX_TOP_LOGPROBS, MAX_TREE_DRAFT_NODES, UINT64_MAX)
from echospec_client.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
API_KEY_ENV = "ECHOSPEC_API_KEY"


# ---- typed results --------------------------------------------------------------

@dataclass(frozen=True)
class SpecStats:
    """Speculative-decoding counters and timings of one generation (echospec.v1.SpecStats).

    tries: verify rounds with K >= 1 drafts; hits: accepted drafts; kv_rolls: rejected drafts
    rolled back (hits + kv_rolls == draft_tokens <= tries * k). acceptance_rate = hits /
    draft_tokens, mean_acceptance_length = 1 + hits / tries. t_ms, v_ms, overhead_ms,
    prefill_ms are milliseconds measured by the verifier. cached_prompt_tokens: prompt tokens
    whose KV the verifier's prefix cache supplied (not prefilled again).
    accepted/rejected_prediction_tokens: drafts from the request's prediction accepted and
    rejected. sources: per draft source ("suffix", "shared", "numbered", "prediction", "grammar",
    "prior") that drafted, {"draft_tokens": ..., "hits": ..., "tries": ...}. k_choice: the verifier's cost
    model's last choice of the round's shape (chain K, a tree of n nodes, none) and why (the
    measured T and V, E), "" when it made none. tree_rounds: rounds that verified a token tree.
    expected_accepted: the accepted drafts per draft round the cost model expected of its
    choices, mean (compare hits / tries; 0 when it chose none).
    round_cost: where a round's wall time went in the verifier's loop, ms means per round
    (echospec.v1.RoundCost): {"wall_ms", "v_ms", "draft_ms", "sched_ms", "accept_ms",
    "rollback_ms", "rest_ms"}; empty when the server sends none.
    """

    tries: int = 0
    hits: int = 0
    kv_rolls: int = 0
    draft_tokens: int = 0
    rounds: int = 0
    proposals: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 0.0
    mean_accepted_per_round: float = 0.0
    t_ms: float = 0.0
    v_ms: float = 0.0
    overhead_ms: float = 0.0
    overhead_share: float = 0.0
    prefill_ms: float = 0.0
    gain: bool = False
    gain_verdict: str = ""
    cached_prompt_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    sources: dict = field(default_factory=dict)
    k_choice: str = ""
    round_cost: dict = field(default_factory=dict)
    tree_rounds: int = 0
    expected_accepted: float = 0.0

    @classmethod
    def from_proto(cls, s: common_pb2.SpecStats) -> "SpecStats":
        kw = {f.name: getattr(s, f.name) for f in fields(cls) if f.name not in ("sources", "round_cost")}
        kw["sources"] = {x.source: {"draft_tokens": x.draft_tokens, "hits": x.hits, "tries": x.tries}
                         for x in s.sources}
        if s.HasField("round_cost"):
            kw["round_cost"] = {f.name: getattr(s.round_cost, f.name)
                                for f in s.round_cost.DESCRIPTOR.fields}
        return cls(**kw)


FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    common_pb2.FINISH_REASON_EOS: "eos",          # the model's end-of-generation token
    common_pb2.FINISH_REASON_STOP: "stop",        # a stop string (not in the text)
    common_pb2.FINISH_REASON_LENGTH: "length",    # max_tokens
    common_pb2.FINISH_REASON_CONTEXT: "context",  # the verifier's KV cache is full
}


@dataclass(frozen=True)
class Move:
    """The generation moved to another verifier mid-way (echospec.v1.VerifierMove): its verifier
    failed or stalled after the first token, and ``to_verifier`` prefilled the prompt plus the
    ``at_token`` output tokens so far and decoded on; the text is unchanged. ``reason``: the
    failing status or the missed progress deadline; ``resume_ms``: from the failure seen to the
    next verifier's first token; ``prefill_ms`` and ``cached_prompt_tokens``: that verifier's
    prefill (the tokens its prefix cache supplied)."""

    from_verifier: str
    to_verifier: str
    at_token: int
    reason: str
    resume_ms: float
    prefill_ms: float
    cached_prompt_tokens: int

    @classmethod
    def from_proto(cls, m: coordinator_pb2.VerifierMove) -> "Move":
        return cls(from_verifier=m.from_verifier, to_verifier=m.to_verifier, at_token=m.at_token,
                   reason=m.reason, resume_ms=m.resume_ms, prefill_ms=m.prefill_ms,
                   cached_prompt_tokens=m.cached_prompt_tokens)


@dataclass(frozen=True)
class TopLogprob:
    """An alternative at a token's position: its id, text, raw bytes and logprob."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's logprob (echospec.v1.TokenLogprob): log_softmax of the model's raw
    logits row that chose it (temperature 1; after the grammar's mask), the same with
    speculation on or off. token: its text ("bytes:\\xe2\\x80" for a piece of a UTF-8
    character); top_logprobs: the most likely tokens there, most likely first."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float
    top_logprobs: tuple = ()           # TopLogprob

    @classmethod
    def from_proto(cls, lp: common_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(token_id=lp.token_id, token=lp.token, bytes=lp.bytes, logprob=lp.logprob,
                   top_logprobs=tuple(TopLogprob(t.token_id, t.token, t.bytes, t.logprob)
                                      for t in lp.top_logprobs))


@dataclass(frozen=True)
class Result:
    """A finished generation.

    text: the whole output; token_ids: its tokens (EOS excluded); finish_reason: "eos",
    "stop", "length" or "context"; spec_enabled: speculation ran; spec_reason: why it did
    not, or fell back ("" when it ran throughout). wall_s and ttft_s are this client's own
    measurements: seconds from sending the request to its last message and to the first
    token (None when no token came, or for `complete`, which has no first-token time).
    verifier: the address of the verifier that finished the generation; moves: each move to
    another verifier after its verifier failed or stalled mid-generation (empty when none).
    logprobs: a TokenLogprob per token of token_ids when the request asked (logprobs=True).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    spec_enabled: bool
    spec_reason: str
    stats: SpecStats
    verifier: str = ""
    wall_s: float | None = None
    ttft_s: float | None = None
    moves: tuple = ()                  # Move, in order
    tool_calls: tuple = ()             # ToolCall, parsed from the output (a request with tools)
    logprobs: tuple = ()               # TokenLogprob per output token (logprobs=True)

    @property
    def tokens_per_s(self) -> float:
        """completion_tokens / wall_s (0.0 without a wall time)."""
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @classmethod
    def from_proto(cls, r: coordinator_pb2.GenerationResult, wall_s: float | None = None,
                   ttft_s: float | None = None) -> "Result":
        return cls(text=r.text, token_ids=list(r.token_ids), prompt_tokens=r.prompt_tokens,
                   completion_tokens=r.completion_tokens,
                   finish_reason=FINISH_REASONS.get(r.finish_reason, str(r.finish_reason)),
                   spec_enabled=r.spec_enabled, spec_reason=r.spec_reason,
                   stats=SpecStats.from_proto(r.stats), verifier=r.verifier, wall_s=wall_s,
                   ttft_s=ttft_s, moves=tuple(Move.from_proto(m) for m in r.moves),
                   tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in r.tool_calls),
                   logprobs=tuple(TokenLogprob.from_proto(lp) for lp in r.logprobs))


@dataclass(frozen=True)
class ToolCall:
    """A function call: the model's (Result.tool_calls), or one of an assistant Message.
    arguments: JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Chunk:
    """One streamed message: a text delta (never a split UTF-8 character) and its tokens (and
    their TokenLogprobs when asked for). The last chunk of a stream carries `result`; the others
    have result None."""

    text: str
    token_ids: list[int]
    result: Result | None = None
    logprobs: tuple = ()


@dataclass(frozen=True)
class Message:
    """A chat message: role "system" (or "developer", its OpenAI name), "user", "assistant" or
    "tool", and its content (the server checks the role). An assistant message may carry the
    ToolCalls it made, a tool message the id of the call it answers (and the function's name)."""

    role: str
    content: str
    tool_calls: tuple = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Info:
    """The coordinator's configuration (GetInfo). model: the GGUF file name (the server does
    not tell its path)."""

    model: str
    spec_default: bool
    k_default: int
    k_max: int
    max_tokens_default: int
    n_ctx: int
    n_vocab: int
    max_tokens_limit: int = 0   # the largest max_tokens a request may ask (0: not reported)
    arch: str = ""              # the model's architecture ("": not reported)
    n_expert: int = 0           # mixture of experts: experts per layer (0: dense)
    n_expert_used: int = 0      # experts each token runs
    chat_template_missing: str = ""   # why chat messages are refused ("": the server renders them)
    kv_eviction: str = ""       # the verifiers' KV eviction: "none" or "sinks S, window W" ("": not reported)
    images: bool = False        # the model takes image parts
    images_missing: str = ""    # why it does not ("": it does, or not reported)
    sparse_attention: bool = False  # the verifiers' decode attends the top KV blocks only
    kv_type: str = ""           # the verifiers' KV cache type: "f16" or "q8_0" ("": not reported)


# grpcio's refusal of a message above the receiver's (or this channel's send) limit
_MESSAGE_TOO_LARGE = re.compile(r"(?:Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")


class ClientError(Exception):
    """A call failed. `code` is the grpc.StatusCode (INVALID_ARGUMENT for a request the server
    refuses, UNAUTHENTICATED for a missing or wrong API key, DEADLINE_EXCEEDED, UNAVAILABLE,
    RESOURCE_EXHAUSTED under overload, ...), `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError, target: str = "",
                       timeout_s: float | None = None) -> "ClientError":
        """The error of a failed call; a call that could not reach ``target`` any more (the
        server stopped or restarted after this client connected) says so before grpcio's
        "failed to connect to all addresses; ...", and one that ran out of its own
        ``timeout_s`` says so before grpcio's "Deadline Exceeded" (or "Stream removed")."""
        details = exc.details() or ""
        if timeout_s is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            details = (f"the call did not finish within its timeout of {timeout_s:g} s "
                       f"(grpc: {details})")
        big = _MESSAGE_TOO_LARGE.search(details) \
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        if big:   # the request itself, e.g. images near the limit: not an overload
            details = (f"the request is {big.group(1)} bytes, above the server's message limit "
                       f"of {big.group(2)} bytes (images and text together): send fewer or "
                       f"smaller images (grpc: {details})")
        if target and exc.code() == grpc.StatusCode.UNAVAILABLE and \
                details.startswith("failed to connect"):
            details = (f"the server at {target} went away: nothing accepts connections there "
                       f"now (stopped or restarting?); grpc: {details}")
        return cls(exc.code(), details)


class ConnectError(ClientError):
    """No connection to the target within the wait (`waited_s` seconds). `bound` names what
    limited the wait: "connect_timeout" or "timeout" (the call's own timeout was shorter).

    `tls_mismatch` is "" or why the connection likely failed: the server speaks TLS and this
    client plain text, or the other way round (tls_probe.py; then `waited_s` is the time until
    the first failed attempt, not the whole wait). `uses_tls`: this client connects with TLS.
    `cause` is "" or another likely reason found the same way: the server's TLS certificate did
    not verify, or the port answers HTTP (the HTTP gateway), not gRPC. `reason` is "" or why no
    TCP connection opened at the end of the wait (the host name does not resolve, connection
    refused, no answer); it ends the message in parentheses."""

    def __init__(self, target: str, waited_s: float, bound: str, tls_mismatch: str = "",
                 uses_tls: bool = False, cause: str = "", reason: str = ""):
        if cause:
            message = f"cannot connect to {target}: {cause}"
        elif tls_mismatch:
            fix = ("connect without TLS (tls=False, no root_certificates)" if uses_tls else
                   "connect with TLS (tls=True, or root_certificates= the CA's PEM for a "
                   "private CA)")
            message = f"cannot connect to {target}: {tls_mismatch}; {fix}"
        else:
            message = f"no coordinator reachable at {target} within {waited_s:g} s" + (
                f" ({reason})" if reason else "")
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.target = target
        self.waited_s = waited_s
        self.bound = bound
        self.tls_mismatch = tls_mismatch
        self.uses_tls = uses_tls
        self.cause = cause
        self.reason = reason


MessageLike = Union[Message, Mapping[str, str]]


# ---- the client -------------------------------------------------------------------

def _read_pem(value: bytes | str | os.PathLike | None, what: str) -> bytes | None:
    """PEM bytes as given (or PEM text), or read from a file path (str or PathLike)."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode("ascii")
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what} {value}: {exc.strerror}") from None


def _check_pem(roots: bytes | None, cert: bytes | None, pkey: bytes | None) -> None:
    """ValueError when the PEM given cannot serve: gRPC itself only logs "Could not load any
    root certificate" and then fails every call as if the server were down."""
    import ssl
    import tempfile

    def reason(exc: Exception) -> str:
        return getattr(exc, "reason", None) or str(exc)

    if roots is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=roots.decode("latin-1"))
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"root_certificates: not a PEM CA certificate ({reason(exc)})") from None
    if cert is not None and pkey is not None:
        with tempfile.TemporaryDirectory() as d:   # load_cert_chain reads files only
            paths = []
            for name, data in (("cert.pem", cert), ("key.pem", pkey)):
                paths.append(os.path.join(d, name))
                with open(paths[-1], "wb") as f:
                    f.write(data)
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                    paths[0], paths[1], password=lambda: b"")   # never prompt on a terminal
            except ssl.SSLError as exc:
                raise ValueError(f"client_certificate / client_key: not a PEM certificate chain "
                                 f"and its unencrypted private key ({reason(exc)})") from None


def _check_timeout(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_target_port(target: str) -> None:
    """Refuse a target holding a space or a control character, or a host:port target whose port
    no server can listen on (gRPC would wait the whole connect timeout on it and report nothing
    reachable). gRPC URIs (dns:///..., unix:...), a
    bare IPv6 address and a host without a port (gRPC's default 443) are left to gRPC."""
    if "://" in target or target.startswith(GRPC_URI_SCHEMES):
        return
    for i, c in enumerate(target):   # no host name or address holds one (gRPC: DNS fails)
        if c.isspace() or not c.isprintable():
            raise ValueError(f"target {target!r} is not a valid host:port (character {i + 1} is "
                             f"{'a space' if c == ' ' else f'U+{ord(c):04X}'}); the target is "
                             f"host:port, e.g. 127.0.0.1:50051 or [::1]:50051")
    if target.startswith("["):
        host_end = target.find("]")
        if host_end < 0 or not target[host_end + 1:].startswith(":"):
            return
        port = target[host_end + 2:]
    else:
        host, sep, port = target.rpartition(":")
        if not sep:
            return
        if ":" in host:   # an IPv6 address: a port after it needs the address in brackets
            try:
                ipaddress.ip_address(target)
                return    # a bare IPv6 address: gRPC's default port
            except ValueError:
                raise ValueError(f"target {target!r}: an IPv6 address with a port goes in brackets, "
                                 f"e.g. [{host}]:{port}") from None
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"target {target!r}: the port {port!r} is not a number in [1, 65535]; "
                         f"the target is host:port, e.g. 127.0.0.1:50051 or [::1]:50051")


class Client:
    """A connection to an echospec coordinator.

    Args:
        target: "host:port" of the coordinator ("[::1]:50051" for IPv6).
        timeout: default seconds per call, connection wait included (None: no deadline).
        connect_timeout: the most seconds a call waits for the connection (default 10).
        api_key: sent on every call as ``authorization: Bearer <key>`` metadata; None reads
            the ECHOSPEC_API_KEY environment variable ("" sends nothing).
        root_certificates: PEM bytes (or text), or a path to a PEM file, of the CA(s) that
            signed the server's certificate; turns TLS on.
        tls: True for TLS with the system's roots when root_certificates is not given; None
            (default) means TLS exactly when a certificate argument is given.
        client_certificate, client_key: PEM bytes or paths, for servers that require a
            client certificate (mutual TLS).
        server_name: the name to check the server's certificate against, when it is not the
            target's host (grpc.ssl_target_name_override).
        max_message_bytes: the largest message received or sent.
    Raises:
        ValueError: a bad timeout, a target holding a space or a control character, a host:port
            target whose port is not in [1, 65535], or an unreadable certificate file.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = 600.0,
                 connect_timeout: float = 10.0, api_key: str | None = None,
                 root_certificates: bytes | str | os.PathLike | None = None,
                 tls: bool | None = None,
                 client_certificate: bytes | str | os.PathLike | None = None,
                 client_key: bytes | str | os.PathLike | None = None,
                 server_name: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        if not isinstance(target, str) or not target.strip():
            raise ValueError("target must be host:port, not empty")
        _check_target_port(target)
        self.target = target
        self.timeout = _check_timeout(timeout, "timeout")
        self.connect_timeout = _check_timeout(connect_timeout, "connect_timeout")
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        if len(key) > MAX_KEY_CHARS:   # gRPC would refuse every call's metadata
            raise ValueError(f"api_key is {len(key)} characters long: at most {MAX_KEY_CHARS}")
        bad = next((c for c in key if not " " <= c <= "~"), None)
        if bad is not None:   # gRPC metadata carries printable ASCII only
            raise ValueError(f"api_key must be printable ASCII, got {bad!r}")
        if key != key.strip(" "):   # the server compares the key without surrounding spaces
            raise ValueError("api_key must not begin or end with a space")
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()
        opts = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 30000),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        roots = _read_pem(root_certificates, "root_certificates")
        cert = _read_pem(client_certificate, "client_certificate")
        pkey = _read_pem(client_key, "client_key")
        if (cert is None) != (pkey is None):
            raise ValueError("client_certificate and client_key go together")
        _check_pem(roots, cert, pkey)
        use_tls = tls if tls is not None else (roots is not None or cert is not None)
        if use_tls:
            if server_name:
                opts.append(("grpc.ssl_target_name_override", server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=roots, private_key=pkey,
                                                 certificate_chain=cert)
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            if roots is not None or cert is not None:
                raise ValueError("certificates were given with tls=False")
            self._channel = grpc.insecure_channel(target, options=opts)
        self.tls = bool(use_tls)
        self._roots = roots                  # for the diagnosis of a failed connection
        self._server_name = server_name or None
        self._connected = False
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    # -- lifecycle

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the channel is connected.

        Args:
            timeout: seconds (default: connect_timeout).
        Raises:
            ConnectError: not connected within the wait.
        """
        wait = self.connect_timeout if timeout is None else timeout
        self._wait(wait, "connect_timeout" if timeout is None else "timeout", force=True)

    def _wait(self, wait: float | None, bound: str, force: bool = False) -> None:
        """Wait for the connection with a GetInfo call (any answer, an error status included,
        means the server is there). Done on a client's first call only: later calls on a lost
        connection fail at once with UNAVAILABLE.

        The first attempt does not wait for the channel to be ready: when it fails with
        UNAVAILABLE and a TLS probe finds the server speaking the other protocol (a TLS client
        and a plain-text server, or the reverse), ConnectError says so at once. Otherwise a
        second call waits for the channel (the server may be starting) for the rest of `wait`.
        (Not grpc.channel_ready_future: its polling thread can outlive the channel and print
        an exception when the process exits right after.)"""
        if self._connected and not force:
            return
        t0 = time.monotonic()
        try:
            self._stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=wait,
                               metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._connect_failed(wait, bound, call=not force)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._check_tls_mismatch(time.monotonic() - t0, bound)
                left = None if wait is None else max(0.001, wait - (time.monotonic() - t0))
                try:
                    self._stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=left,
                                       wait_for_ready=True, metadata=self._metadata)
                except grpc.RpcError as again:
                    if again.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self._connect_failed(wait, bound, call=not force)
        self._connected = True

    def _check_tls_mismatch(self, waited_s: float, bound: str) -> None:
        """Raise ConnectError when the server likely speaks the other protocol (TLS or not), or
        its certificate does not verify, or it answers HTTP, not gRPC."""
        from echospec_client import tls_probe
        hint = tls_probe.mismatch(self.target, self.tls, timeout_s=2.0)
        if hint:
            raise ConnectError(self.target, round(waited_s, 3), bound, hint, self.tls)
        cause = tls_probe.other_cause(self.target, self.tls, self._roots, self._server_name,
                                      timeout_s=2.0)
        if cause:
            raise ConnectError(self.target, round(waited_s, 3), bound, uses_tls=self.tls,
                               cause=cause)

    def _connect_failed(self, wait: float | None, bound: str, call: bool = False) -> NoReturn:
        """Raise ConnectError naming why nothing answered within `wait`; for a call (`call`)
        whose own timeout bounded the wait at a server that accepts connections, ClientError
        DEADLINE_EXCEEDED instead."""
        from echospec_client import tls_probe
        self._check_tls_mismatch(wait or 0.0, bound)
        reason = tls_probe.tcp_failure(self.target, timeout_s=1.0)
        if call and not reason and bound == "timeout" and \
                tls_probe.split_target(self.target) is not None:
            # a TCP connection opens: a server is there and the call's own timeout ran out
            # before it answered, not a connect wait for nothing
            raise ClientError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"the call did not finish within its timeout of {wait:g} s (the "
                              f"server at {self.target} accepts connections but did not answer "
                              f"in time)") from None
        raise ConnectError(self.target, wait, bound, reason=reason) from None

    def _begin(self, timeout: float | None) -> float | None:
        """Wait for the connection within the call's budget; return the seconds left for the
        call itself (None: no deadline)."""
        timeout = self.timeout if timeout is None else _check_timeout(timeout, "timeout")
        t0 = time.monotonic()
        if timeout is None:
            self._wait(self.connect_timeout, "connect_timeout")
            return None
        if self.connect_timeout is not None and self.connect_timeout < timeout:
            self._wait(self.connect_timeout, "connect_timeout")
        else:
            self._wait(timeout, "timeout")
        return max(0.001, timeout - (time.monotonic() - t0))

    def _total(self, timeout: float | None) -> float | None:
        """A call's whole timeout (the connection wait included; None: no deadline)."""
        return self.timeout if timeout is None else timeout

    def _md(self, request_id: str | None):
        return self._metadata + ((("x-request-id", request_id),) if request_id else ())

    # -- generation

    def complete(self, prompt: str | None = None, *, messages: Sequence[MessageLike] | None = None,
                 token_ids: Sequence[int] | None = None, timeout: float | None = None,
                 request_id: str | None = None, **sampling) -> Result:
        """One generation, returned when it ends.

        Args:
            prompt: raw prompt text (special-token text becomes the special token); or
            messages: chat messages, rendered with the model's chat template; or
            token_ids: prompt token ids. Exactly one of the three.
            timeout: seconds for this call (default: the client's).
            request_id: sent as x-request-id metadata (the server logs it).
            **sampling: max_tokens (0: the server's default), stop (a list of strings),
                temperature (<= 0: greedy), top_p, top_k, min_p, seed, spec (True, False, or
                None for the server's default), k (drafts per round, 0: server default),
                prediction (expected output text, a draft source), draft_namespace,
                enable_thinking (messages only: passed to the chat template; None: its default),
                grammar (constrained output: {"json_schema": dict or JSON text},
                {"json_object": True}, {"lark": text} or {"gbnf": text}; None: free text),
                tools (messages only: OpenAI's list of function tools, or its JSON text; the
                calls come back in Result.tool_calls) and tool_choice ("auto", "none",
                "required", a function's name, or OpenAI's {"type": "function", ...}).
                frequency_penalty, presence_penalty (in [-2, 2]), repeat_penalty (> 0; 1 or
                None: off) and repeat_last_n (tokens of prompt + output counted; 0: 64, -1:
                the whole context): llama.cpp's repetition penalties.
                logprobs (True: Result.logprobs holds each token's logprob), top_logprobs
                (0..20 most likely alternatives per token, with logprobs=True).
                tree_nodes (speculation: draft nodes a round verifies as a token tree, 1..63;
                0 or None: the verifier's --tree-nodes; -1: chains).
        Returns:
            The Result, with wall_s measured here.
        Raises:
            TypeError, ValueError: bad arguments (nothing is sent).
            ConnectError: no connection within the wait.
            ClientError: the call failed (code and details from the server).
        """
        _check_request_id(request_id)
        req = coordinator_pb2.CompleteRequest()
        _fill(req, prompt, messages, token_ids, sampling)
        left = self._begin(timeout)
        t0 = time.perf_counter()
        try:
            resp = self._stub.Complete(req, timeout=left, metadata=self._md(request_id))
        except grpc.RpcError as exc:
            raise ClientError.from_rpc_error(exc, self.target, self._total(timeout)) from None
        return Result.from_proto(resp.result, wall_s=time.perf_counter() - t0)

    def stream(self, prompt: str | None = None, *, messages: Sequence[MessageLike] | None = None,
               token_ids: Sequence[int] | None = None, timeout: float | None = None,
               request_id: str | None = None, **sampling) -> Iterator[Chunk]:
        """A generation streamed as text deltas; the same arguments as `complete`.

        Yields:
            Chunk per message; the last one carries the Result (with wall_s and ttft_s
            measured here). Closing the generator cancels the call, and the server frees the
            generation: leaving a ``for`` loop over ``stream(...)`` early does (break, an
            exception); a stream kept in a variable needs ``close()`` (or
            ``contextlib.closing``), else it runs on until it is garbage-collected.
        Raises:
            TypeError, ValueError: bad arguments (raised by the call, before anything is sent).
            ConnectError, ClientError: as `complete`; a failure mid-stream raises from the
            iteration.
        """
        _check_request_id(request_id)
        req = coordinator_pb2.GenerateRequest()
        _fill(req, prompt, messages, token_ids, sampling)
        left = self._begin(timeout)
        return self._iterate(req, left, request_id, self._total(timeout))

    def _iterate(self, req, left: float | None, request_id: str | None,
                 total: float | None = None) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        ttft = None
        call = self._stub.Generate(req, timeout=left, metadata=self._md(request_id))
        try:
            for msg in call:
                if ttft is None and msg.token_ids:
                    ttft = time.perf_counter() - t0
                result = None
                if msg.HasField("result"):
                    result = Result.from_proto(msg.result, wall_s=time.perf_counter() - t0,
                                               ttft_s=ttft)
                yield Chunk(text=msg.text, token_ids=list(msg.token_ids), result=result,
                            logprobs=tuple(TokenLogprob.from_proto(lp) for lp in msg.logprobs))
        except grpc.RpcError as exc:
            raise ClientError.from_rpc_error(exc, self.target, total) from None
        finally:
            call.cancel()   # a no-op when the stream ended; frees the generation otherwise

    def chat(self, messages: Sequence[MessageLike], *, timeout: float | None = None,
             request_id: str | None = None, **sampling) -> Result:
        """`complete` over chat messages: [{"role": "user", "content": "..."}, ...] or
        Message objects. For a streamed chat, `stream(messages=...)`."""
        return self.complete(messages=messages, timeout=timeout, request_id=request_id, **sampling)

    # -- tokens and info

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        """Token ids of `text` (no special tokens added; special-token text is parsed)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        request = coordinator_pb2.TokenizeRequest(text=_unicode(text, "text"))
        return list(self._unary("Tokenize", request, timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        """The text of `token_ids`."""
        return self._unary("Detokenize", coordinator_pb2.DetokenizeRequest(
            token_ids=_int_list(token_ids, "token_ids")), timeout).text

    def info(self, *, timeout: float | None = None) -> Info:
        """The coordinator's model and defaults."""
        r = self._unary("GetInfo", coordinator_pb2.GetInfoRequest(), timeout)
        return Info(**{f.name: getattr(r, f.name) for f in fields(Info)})

    def _unary(self, rpc: str, request, timeout: float | None):
        left = self._begin(timeout)
        try:
            return getattr(self._stub, rpc)(request, timeout=left, metadata=self._md(None))
        except grpc.RpcError as exc:
            raise ClientError.from_rpc_error(exc, self.target, self._total(timeout)) from None


# ---- request building -----------------------------------------------------------------

_SPEC_MODES = {None: common_pb2.SPEC_MODE_UNSPECIFIED, False: common_pb2.SPEC_MODE_OFF,
               True: common_pb2.SPEC_MODE_ON}
_SAMPLING = ("max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "seed", "spec", "k",
             "prediction", "draft_namespace", "enable_thinking", "grammar", "tools", "tool_choice",
             "frequency_penalty", "presence_penalty", "repeat_penalty", "repeat_last_n",
             "logprobs", "top_logprobs", "tree_nodes")
_GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "gbnf")


def _int_list(values, name: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
        if not INT32_MIN <= v <= INT32_MAX:
            raise ValueError(f"{name}[{i}] = {v} is out of range (a 32-bit integer)")
        out.append(v)
    return out


def _unicode(v: str, name: str) -> str:
    """``v`` when it is valid Unicode; a lone surrogate (e.g. bytes that were not UTF-8, read with
    surrogateescape) is a ValueError naming the argument, not protobuf's UnicodeEncodeError."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode (character {exc.start + 1} is a lone "
                         f"surrogate {v[exc.start]!r}: bytes that were not UTF-8?)") from None
    return v


def _text_parts(v, name: str):
    """A content given as OpenAI's list of text parts, [{"type": "text", "text": str}, ...], joined
    into one string (as the HTTP gateway does); anything else is returned for the caller's check."""
    if not isinstance(v, (list, tuple)):
        return v
    parts = []
    for j, p in enumerate(v):
        if not (isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            raise TypeError(f"{name}[{j}] must be a text part {{'type': 'text', 'text': str}}; other "
                            f"content types are not supported, got {p!r:.200}")
        parts.append(p["text"])
    return "".join(parts)


def image_part(data: bytes, media_type: str = "") -> dict:
    """A content part carrying an image file's bytes (PNG, JPEG, WebP or GIF), for a message's
    content list: [{"type": "text", "text": "What is this?"}, image_part(png_bytes, "image/png")]."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image_part: data must be the image file's bytes (open(path, 'rb').read()), "
                        f"got {type(data).__name__}")
    return {"type": "image", "image": bytes(data), "media_type": media_type}


def _parts(v, name: str):
    """A content list with image parts as ContentParts (None: no image part in it, or not a list)."""
    if not isinstance(v, (list, tuple)) or not any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in v):
        return None
    out = []
    for j, p in enumerate(v):
        kind = p.get("type") if isinstance(p, Mapping) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append(coordinator_pb2.ContentPart(text=_unicode(p["text"], f"{name}[{j}].text")))
        elif kind == "image" and isinstance(p.get("image"), (bytes, bytearray)) and \
                isinstance(p.get("media_type", ""), str):
            out.append(coordinator_pb2.ContentPart(image=bytes(p["image"]),
                                                   media_type=p.get("media_type", "")))
        else:
            raise TypeError(f"{name}[{j}] must be a text part {{'type': 'text', 'text': str}} or an "
                            f"image part {{'type': 'image', 'image': bytes, 'media_type': str}}, "
                            f"got {p!r:.200}")
    return out


def check_messages(messages) -> None:
    """Raise what `Client.chat` and `Client.complete` raise for ``messages`` before sending
    anything: TypeError or ValueError naming the first bad message and field."""
    _messages(messages)


def _messages(messages) -> list[coordinator_pb2.ChatMessage]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role', 'content'} mappings or Message objects")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Message):
            role, content, calls, call_id, name = m.role, m.content, m.tool_calls, m.tool_call_id, m.name
        elif isinstance(m, Mapping):
            role, content = m.get("role"), m.get("content")
            calls, call_id, name = m.get("tool_calls") or (), m.get("tool_call_id") or "", m.get("name") or ""
        else:
            raise TypeError(f"messages[{i}] must be a mapping or a Message, got {m!r}")
        if content is None and calls:   # an assistant's calls without text (OpenAI's null)
            content = ""
        parts = _parts(content, f"messages[{i}].content")
        if parts is not None:
            content = ""
        content = _text_parts(content, f"messages[{i}].content")
        for key, v in (("role", role), ("content", content)):
            if not isinstance(v, str):
                what = "a string or a list of text parts" if key == "content" else "a string"
                raise TypeError(f"messages[{i}].{key} must be {what}, got {v!r}")
            _unicode(v, f"messages[{i}].{key}")
        for key, v in (("tool_call_id", call_id), ("name", name)):
            if not isinstance(v, str):
                raise TypeError(f"messages[{i}].{key} must be a string, got {v!r}")
        out.append(coordinator_pb2.ChatMessage(
            role=role, content=content, tool_call_id=call_id, name=name, parts=parts or (),
            tool_calls=[_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]))
    return out


def _tool_call(c, name: str) -> coordinator_pb2.ToolCall:
    """A ToolCall, or OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
    (arguments JSON text or a dict)."""
    if isinstance(c, ToolCall):
        return coordinator_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
            not isinstance(fn.get("arguments", ""), (str, Mapping)):
        raise TypeError(f"{name} must be a ToolCall or {{'id', 'type': 'function', 'function': "
                        f"{{'name', 'arguments'}}}}, got {c!r}")
    args = fn.get("arguments", "")
    args = json.dumps(args, ensure_ascii=False) if isinstance(args, Mapping) else args
    return coordinator_pb2.ToolCall(id=str(c.get("id") or ""), name=fn["name"], arguments=args or "{}")


def _check_request_id(request_id) -> None:
    """A request_id gRPC metadata can carry (printable ASCII), else TypeError/ValueError before
    anything is sent (gRPC itself would fail the call with INTERNAL "Invalid metadata")."""
    if request_id is None:
        return
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if len(request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID} characters (the server logs "
                         f"it with the request), got {len(request_id)}")
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"request_id must be printable ASCII (it is sent as gRPC metadata), "
                         f"got {request_id!r} (character {bad!r})")


def _fill(req, prompt, messages, token_ids, sampling: dict) -> None:
    """Set the prompt and sampling fields of a CompleteRequest or GenerateRequest."""
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    unknown = sorted(set(sampling) - set(_SAMPLING))
    if unknown:
        raise TypeError(f"unknown argument(s): {', '.join(unknown)}")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        req.text = _unicode(prompt, "prompt")
    elif messages is not None:
        req.messages.extend(_messages(messages))
        if not req.messages:
            raise ValueError("messages is empty: at least one message is required")
    else:
        req.token_ids.extend(_int_list(token_ids, "token_ids"))
        if not req.token_ids:
            raise ValueError("token_ids is empty: at least one token id is required")
    stop = sampling.get("stop")
    names = ["stop"] if isinstance(stop, str) else None
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, Sequence) or \
            not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a string or a list of strings")
    names = names or [f"stop[{i}]" for i in range(len(stop))]
    for name, s in zip(names, stop):
        if not s:   # the server refuses it too: an empty string would stop before any output
            raise ValueError(f"{name} is an empty string: a stop string needs at least one "
                             f"character")
    req.stop.extend(_unicode(s, name) for name, s in zip(names, stop))
    spec = sampling.get("spec")
    if not (spec is None or isinstance(spec, bool)):   # 1 == True: a dict lookup would take it
        raise ValueError(f"spec must be True, False or None, got {spec!r}")
    if spec not in _SPEC_MODES:
        raise ValueError(f"spec must be True, False or None, got {spec!r}")
    req.spec = _SPEC_MODES[spec]
    thinking = sampling.get("enable_thinking")
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise TypeError(f"enable_thinking must be True, False or None, got {thinking!r}")
        if messages is None:
            raise ValueError("enable_thinking applies to messages (the chat template), not to a raw prompt")
        req.enable_thinking = thinking
    for name, lo, hi in (("max_tokens", INT32_MIN, INT32_MAX), ("top_k", INT32_MIN, INT32_MAX),
                         ("k", INT32_MIN, INT32_MAX), ("seed", 0, UINT64_MAX),
                         ("repeat_last_n", INT32_MIN, INT32_MAX)):
        v = sampling.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        setattr(req, name, int(v))
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repeat_penalty"):
        v = sampling.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")
        try:
            f = float(v)
        except OverflowError:   # an int too large for a float
            f = None
        if f is None or (math.isfinite(f) and abs(f) > FLOAT32_MAX):
            # the field is a float32: protobuf would store inf without a word
            raise ValueError(f"{name} must be within float32's range (about ±3.4e38), got {v}")
        setattr(req, name, f)
    for name in ("prediction", "draft_namespace"):
        v = sampling.get(name)
        v = "" if v is None else v
        if not isinstance(v, str):   # 0, [] or False too: they are not "none"
            raise TypeError(f"{name} must be a str, got {type(v).__name__}")
        setattr(req, name, _unicode(v, name))
    _grammar(req, sampling.get("grammar"))
    _tools(req, sampling.get("tools"), sampling.get("tool_choice"))
    _logprobs(req, sampling.get("logprobs"), sampling.get("top_logprobs"))
    nodes = sampling.get("tree_nodes")
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral):
            raise TypeError(f"tree_nodes must be an int, got {nodes!r}")
        if not -1 <= nodes <= MAX_TREE_DRAFT_NODES:
            raise ValueError(f"tree_nodes must be in [-1, {MAX_TREE_DRAFT_NODES}] (0: the verifier's "
                             f"--tree-nodes, -1: chains), got {nodes}")
        req.tree_nodes = int(nodes)


def _tools(req, tools, choice) -> None:
    """``tools``: OpenAI's list of function tools (or its JSON text); ``tool_choice``: None,
    "auto", "none", "required", a function's name or {"type": "function", "function": {"name"}}.
    The server checks both."""
    if tools is not None:
        if not isinstance(tools, str):
            if isinstance(tools, Mapping) or not isinstance(tools, Sequence):
                raise TypeError(f"tools must be a list of tool dicts or its JSON text, got {type(tools).__name__}")
            tools = json.dumps(list(tools), ensure_ascii=False) if tools else ""
        req.tools = _unicode(tools, "tools")
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name")
        if not isinstance(choice, str):
            raise TypeError("tool_choice as a dict must be {'type': 'function', 'function': {'name': str}}")
    if choice is not None:
        if not isinstance(choice, str):
            raise TypeError(f"tool_choice must be a str or a dict, got {type(choice).__name__}")
        req.tool_choice = _unicode(choice, "tool_choice")


def _logprobs(req, on, n) -> None:
    """logprobs (None or a bool) and top_logprobs (None or 0..MAX_TOP_LOGPROBS, > 0 only with
    logprobs=True)."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"logprobs must be True, False or None, got {on!r}")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"top_logprobs must be an int, got {n!r}")
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
        if n and not on:
            raise ValueError(f"top_logprobs ({n}) needs logprobs=True")
        req.top_logprobs = int(n)
    req.logprobs = bool(on)


def _grammar(req, g) -> None:
    """The ``grammar`` argument: None (free text) or a dict of one key, as the proto's oneof:
    {"json_schema": a schema (dict, or its JSON text)}, {"json_object": True}, {"lark": text}
    or {"gbnf": text}. The server checks the grammar itself."""
    if g is None:
        return
    if not isinstance(g, Mapping) or len(g) != 1 or next(iter(g)) not in _GRAMMAR_KINDS:
        raise ValueError(f"grammar must be a dict of one key, one of {', '.join(_GRAMMAR_KINDS)}, "
                         f"got {g!r}")
    (kind, v), = g.items()
    if kind == "json_object":
        if v is not True:
            raise ValueError(f"grammar json_object must be True, got {v!r}")
        req.grammar.json_object = True
        return
    if kind == "json_schema" and isinstance(v, Mapping):
        v = json.dumps(v, ensure_ascii=False)
    if not isinstance(v, str):
        raise TypeError(f"grammar {kind} must be a str" + (" or a dict" if kind == "json_schema" else "")
                        + f", got {type(v).__name__}")
    setattr(req.grammar, kind, _unicode(v, f"grammar {kind}"))
