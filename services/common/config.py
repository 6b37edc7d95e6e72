"""Service configuration: dataclasses read from the environment, with CLI overrides.

Each field ``name`` of a config dataclass is read from the environment
variable ``ECHOSPEC_<NAME>`` (upper case) and can be overridden on the command
line with ``--<name-with-dashes>``. Precedence: CLI > environment > default.
Configs are passed to constructors; no module holds a global config.

Ports: coordinator 50051, draft 50052, verifier 50053 by default, all bound to
127.0.0.1 (loopback) unless ``host`` says otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TypeVar

from echospec_client.limits import GRPC_URI_SCHEMES

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
LOOPBACK = "127.0.0.1"

T = TypeVar("T")


@dataclass
class DraftConfig:
    """Draft service settings (the proposer's shortest match, the shared memory's bounds)."""

    host: str = LOOPBACK
    port: int = 50052
    min_n: int = 2               # shortest suffix match the suffix index drafts from
    max_n: int = 5               # checked (min_n <= max_n); the suffix index's matches are unbounded
    shared_max_tokens: int = 16384   # draft_namespace memory: tokens kept per namespace (~0.4 KB each)
    shared_max_namespaces: int = 16  # namespaces kept (least recently used evicted)
    max_workers: int = 64
    max_concurrent_rpcs: int = 56  # service RPCs at once (< max_workers; more: RESOURCE_EXHAUSTED)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 2.0
    metrics_port: int = -1       # Prometheus /metrics on host:metrics_port (-1: off, 0: a free port)
    log_level: str = "INFO"      # DEBUG, INFO, WARNING, ERROR
    log_format: str = "text"     # text or json (one object per line)
    tls_cert: str = ""           # PEM certificate chain this server presents ("": plain text)
    tls_key: str = ""            # PEM private key of tls_cert
    tls_client_ca: str = ""      # PEM CA: clients must present a certificate it signed (mTLS)
    tls_ca: str = ""             # PEM CA of the services this one calls ("": plain text to them)


@dataclass
class VerifierConfig:
    """Verifier service settings (the target model on the C engine)."""

    model: str = ""
    host: str = LOOPBACK
    port: int = 50053
    n_ctx: int = 2048            # KV capacity per session (tokens)
    n_threads: int = 0           # engine threads of a one-session forward (0: the usable CPUs less one)
    max_k: int = 32              # largest draft a Verify accepts
    max_sessions: int = 64       # sessions holding a KV cache at once
    session_idle_s: float = 300.0  # unary sessions are freed after this idle time
    draft_target: str = ""       # draft service host:port for speculative generations ("": none)
    batch_max: int = 1           # sessions per scheduler iteration (>= 2: speculation is refused)
    batch_tokens: int = 512      # tokens per scheduler iteration
    prefill_chunk: int = 256     # prompt tokens per prefill step (chunked prefill)
    decode_steps: int = 8        # greedy steps per engine call of each decoding generation
    prefix_cache: bool = True    # keep finished generations' KV for prefix reuse
    prefix_cache_sessions: int = 4  # idle sessions (one KV cache each) the prefix cache keeps
    # engine threads of a scheduler iteration that batches >= 2 sessions or feeds one a
    # prefill chunk of >= 16 tokens (0: the CPUs this process may use when n_threads is 0,
    # else n_threads)
    batch_threads: int = 0
    max_workers: int = 96
    max_concurrent_rpcs: int = 88  # service RPCs at once (< max_workers; more: RESOURCE_EXHAUSTED)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 2.0
    metrics_port: int = -1       # Prometheus /metrics on host:metrics_port (-1: off, 0: a free port)
    log_level: str = "INFO"
    log_format: str = "text"
    tls_cert: str = ""           # PEM certificate chain this server presents ("": plain text)
    tls_key: str = ""            # PEM private key of tls_cert
    tls_client_ca: str = ""      # PEM CA: clients must present a certificate it signed (mTLS)
    tls_ca: str = ""             # PEM CA of the services this one calls ("": plain text to them)


@dataclass
class CoordinatorConfig:
    """Coordinator (public API) settings."""

    model: str = ""              # GGUF path: tokenizer and chat template
    host: str = LOOPBACK
    port: int = 50051
    verifier_target: str = f"{LOOPBACK}:50053"   # the one verifier when `verifier` is empty
    # Verifiers to balance generations over (repeatable --verifier, env comma-separated):
    # host:port, or dns:///name:port for every address the name resolves to (a headless
    # Service), re-resolved every verifier_resolve_s. Empty: verifier_target alone.
    verifier: tuple = ()
    verifier_poll_s: float = 1.0      # health + load poll of each verifier (seconds)
    verifier_resolve_s: float = 10.0  # DNS re-resolution of dns:/// verifiers (seconds)
    # The draft service its verifiers use, as GetInfo reports it ("": not said). The coordinator
    # itself never calls it: each verifier asks the one of its own --draft-target.
    draft_target: str = ""
    spec: bool = False           # speculation default when a request leaves it unspecified
    k: int = 4                   # default drafts per round (the most a round drafts)
    adaptive_k: bool = True      # the live cost model picks each round's draft length <= k
    metrics_port: int = -1       # Prometheus /metrics on host:metrics_port (-1: off, 0: a free port)
    k_max: int = 32              # largest k a request may ask for (<= the verifier's max_k)
    max_tokens: int = 256        # default max_tokens
    max_tokens_limit: int = 8192
    max_stop: int = 16           # stop strings per request
    max_workers: int = 64
    max_concurrent_rpcs: int = 56  # service RPCs at once (< max_workers; more: RESOURCE_EXHAUSTED)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 2.0
    log_level: str = "INFO"
    log_format: str = "text"
    tls_cert: str = ""           # PEM certificate chain this server presents ("": plain text)
    tls_key: str = ""            # PEM private key of tls_cert
    tls_client_ca: str = ""      # PEM CA: clients must present a certificate it signed (mTLS)
    tls_ca: str = ""             # PEM CA of the services this one calls ("": plain text to them)
    api_key: str = ""            # clients send `authorization: Bearer <api_key>` ("": no check)


@dataclass
class GatewayConfig:
    """OpenAI-compatible HTTP gateway settings (services/gateway)."""

    host: str = LOOPBACK
    port: int = 8000
    coordinator_target: str = f"{LOOPBACK}:50051"
    model_name: str = ""         # model id in /v1/models and responses ("": the GGUF file's stem)
    request_timeout_s: float = 600.0  # gRPC deadline of a generation (exceeded: HTTP 504)
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger request bodies: HTTP 413
    log_level: str = "INFO"
    log_format: str = "text"
    tls_cert: str = ""           # PEM certificate chain of the HTTPS listener ("": plain HTTP)
    tls_key: str = ""            # PEM private key of tls_cert
    tls_client_ca: str = ""      # PEM CA: HTTP clients must present a certificate it signed
    tls_ca: str = ""             # PEM CA of the coordinator's certificate ("": plain text to it)
    api_key: str = ""            # HTTP clients send `Authorization: Bearer <api_key>`; it is also
                                 # sent on to the coordinator ("": no check)
    grace_s: float = 2.0         # on shutdown: seconds requests in flight get to finish


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    # empty too: an unset value in a compose or env file must not quietly mean off
    raise ValueError(f"not a boolean (on/off, true/false, yes/no, 1/0): {text!r}")


def _convert(kind: type, text: str):
    if kind is bool:
        return _parse_bool(text)
    if kind is tuple:   # a list: comma-separated in the environment ("": none)
        items = tuple(part.strip() for part in text.split(",") if part.strip())
        if text.strip() and not items:
            raise ValueError("a comma-separated list with no item in it")
        return items
    return kind(text)


def from_env(cls: type[T], environ: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from ECHOSPEC_<FIELD> variables (defaults for the rest).

    Raises:
        ValueError: a variable does not parse as its field's type (names it).
    """
    env = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(cls):
        key = f"ECHOSPEC_{f.name.upper()}"
        if key in env:
            kind = type(f.default)
            try:
                values[f.name] = _convert(kind, env[key])
            except ValueError as exc:
                if kind is int and f.name in _INT_RANGES:   # what it takes, not int()'s words
                    raise ValueError(f"{key}={env[key]!r}: {_int_range_text(f.name)}") from None
                raise ValueError(f"{key}={env[key]!r}: {exc}") from None
    return cls(**values)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--field-name`` option per field of ``cls`` (default: None = keep)."""
    for f in dataclasses.fields(cls):
        opt = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(opt, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=f"(env ECHOSPEC_{f.name.upper()}: on/off, true/false, yes/no, "
                                     f"1/0; default {'on' if f.default else 'off'})")
        elif kind is tuple:
            parser.add_argument(opt, dest=f.name, default=None, action="append",
                                help=f"repeatable (env ECHOSPEC_{f.name.upper()}, comma-separated)")
        else:
            parser.add_argument(opt, dest=f.name, default=None, type=kind,
                                help=f"(env ECHOSPEC_{f.name.upper()}, default {f.default!r})")


def load(cls: type[T], argv: Sequence[str] | None = None,
         environ: Mapping[str, str] | None = None, prog: str | None = None) -> T:
    """Environment, then command-line overrides. Exits with usage on bad CLI input."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    try:
        cfg = from_env(cls, environ)
    except ValueError as exc:
        parser.error(str(exc))
    overrides = {k: (tuple(v) if isinstance(v, list) else v)
                 for k, v in vars(ns).items() if v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    try:
        check_ranges(cfg)
        if hasattr(cfg, "tls_cert"):   # unusable TLS files fail here, before a model loads
            from echospec.services.rpc.grpc_util import Tls
            Tls.of(cfg).validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def _int_range_text(name: str) -> str:
    """'<what> must be a whole number in [lo, hi]' for an _INT_RANGES field (a bound that is
    another field is named as its option)."""
    lo, hi, what = _INT_RANGES[name]
    if isinstance(hi, str):
        hi = f"--{hi.replace('_', '-')}"
    elif isinstance(hi, tuple):
        hi = f"--{hi[0].replace('_', '-')} {hi[1]:+d}"
    return f"{what} must be a whole number in [{lo}, {hi}]"


def setting_name(field: str) -> str:
    """A service setting as its users spell it: "--tls-cert / ECHOSPEC_TLS_CERT"."""
    return f"--{field.replace('_', '-')} / ECHOSPEC_{field.upper()}"


def check_ranges(cfg) -> None:
    """Refuse ports, durations, API keys and integer settings no service can use (gRPC would take
    port 99999 as 34463, a negative deadline fails every call, a non-ASCII key cannot be sent, a
    body limit of 0 bytes refuses every request).

    Raises:
        ValueError: naming the first bad field, as option and environment variable.
    """
    from echospec.services.common.auth import check_api_key

    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        name = setting_name(f.name)
        if f.name == "api_key":
            try:
                check_api_key(v)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        elif f.name == "port" or f.name.endswith("_port"):
            lo = -1 if f.name == "metrics_port" else 0
            if not lo <= v <= 65535:
                raise ValueError(f"{name} {v}: a port is in [{lo}, 65535]"
                                 + (" (-1: off, 0: a free port)" if lo < 0 else " (0: a free port)"))
        elif f.name in ("log_level", "log_format"):
            from echospec.services.common import logs
            choices = logs.LEVELS if f.name == "log_level" else logs.FORMATS
            if not isinstance(v, str) or v.upper() not in (c.upper() for c in choices):
                raise ValueError(f"{name} {v!r}: one of {', '.join(choices)} (any case)")
        elif f.name == "host" and not v.strip():
            raise ValueError(f"{name} is empty: the address to listen on (127.0.0.1: this machine "
                             f"only, 0.0.0.0: every interface)")
        elif f.name.endswith("_target") or f.name == "verifier":
            if f.name == "coordinator_target" and not v.strip():
                raise ValueError(f"{name} is empty: the coordinator's host:port")
            if f.name == "verifier_target" and not v.strip() and not getattr(cfg, "verifier", ()):
                raise ValueError(f"{name} is empty (and --verifier names none): the verifier's "
                                 f"host:port")
            for t in (v,) if isinstance(v, str) else v:
                bad = target_port_error(t)
                if bad:
                    raise ValueError(f"{name} {t!r}: {bad}")
        elif f.name.endswith("_s") and isinstance(v, float):
            ok = math.isfinite(v) and (v >= 0 if f.name == "grace_s" else v > 0)
            if not ok:
                raise ValueError(f"{name} {v}: seconds must be a finite number "
                                 + (">= 0" if f.name == "grace_s" else "> 0"))
    # fixed bounds first, then the bounds that are other fields (checked by then)
    ints = [f.name for f in dataclasses.fields(cfg) if f.name in _INT_RANGES]
    for n in sorted(ints, key=lambda n: not isinstance(_INT_RANGES[n][1], int)):
        lo, hi, what = _INT_RANGES[n]
        if isinstance(hi, str):
            hi = getattr(cfg, hi)
        elif isinstance(hi, tuple):
            hi = getattr(cfg, hi[0]) + hi[1]
        v = getattr(cfg, n)
        if not lo <= v <= hi:
            raise ValueError(f"{setting_name(n)} {v}: {what} "
                             f"must be in [{lo}, {hi}]")


# Integer settings a service cannot run with (the service then started and failed every request,
# or stopped later with a message that did not name the setting): name -> (lowest, highest, what).
# A highest bound that is a field name (or (field, offset)) is that field's value, checked after
# the fixed bounds (k_max before k, max_tokens_limit before max_tokens).
_BIG = 2 ** 31 - 1
_INT_RANGES: dict[str, tuple] = {
    "max_message_bytes": (1, _BIG, "bytes per gRPC message"),
    "max_body_bytes": (1, _BIG, "bytes per HTTP request body"),
    "max_workers": (2, 4096, "worker threads"),
    "max_concurrent_rpcs": (1, ("max_workers", -1), "RPCs at once (below max_workers)"),
    "shared_max_tokens": (1, _BIG, "tokens per namespace"),
    "shared_max_namespaces": (1, _BIG, "namespaces"),
    "n_ctx": (8, 1 << 20, "the KV capacity (tokens)"),
    "n_threads": (0, 256, "engine threads (0: the usable CPUs less one)"),
    "batch_threads": (0, 256, "engine threads of a batch (0: default)"),
    "max_k": (1, _BIG, "drafts a verify accepts"),
    "max_sessions": (1, _BIG, "sessions"),
    "batch_max": (1, 256, "sessions per iteration"),
    "batch_tokens": (1, _BIG, "tokens per iteration"),
    "prefill_chunk": (1, _BIG, "prompt tokens per prefill step"),
    "decode_steps": (1, 1024, "greedy steps per engine call"),
    "prefix_cache_sessions": (0, _BIG, "idle sessions kept (0: none)"),
    "k_max": (1, _BIG, "the largest k a request may ask for"),
    "max_tokens_limit": (1, _BIG, "the largest max_tokens a request may ask for"),
    "k": (1, "k_max", "drafts per round"),
    "max_tokens": (1, "max_tokens_limit", "the default max_tokens"),
    "max_stop": (0, _BIG, "stop strings per request"),
}


def target_port_error(target: str) -> str:
    """Why a host:port target names a port no server can listen on, or holds what no host has
    (whitespace); "" when it does not: also for "", gRPC URIs such as dns:///name:port, a bare
    IPv6 address and a host without a port.
    gRPC would otherwise dial it until every call's deadline and report nothing reachable."""
    if not target or "://" in target or target.startswith(GRPC_URI_SCHEMES):
        return ""
    if any(c.isspace() or not c.isprintable() for c in target):
        return "it holds a space or a control character, which no host name or address has"
    if target.startswith("["):
        end = target.find("]")
        if end < 0 or not target[end + 1:].startswith(":"):
            return ""
        port = target[end + 2:]
    else:
        host, sep, port = target.rpartition(":")
        if not sep or ":" in host:
            return ""
    if port.isascii() and port.isdigit() and 1 <= int(port) <= 65535:
        return ""
    return f"the port {port!r} is not a number in [1, 65535] (the target is host:port)"


def model_name(path: str) -> str:
    """The name a service reports for its model: the GGUF file name without its directories
    ("SmolLM2-135M-Instruct.Q4_1.gguf"). The full path stays in the server's own logs: a
    client has no use for the server's file layout and should not learn it."""
    return os.path.basename(str(path).rstrip("/\\")) or str(path)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count() where that is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_engine_threads() -> int:
    """Engine threads when none are set: the CPUs this process may run on, less one (at least 1).

    The verifier's own Python (the generation loops, gRPC) needs a core while the engine
    computes; on a 2-core host a 2-thread engine beside it decoded slower than a 1-thread one
    (bench/README.md, serving figures)."""
    return max(1, usable_cpus() - 1)
