"""Service configuration: dataclasses read from the environment, with CLI overrides.

Each field ``name`` of a config dataclass is read from the environment
variable ``ECHOSPEC_<NAME>`` (upper case) and can be overridden on the command
line with ``--<name-with-dashes>``. Precedence: CLI > environment > default.
Configs are passed to constructors; no module holds a global config.

The fields are the one source of each setting: its default, help text, range or choices, option,
variable and, where `echospec serve` offers it, its option there (``setting``). The services'
parsers (``add_arguments``) and `echospec serve`'s are built from them.

Ports: coordinator 50051, draft 50052, verifier 50053 by default, all bound to
127.0.0.1 (loopback) unless ``host`` says otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence, TypeVar

from echospec_client.limits import GRPC_URI_SCHEMES, MAX_TREE_DRAFT_NODES
from echospec.services.common.logs import FORMATS, LEVELS

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
LOOPBACK = "127.0.0.1"

T = TypeVar("T")


_BIG = 2 ** 31 - 1
# the KV cache types the engine offers (es_kv_type): f16 (the default) and q8_0
KV_TYPES = ("f16", "q8_0")


class EngineLimit:
    """A bound from the engine's header (echospec_engine.h), read through cffi when first used,
    so the services that never load the engine (coordinator, gateway) do not load it for this."""

    def __init__(self, name: str):
        self.name = name

    def __int__(self) -> int:
        from echospec._engine import lib
        return int(getattr(lib, self.name))

    def __str__(self) -> str:
        return str(int(self))

    __repr__ = __str__


def setting(default, help: str, *, range: tuple | None = None, choices: Sequence[str] = (),
            serve: str = "", serve_help: str = "", negated: bool = False) -> Any:
    """A config field and what is said of it once: its help text, its range or choices, and its
    option in `echospec serve` (the field's own --option and ECHOSPEC_ variable are added to the
    metadata by ``setting_fields``).

    Args:
        default: the default (the only place it is written).
        help: what the setting does, for every parser built from it.
        range: (lowest, highest, what) of an integer setting; a bound is an int, an EngineLimit,
            another field's name, or (field, offset).
        choices: the values a string setting takes (any case).
        serve: its option in `echospec serve` ("": not offered there).
        serve_help: the help of the serve option when it says something else than ``help``
            (a negated flag, a note on the stack).
        negated: the serve option is a flag that sets the field False (--fixed-k, --no-prefix-cache).
    """
    meta = {"help": help, "range": range, "choices": tuple(choices), "serve": serve,
            "serve_help": serve_help or help, "negated": negated}
    return field(default=default, metadata=meta)


def setting_fields(cls: type[T]) -> type[T]:
    """Add each field's --option ("flag") and environment variable ("env") to its metadata."""
    for f in dataclasses.fields(cls):
        f.metadata = MappingProxyType({**f.metadata, "flag": "--" + f.name.replace("_", "-"),
                                       "env": f"ECHOSPEC_{f.name.upper()}"})
    return cls


# the longest duration setting (about 11.6 days): a thread's timed wait of 1e10 s overflows time_t
MAX_SECONDS = 1e6

_PORT = "(0: a free port)"
_METRICS = "Prometheus /metrics on metrics_host:metrics_port (-1: off, 0: a free port)"
_METRICS_HOST = ("address /metrics listens on; it answers without the API key, so loopback by "
                 "default (0.0.0.0: every interface, for a scraper on another host)")
_LOG_LEVEL = "log level; INFO logs one line per request"
_LOG_FORMAT = "log format; json: one JSON object per line"
_TLS_CERT = "PEM certificate chain this server presents (\"\": plain text)"
_TLS_KEY = "PEM private key of tls_cert"
_TLS_CLIENT_CA = "PEM CA: clients must present a certificate it signed (mTLS)"
_TLS_CA = "PEM CA of the services this one calls (\"\": plain text to them)"
_WORKERS = (2, 4096, "worker threads")
_CONCURRENT = (1, ("max_workers", -1), "RPCs at once (below max_workers)")
_CONCURRENT_HELP = "service RPCs at once (< max_workers; more: RESOURCE_EXHAUSTED)"
_MESSAGE = (1, _BIG, "bytes per gRPC message")
_GRACE = "on shutdown: seconds requests in flight get to finish"
_API_KEYS_FILE = ("JSON file {\"<api key>\": \"<tenant>\", ...}: clients may send any of these "
                  "keys too, and a draft_namespace is scoped to the key's tenant (\"\": none)")
_INTERNAL_KEY = ("shared secret of the services: the verifier and the draft service refuse calls "
                 "without it (UNAUTHENTICATED), the coordinator and the verifier send it "
                 "(\"\": no check, none sent)")


@dataclass
class _GrpcServiceConfig:
    """The settings every gRPC service has (the draft service, the verifier, the coordinator);
    a subclass redefines one where it says more (its `echospec serve` option)."""

    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message (bytes)",
                                     range=_MESSAGE)
    grace_s: float = setting(2.0, _GRACE)
    metrics_port: int = setting(-1, _METRICS)
    metrics_host: str = setting(LOOPBACK, _METRICS_HOST)
    log_level: str = setting("INFO", _LOG_LEVEL, choices=LEVELS)
    log_format: str = setting("text", _LOG_FORMAT, choices=FORMATS)
    tls_cert: str = setting("", _TLS_CERT)
    tls_key: str = setting("", _TLS_KEY)
    tls_client_ca: str = setting("", _TLS_CLIENT_CA)
    tls_ca: str = setting("", _TLS_CA)
    internal_key: str = setting("", _INTERNAL_KEY)


@setting_fields
@dataclass
class DraftConfig(_GrpcServiceConfig):
    """Draft service settings (the proposer's shortest match, the shared memory's bounds)."""

    host: str = setting(LOOPBACK, "address to listen on")
    port: int = setting(50052, f"draft service port {_PORT}")
    min_n: int = setting(2, "shortest suffix match the suffix index drafts from")
    max_n: int = setting(5, "checked (min_n <= max_n); the suffix index's matches are unbounded")
    shared_max_tokens: int = setting(16384, "draft_namespace memory: tokens kept per namespace "
                                     "(~0.4 KB each)", range=(1, _BIG, "tokens per namespace"))
    shared_max_namespaces: int = setting(16, "namespaces kept (least recently used evicted)",
                                         range=(1, _BIG, "namespaces"))
    max_history: int = setting(1 << 17, "a draft session's history, prompt + output + prediction, in "
                               "tokens (~0.5 KB each): a stream that would pass it ends with "
                               "RESOURCE_EXHAUSTED (the verifier then decodes plainly); at least "
                               "the verifier's n_ctx", range=(1, EngineLimit("ES_MAX_CTX"), "tokens"))
    # a verifier's every session may hold a draft stream (max_sessions 64): as the verifier's
    max_workers: int = setting(96, "gRPC worker threads", range=_WORKERS)
    max_concurrent_rpcs: int = setting(88, _CONCURRENT_HELP, range=_CONCURRENT)


@setting_fields
@dataclass
class VerifierConfig(_GrpcServiceConfig):
    """Verifier service settings (the target model on the C engine)."""

    model: str = setting("", "GGUF file of the target model")
    mmproj: str = setting("", "projector GGUF (mmproj, llama.cpp's converter's --mmproj output) of "
                          "a Qwen3-VL model: its vision encoder, checked against the model at "
                          "load (\"\": the model reads text only)", serve="--mmproj")
    host: str = setting(LOOPBACK, "address to listen on")
    port: int = setting(50053, f"verifier port {_PORT}")
    n_ctx: int = setting(2048, "KV capacity per session (tokens)", serve="--n-ctx",
                         range=(EngineLimit("ES_MIN_CTX"), EngineLimit("ES_MAX_CTX"),
                                "the KV capacity (tokens)"))
    n_threads: int = setting(0, "engine threads of a one-session forward (0: the usable CPUs less "
                             "one)", serve="--threads",
                             range=(0, EngineLimit("ES_MAX_THREADS"),
                                    "engine threads (0: the usable CPUs less one)"))
    max_k: int = setting(32, "largest draft a Verify accepts", range=(1, _BIG, "drafts a verify accepts"))
    max_sessions: int = setting(64, "sessions holding a KV cache at once", range=(1, _BIG, "sessions"))
    session_idle_s: float = setting(300.0, "unary sessions are freed after this idle time (seconds)")
    draft_target: str = setting("", "draft service host:port for speculative generations (\"\": none)")
    batch_max: int = setting(1, "sessions the scheduler serves per iteration (>= 2 refuses "
                             "speculation)", serve="--batch-max",
                             range=(1, 256, "sessions per iteration"))
    batch_tokens: int = setting(512, "tokens per scheduler iteration", range=(1, _BIG, "tokens per iteration"))
    prefill_chunk: int = setting(256, "prompt tokens per prefill step (chunked prefill): a long "
                                 "prompt never stalls others for longer", serve="--prefill-chunk",
                                 range=(1, _BIG, "prompt tokens per prefill step"))
    decode_steps: int = setting(8, "greedy steps the engine runs per call for each decoding "
                                "generation when nothing else waits (1: one call per token); "
                                "anything else that arrives ends a run after its current step",
                                serve="--decode-steps",
                                range=(1, 1024, "greedy steps per engine call"))
    tree_nodes: int = setting(0, "token-tree speculation: draft nodes a round verifies in one "
                              "forward, the chain's and other continuations' (0: chains only); a "
                              "request's tree_nodes overrides it; chains still with KV eviction, "
                              "sparse attention, a Q8_0 KV cache, a sliding-window model, a "
                              "grammar, penalties or logprobs", serve="--tree-nodes",
                              range=(0, MAX_TREE_DRAFT_NODES, "draft nodes per tree round"))
    check_weights: bool = setting(False, "the full weights check at load: decode every value of every "
                                  "quantized tensor and refuse a NaN or infinity, naming the tensor "
                                  "(every block scale and float value is always checked)",
                                  serve="--check-weights")
    grammar_warm_up: bool = setting(False, "build the grammar matcher's tokenizer from the model's "
                                    "vocabulary at startup, before SERVING (SmolLM2: about 2 s, "
                                    "Gemma 3: about 12 s on 2 cores); off: on the first constrained "
                                    "request, whose build holds Python's GIL and so stalls the "
                                    "verifier's other calls meanwhile (SmolLM2: about 1 s)",
                                    serve="--grammar-warm-up")
    verify_runs: bool = setting(True, "a speculative generation's rounds drafted from a proposal "
                                "longer than the round run in the engine while every draft is kept "
                                "(es_verify_run): no Python between them (off: one engine call per "
                                "round)", serve="--no-verify-runs", negated=True,
                                serve_help="one engine call per speculative round (no verify runs "
                                           "in the engine)")
    draft_prior: str = setting("auto", "the draft prior (services/draft/prior.py): a table of the "
                               "model's own earlier outputs from which a speculative greedy round "
                               "with no other draft drafts one token; a .npz file built by `echospec "
                               "prior`, \"auto\" (the one `echospec prior` cached for this model "
                               "file, none if it has not been built) or \"off\"",
                               serve="--draft-prior")
    prefix_cache: bool = setting(True, "keep finished generations' KV for prefix reuse",
                                 serve="--no-prefix-cache", negated=True,
                                 serve_help="do not keep finished generations' KV for reuse by "
                                            "prompts sharing a prefix")
    kv_sinks: int = setting(-1, "KV eviction: the first positions every query keeps attending "
                            "(attention sinks; -1: not set; needs kv_window)", serve="--kv-sinks",
                            range=(-1, EngineLimit("ES_MAX_CTX"), "attention sinks (positions)"))
    kv_window: int = setting(0, "KV eviction: the most recent positions every query attends, with "
                             "kv_sinks (0: no eviction); each session then keeps the sinks plus "
                             "the window plus a slack whatever the generation's length, a "
                             "generation runs past n_ctx, and speculation is refused",
                             serve="--kv-window",
                             range=(0, EngineLimit("ES_MAX_CTX"), "the KV window (positions)"))
    sparse_attention: int = setting(0, "sparse attention: each decode step attends, per layer and KV "
                                    "head, the first KV block (64 positions), the two most recent "
                                    "ones and the TOPK other blocks of the largest key bound "
                                    "(0: full attention); only once the context has more than "
                                    "TOPK + 3 blocks; prefill stays full; speculation is refused",
                                    serve="--sparse-attention",
                                    range=(0, EngineLimit("ES_MAX_SPARSE_TOPK"), "blocks a step chooses (TOPK)"))
    kv_type: str = setting("f16", "KV cache element type: f16, or q8_0 (ggml's Q8_0: 34 bytes per "
                           "32 values, 0.53 of f16's memory, at a small quality cost measured "
                           "in README.md, \"KV cache type\"); speculation stays exact with either",
                           choices=KV_TYPES, serve="--kv-type")
    prefix_cache_sessions: int = setting(4, "idle sessions (one KV cache each) the prefix cache "
                                         "keeps", range=(0, _BIG, "idle sessions kept (0: none)"))
    batch_threads: int = setting(0, "engine threads of a scheduler iteration that batches >= 2 "
                                 "sessions or feeds one a prefill chunk of >= 16 tokens (0: the "
                                 "CPUs this process may use when n_threads is 0, else n_threads)",
                                 range=(0, EngineLimit("ES_MAX_THREADS"),
                                        "engine threads of a batch (0: default)"))
    max_workers: int = setting(96, "gRPC worker threads", range=_WORKERS)
    max_concurrent_rpcs: int = setting(88, _CONCURRENT_HELP, range=_CONCURRENT)
    tls_client_ca: str = setting("", _TLS_CLIENT_CA, serve="--tls-client-ca",
                                 serve_help="PEM CA: the internal ports (verifier, draft) demand "
                                            "client certificates it signed (mTLS)")


@setting_fields
@dataclass
class CoordinatorConfig(_GrpcServiceConfig):
    """Coordinator (public API) settings."""

    model: str = setting("", "GGUF file: tokenizer and chat template", serve="--model",
                         serve_help="GGUF file, or a model name fetched on first use: smollm2-135m "
                                    "(the default, SmolLM2-135M-Instruct Q4_1), gemma3-270m (Gemma 3 "
                                    "270M base Q4_K_M)")
    chat_template: str = setting("", "Jinja chat template file used instead of the GGUF's (\"\": the "
                                 "GGUF's)", serve="--chat-template",
                                 serve_help="Jinja chat template for chat messages, used instead of the "
                                            "model's own (needed for chat with a model that has none and "
                                            "is not ChatML)")
    host: str = setting(LOOPBACK, "address to listen on", serve="--host",
                        serve_help="bind address of every service (default loopback)")
    port: int = setting(50051, f"coordinator port {_PORT}", serve="--port")
    verifier_target: str = setting(f"{LOOPBACK}:50053", "the one verifier when `verifier` is empty")
    # host:port, or dns:///name:port for every address the name resolves to (a headless Service)
    verifier: tuple = setting((), "verifiers to balance generations over: host:port, or "
                              "dns:///name:port for every address the name resolves to, "
                              "re-resolved every verifier_resolve_s (none: verifier_target alone)")
    verifier_poll_s: float = setting(1.0, "health + load poll of each verifier (seconds)")
    verifier_resolve_s: float = setting(10.0, "DNS re-resolution of dns:/// verifiers (seconds)")
    prefix_route_slack: int = setting(2, "a prompt goes to the verifier predicted to hold the "
                                      "KV of its longest prefix unless that verifier has more "
                                      "than this many active sessions above the least-loaded "
                                      "one (-1: off, least loaded only)",
                                      range=(-1, _BIG, "active sessions above the least loaded"))
    max_moves: int = setting(2, "moves of one generation to another verifier when its verifier "
                             "fails or stalls after the first token (0: never; the generation "
                             "then fails with UNAVAILABLE)", range=(0, 64, "moves per generation"))
    stall_floor_s: float = setting(1.0, "the shortest progress deadline of a generation's next "
                                   "message (seconds; the deadline is 8x the verifier's own "
                                   "reported costs when longer; 0: no stall detection)")
    # The coordinator itself never calls it: each verifier asks the one of its own --draft-target.
    draft_target: str = setting("", "the draft service its verifiers use, as GetInfo reports it "
                                "(\"\": not said)")
    spec: bool = setting(False, "speculate by default for requests that leave it unspecified",
                         serve="--spec",
                         serve_help="speculate by default for requests that allow it")
    k: int = setting(16, "default drafts per round (the most a round drafts)", serve="--k",
                     range=(1, "k_max", "drafts per round"))
    adaptive_k: bool = setting(True, "the live cost model picks each round's draft length <= k",
                               serve="--fixed-k", negated=True,
                               serve_help="always draft k tokens (default: the live cost model "
                                          "picks each round's length)")
    metrics_port: int = setting(-1, _METRICS, serve="--metrics-port",
                                serve_help="serve Prometheus /metrics on this port (-1: off, 0: a "
                                           "free port); with --processes the verifier and draft "
                                           "serve theirs on free ports (all URLs are printed)")
    metrics_host: str = setting(LOOPBACK, _METRICS_HOST, serve="--metrics-host",
                                serve_help="address every service's /metrics listens on (default "
                                           "loopback, whatever --host says: /metrics answers "
                                           "without the API key)")
    k_max: int = setting(32, "largest k a request may ask for (<= the verifier's max_k)",
                         range=(1, _BIG, "the largest k a request may ask for"))
    max_tokens: int = setting(256, "max_tokens of a request that sets none", serve="--max-tokens",
                              range=(1, "max_tokens_limit", "the default max_tokens"))
    max_tokens_limit: int = setting(8192, "largest max_tokens a request may ask for",
                                    range=(1, _BIG, "the largest max_tokens a request may ask for"))
    max_stop: int = setting(16, "stop strings per request", range=(0, _BIG, "stop strings per request"))
    # image parts (services/text/images.py); the pixel budget is Qwen3-VL's processor's by default
    image_min_pixels: int = setting(256 * 256, "an image smaller than this many pixels is scaled "
                                    "up (both sides multiples of 32)", serve="--image-min-pixels",
                                    range=(1, "image_max_pixels", "pixels of a resized image"))
    image_max_pixels: int = setting(4096 * 4096, "an image larger than this many pixels is scaled "
                                    "down (both sides multiples of 32)", serve="--image-max-pixels",
                                    range=(32 * 32, 1 << 28, "pixels of a resized image"))
    image_max_bytes: int = setting(4 * 1024 * 1024, "largest encoded image part (bytes; more: "
                                   "INVALID_ARGUMENT)", range=(1, _BIG, "bytes per image"))
    image_max_decoded_pixels: int = setting(2 * 4096 * 4096, "largest decoded image, width x "
                                            "height from its header, checked before decoding (more: "
                                            "INVALID_ARGUMENT, a decompression bomb)",
                                            range=(1, 1 << 30, "decoded pixels per image"))
    max_workers: int = setting(64, "gRPC worker threads", range=_WORKERS)
    max_concurrent_rpcs: int = setting(56, _CONCURRENT_HELP, range=_CONCURRENT)
    log_level: str = setting("INFO", _LOG_LEVEL, choices=LEVELS, serve="--log-level")
    log_format: str = setting("text", _LOG_FORMAT, choices=FORMATS, serve="--log-format")
    tls_cert: str = setting("", _TLS_CERT, serve="--tls-cert",
                            serve_help="PEM certificate: every service listens with TLS (HTTPS)")
    tls_key: str = setting("", _TLS_KEY, serve="--tls-key", serve_help="PEM private key of --tls-cert")
    tls_ca: str = setting("", _TLS_CA, serve="--tls-ca",
                          serve_help="PEM CA that signed --tls-cert, for the services' calls to "
                                     "each other (default: --tls-cert itself, if self-signed)")
    api_key: str = setting("", "clients send `authorization: Bearer <api_key>` (\"\": no check)",
                           serve="--api-key",
                           serve_help="clients of the coordinator and the gateway must send "
                                      "`authorization: Bearer KEY` (none: no check)")
    api_keys_file: str = setting("", _API_KEYS_FILE, serve="--api-keys-file",
                                 serve_help="JSON file mapping API keys to tenants: the coordinator "
                                            "and the gateway take each key, and a draft_namespace "
                                            "is its tenant's own")
    internal_key: str = setting("", _INTERNAL_KEY, serve="--internal-key",
                                serve_help="the verifier and draft ports refuse calls that do "
                                           "not carry this key, which the services send each "
                                           "other (none: no check)")


@setting_fields
@dataclass
class GatewayConfig:
    """OpenAI-compatible HTTP gateway settings (services/gateway)."""

    host: str = setting(LOOPBACK, "address to listen on")
    port: int = setting(8000, f"HTTP port {_PORT}")
    coordinator_target: str = setting(f"{LOOPBACK}:50051", "the coordinator's host:port")
    model_name: str = setting("", "model id in /v1/models and responses (\"\": the GGUF file's stem)")
    allow_any_model: bool = setting(False, "take a request whose `model` names another model than "
                                    "the one served (off: HTTP 404 model_not_found)",
                                    serve="--http-allow-any-model")
    # named like the coordinator's max_tokens_limit: max_n (ECHOSPEC_MAX_N) is the n-gram length
    n_limit: int = setting(4, "largest `n` (choices per prompt) a request may ask for (more: HTTP "
                           "400); also the most generations one HTTP request runs at once",
                           serve="--http-n-limit", range=(1, 256, "choices per prompt"))
    request_timeout_s: float = setting(600.0, "gRPC deadline of a generation in seconds "
                                       "(exceeded: HTTP 504)")
    max_body_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, "larger request bodies: HTTP 413",
                                  range=(1, _BIG, "bytes per HTTP request body"))
    header_timeout_s: float = setting(10.0, "seconds a client gets to send a request's line and "
                                      "headers, from its connection or its previous response "
                                      "(late: HTTP 408, connection closed)",
                                      serve="--http-header-timeout-s")
    body_timeout_s: float = setting(60.0, "seconds a client gets to send a request's whole body "
                                    "after its headers (late: HTTP 408, connection closed)",
                                    serve="--http-body-timeout-s")
    max_connections: int = setting(1024, "HTTP connections open at once (one more: HTTP 503, "
                                   "closed)", serve="--http-max-connections",
                                   range=(1, _BIG, "HTTP connections at once"))
    log_level: str = setting("INFO", _LOG_LEVEL, choices=LEVELS)
    log_format: str = setting("text", _LOG_FORMAT, choices=FORMATS)
    tls_cert: str = setting("", "PEM certificate chain of the HTTPS listener (\"\": plain HTTP)")
    tls_key: str = setting("", _TLS_KEY)
    tls_client_ca: str = setting("", "PEM CA: HTTP clients must present a certificate it signed")
    tls_ca: str = setting("", "PEM CA of the coordinator's certificate (\"\": plain text to it)")
    api_key: str = setting("", "HTTP clients send `Authorization: Bearer <api_key>`; it is also "
                           "sent on to the coordinator (\"\": no check)")
    api_keys_file: str = setting("", "JSON file {\"<api key>\": \"<tenant>\", ...}: HTTP clients "
                                 "may send any of these keys too, and the gateway sends the "
                                 "client's own key on to the coordinator (\"\": none)")
    grace_s: float = setting(2.0, _GRACE)
    metrics_port: int = setting(-1, "the gateway's own Prometheus /metrics (its HTTP requests) on "
                                "metrics_host:metrics_port (-1: off, 0: a free port)")
    metrics_host: str = setting(LOOPBACK, _METRICS_HOST)


SERVICE_CONFIGS = (CoordinatorConfig, VerifierConfig, DraftConfig, GatewayConfig)

# Integer settings a service cannot run with (the service then started and failed every request,
# or stopped later with a message that did not name the setting): name -> (lowest, highest, what),
# from the fields' metadata. A highest bound that is a field name (or (field, offset)) is that
# field's value, checked after the fixed bounds (k_max before k, max_tokens_limit before max_tokens).
_INT_RANGES: dict[str, tuple] = {f.name: f.metadata["range"] for cls in SERVICE_CONFIGS
                                 for f in dataclasses.fields(cls) if f.metadata["range"]}


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
        key = f.metadata["env"]
        if key in env:
            kind = type(f.default)
            try:
                values[f.name] = _convert(kind, env[key])
            except ValueError as exc:
                if kind is int and f.metadata["range"]:   # what it takes, not int()'s words
                    raise ValueError(f"{key}={env[key]!r}: {_int_range_text(f.name)}") from None
                raise ValueError(f"{key}={env[key]!r}: {exc}") from None
    return cls(**values)


def range_text(f: dataclasses.Field) -> str:
    """ "in [lo, hi]" of an integer setting ("" without a range); a bound that is another field
    is named as its option ("--k-max", "--max-workers -1")."""
    if not f.metadata["range"]:
        return ""
    lo, hi, _ = f.metadata["range"]
    if isinstance(hi, str):
        hi = f"--{hi.replace('_', '-')}"
    elif isinstance(hi, tuple):
        hi = f"--{hi[0].replace('_', '-')} {hi[1]:+d}"
    return f"in [{lo}, {hi}]"


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of ``cls`` (its metadata's "flag"; default None: keep what the
    environment or the dataclass says), with the field's help, variable, default and range."""
    for f in dataclasses.fields(cls):
        opt, env, kind = f.metadata["flag"], f.metadata["env"], type(f.default)
        doc = f.metadata["help"]
        if kind is bool:
            parser.add_argument(opt, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=f"{doc} (env {env}: on/off, true/false, yes/no, "
                                     f"1/0; default {'on' if f.default else 'off'})")
        elif kind is tuple:
            parser.add_argument(opt, dest=f.name, default=None, action="append",
                                help=f"{doc}; repeatable (env {env}, comma-separated)")
        else:
            extra = "".join(f"; {x}" for x in (range_text(f),) if x)
            if f.metadata["choices"]:
                extra += f"; one of {', '.join(f.metadata['choices'])}"
            parser.add_argument(opt, dest=f.name, default=None, type=kind,
                                help=f"{doc} (env {env}, default {f.default!r}{extra})")


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
    for name in ("api_key", "internal_key"):
        if getattr(ns, name, None) == "":
            # `--api-key "$KEY"` with KEY unset would otherwise start a service that answers anyone
            flag = "--" + name.replace("_", "-")
            parser.error(f'{flag} "": an empty key turns the check off; give a key, or leave '
                         f"{flag} out for a service without one")
    overrides = {k: (tuple(v) if isinstance(v, list) else v)
                 for k, v in vars(ns).items() if v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    try:
        check_ranges(cfg)
        if getattr(cfg, "api_keys_file", ""):   # an unusable keys file too
            from echospec.services.common.tenants import Tenants
            try:
                Tenants.load(cfg.api_keys_file)
            except ValueError as exc:
                raise ValueError(f"{setting_name('api_keys_file')}: {exc}") from None
        if hasattr(cfg, "tls_cert"):   # unusable TLS files fail here, before a model loads
            from echospec.services.rpc.grpc_util import Tls
            Tls.of(cfg).validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def _int_range_text(name: str) -> str:
    """'<what> must be a whole number in [lo, hi]' for an integer setting with a range."""
    f = next(f for cls in SERVICE_CONFIGS for f in dataclasses.fields(cls) if f.name == name)
    return f"{f.metadata['range'][2]} must be a whole number {range_text(f)}"


def setting_name(field: str) -> str:
    """A service setting as its users spell it: "--tls-cert / ECHOSPEC_TLS_CERT"."""
    return f"--{field.replace('_', '-')} / ECHOSPEC_{field.upper()}"


def check_ranges(cfg, name_of=setting_name) -> None:
    """Refuse ports, durations, API keys and integer settings no service can use (gRPC would take
    port 99999 as 34463, a negative deadline fails every call, a non-ASCII key cannot be sent, a
    body limit of 0 bytes refuses every request).

    Args:
        cfg: a config dataclass (a setting() field's range and choices are checked).
        name_of: field name -> how the message names it (default: its option and variable).
    Raises:
        ValueError: naming the first bad field.
    """
    from echospec.services.common.auth import check_api_key

    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        name = name_of(f.name)
        if f.name in ("api_key", "internal_key"):
            try:
                check_api_key(v, "the API key" if f.name == "api_key" else "the internal key")
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        elif f.name == "port" or f.name.endswith("_port"):
            lo = -1 if f.name in ("metrics_port", "http_port") else 0
            off = "no gateway" if f.name == "http_port" else "off"
            if not lo <= v <= 65535:
                raise ValueError(f"{name} {v}: a port is in [{lo}, 65535]"
                                 + (f" (-1: {off}, 0: a free port)" if lo < 0 else " (0: a free port)"))
        elif f.metadata.get("choices"):
            choices = f.metadata["choices"]
            if not isinstance(v, str) or v.upper() not in (c.upper() for c in choices):
                raise ValueError(f"{name} {v!r}: one of {', '.join(choices)} (any case)")
        elif f.name == "draft_prior" and not v.strip():   # an unset $VAR would turn it off unsaid
            raise ValueError(f"{name} is empty: auto (the prior `echospec prior` cached for this "
                             f"model), off, or a prior file's path")
        elif f.name in ("host", "metrics_host") and not v.strip():
            raise ValueError(f"{name} is empty: the address to listen on (127.0.0.1: this machine "
                             f"only, 0.0.0.0: every interface)")
        elif f.name.endswith("_target") or f.name == "verifier":
            if f.name == "coordinator_target" and not v.strip():
                raise ValueError(f"{name} is empty: the coordinator's host:port")
            if f.name == "verifier_target" and not v.strip() and not getattr(cfg, "verifier", ()):
                raise ValueError(f"{name} is empty (and --verifier names none): the verifier's "
                                 f"host:port")
            for t in (v,) if isinstance(v, str) else v:
                bad = target_port_error(t) if t.strip() or isinstance(v, str) else \
                    "an empty target: each is host:port or dns:///name:port"
                if bad:
                    raise ValueError(f"{name} {t!r}: {bad}")
        elif f.name.endswith("_s") and isinstance(v, float):
            zero_ok = f.name in ("grace_s", "stall_floor_s")   # 0: no grace / no stall detection
            ok = math.isfinite(v) and (v >= 0 if zero_ok else v > 0) and v <= MAX_SECONDS
            if not ok:
                raise ValueError(f"{name} {v}: seconds must be a finite number "
                                 + (">= 0" if zero_ok else "> 0")
                                 + f" and at most {MAX_SECONDS:g} (a timed wait longer than the "
                                   f"clock's range fails)")
    if hasattr(cfg, "kv_window"):
        problem = kv_eviction_problem(cfg.kv_sinks, cfg.kv_window, name_of)
        if problem:
            raise ValueError(problem)
    if hasattr(cfg, "sparse_attention") and cfg.sparse_attention > 0 and getattr(cfg, "kv_window", 0) > 0:
        raise ValueError(f"{name_of('sparse_attention')} {cfg.sparse_attention} with {name_of('kv_window')} "
                         f"{cfg.kv_window}: sparse attention does not combine with KV eviction (a step "
                         f"already attends only the sinks and the window); use one of them")
    # fixed bounds first, then the bounds that are other fields (checked by then)
    ranged = [f for f in dataclasses.fields(cfg) if f.metadata.get("range")]
    for f in sorted(ranged, key=lambda f: isinstance(f.metadata["range"][1], (str, tuple))):
        lo, hi, what = f.metadata["range"]
        if isinstance(hi, str):
            hi = getattr(cfg, hi)
        elif isinstance(hi, tuple):
            hi = getattr(cfg, hi[0]) + hi[1]
        lo, hi = int(lo), int(hi)
        v = getattr(cfg, f.name)
        if not lo <= v <= hi:
            raise ValueError(f"{name_of(f.name)} {v}: {what} must be in [{lo}, {hi}]")


def kv_eviction_problem(sinks: int, window: int, name_of=setting_name) -> str:
    """Why kv_sinks and kv_window do not make a KV eviction setting ("" when they do: both
    unset, or sinks >= 0 and window >= 1 with sinks + window within the engine's ES_MAX_CTX).
    The window is not bounded by the forward's pieces: the ring keeps the window plus them."""
    s, w = name_of("kv_sinks"), name_of("kv_window")
    if sinks < -1 or window < 0:
        return (f"{s} {sinks} / {w} {window}: the sinks are >= 0 positions and the window >= 1 "
                f"(leave both out for no eviction)")
    if window > 0 and sinks < 0:
        return (f"{w} {window} needs {s}: the first positions kept for good (attention sinks; "
                f"StreamingLLM keeps 4; 0 for a plain sliding window)")
    if window == 0 and sinks >= 0:
        return f"{s} {sinks} needs {w} >= 1: the recent positions every query attends"
    most = int(EngineLimit("ES_MAX_CTX")) if window > 0 else 0
    if window > 0 and sinks + window > most:
        return f"{s} {sinks} + {w} {window} = {sinks + window}: at most {most} positions"
    return ""


def kv_eviction_text(sinks: int, window: int) -> str:
    """GetConfig's kv_eviction: "none", or "sinks S, window W" (services/coordinator/gating.py
    refuses speculation on anything but "none")."""
    return f"sinks {sinks}, window {window}" if window > 0 else "none"


def target_port_error(target: str) -> str:
    """Why a host:port target names a port no server can listen on, or holds what no host has
    (whitespace), or has no port; "" when it does not, and for "" and gRPC URIs such as
    dns:///name:port. gRPC would otherwise dial it (port 443 where none is given) until every
    call's deadline and report nothing reachable."""
    if target.startswith("dns:///"):   # the coordinator's fleet form: dns:///name:port
        name, sep, port = target[len("dns:///"):].rpartition(":")
        ok = sep and name and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
        return "" if ok else "a dns:/// target is dns:///name:port"
    if not target or "://" in target or target.startswith(GRPC_URI_SCHEMES):
        return ""
    if any(c.isspace() or not c.isprintable() for c in target):
        return "it holds a space or a control character, which no host name or address has"
    if target.startswith("["):
        end = target.find("]")
        if end < 0:
            return "an IPv6 address in brackets ends with ']' then :port"
        if not target[end + 1:].startswith(":"):
            return "no port (the target is host:port)"
        port = target[end + 2:]
    else:
        host, sep, port = target.rpartition(":")
        if ":" in host:
            return "an IPv6 address goes in brackets with a port ([::1]:50053, for instance)"
        if not sep:
            return "no port (the target is host:port)"
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
