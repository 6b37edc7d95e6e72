"""The `echospec` command line: serve, generate, chat, tokenize, detokenize, bench.

    echospec serve [--port P] [--model PATH|NAME] [--spec] [--http-port P] [--api-key K]
                   [--tls-cert F --tls-key F [--tls-ca F] [--tls-client-ca F]]
    echospec generate "prompt" [--json] [--spec on|off] [--k K] [--max-tokens N] ...
    echospec generate --messages chat.json --json      (--messages -: standard input)
    echospec chat --target 127.0.0.1:50051 [--system TEXT]
    echospec tokenize "text" --json
    echospec detokenize 1 2 3 --json
    echospec bench --workloads workloads/seed.jsonl [--json]

generate, chat, tokenize, detokenize and bench talk to a running coordinator given
by --target host:port, through the light client (echospec_client, clients/python).
Without --target they start a private stack on loopback with the default model
(fetched on first use) for the one command.
Exit status: 0 success, 1 a failure with a message on stderr, 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import json
import math
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# numpy is only used for buffers here; its OpenBLAS worker threads would spin on the
# cores the engine computes on, so keep OpenBLAS to one thread (before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

DEFAULT_PORT = 50051
SHUTDOWN_GRACE_S = 2.0   # `echospec serve`: seconds requests in flight get to finish on SIGINT/SIGTERM


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised in the main thread by the handler `main` installs first,
    so whatever was started unwinds through its cleanup (``finally`` / ``except BaseException``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []   # the first SIGINT/SIGTERM, once it has arrived


def _install_signal_handlers() -> None:
    """SIGINT/SIGTERM raise `Interrupted` once; later signals are ignored, so the cleanup that
    the first one started (stopping services, freeing ports) runs to its end."""

    def handler(signum, frame):  # noqa: ARG001
        if not _received:
            _received.append(signum)
            raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _raise_if_interrupted() -> None:
    """Raise `Interrupted` for a signal whose exception was lost: Python ignores exceptions raised
    where it runs callbacks (an import lock's weakref callback, a ``__del__``), so the handler's
    raise can vanish while startup goes on. A loop that waits calls this to stop anyway."""
    if _received:
        raise Interrupted(_received[0])


def _say(msg: str) -> None:
    """One "echospec: ..." line on stderr, whole beside the lines other threads log (logs.py)."""
    from echospec.services.common import logs
    logs.write_stderr_line(f"echospec: {msg}")


def _die(msg: str, code: int = 1) -> "NoReturn":  # noqa: F821
    _say(msg)
    sys.exit(code)


def _fetch_model_module():
    """scripts/fetch_model.py, loaded by path (scripts/ is not put on sys.path); None if absent."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "fetch_model.py"
    spec = importlib.util.spec_from_file_location("echospec_fetch_model", path)
    if spec is None or not path.is_file():
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _default_model(name: str | None = None) -> str:
    """The default model's path, or that of the model called ``name`` (scripts/fetch_model.py
    MODELS), fetched on first use."""
    mod = _fetch_model_module()
    what = f"model {name}" if name else "the default model"
    if mod is None:
        _die(f"cannot find scripts/fetch_model.py to fetch {what}; give --model PATH")
    try:
        return str(mod.fetch_named(name) if name else mod.fetch())
    except RuntimeError as exc:
        _die(f"could not fetch {what}: {exc}")


def _resolve_model(value: str | None) -> str:
    """A --model value as a GGUF path: none -> the default model; a model name (smollm2-135m,
    gemma3-270m) that is not also an existing file -> that model, fetched; else the path."""
    if not value:
        return _default_model()
    if not Path(value).exists():
        mod = _fetch_model_module()
        if mod is not None and value in mod.MODELS:
            return _default_model(value)
    return value


def _check_bind(name: str, flag: str, host: str, port: int) -> None:
    """Exit with a clear message when host:port cannot be bound."""
    import errno

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        _die(f"--host {host}: not an address of this machine ({exc.strerror})", 2)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                _die(f"{name} port {host}:{port} is already in use; pick another with {flag}")
            _die(f"cannot listen on {host}:{port} for the {name}: {exc.strerror}")


def _check_model(path: str) -> None:
    p = Path(path)
    if p.is_dir():
        _die(f"model {path} is a directory, not a GGUF file")
    if not p.exists():
        _die(f"model file not found: {path}")
    if not p.is_file():
        _die(f"model {path} is not a regular file (a GGUF file is needed)")
    from echospec.services.verifier.engine import EngineError, Model
    try:
        Model(str(p), repack=False).close()   # a check: no repacked copy of the weights
    except EngineError as exc:
        _die(f"model {path} is unusable: {exc}")


# ---- serve -------------------------------------------------------------------

def _exposure_warning(host: str, api_key: str, mtls: bool) -> str:
    """"" for a loopback --host; else what the address exposes that README's "Exposure" says to
    protect: the internal verifier and draft ports (without mTLS), and the coordinator and the
    gateway (without an API key)."""
    import ipaddress

    h = host.strip("[]")
    try:
        if h == "localhost" or ipaddress.ip_address(h).is_loopback:
            return ""
    except ValueError:
        pass   # a host name: it may resolve to a public address
    parts = []
    if not mtls:
        parts.append("the internal verifier and draft ports listen there too, where anyone who "
                     "reaches them can open sessions (add --tls-client-ca, or keep the address "
                     "on a private network)")
    if not api_key:
        parts.append("the coordinator and the gateway answer anyone (add --api-key)")
    return f"--host {host} is not loopback: " + "; ".join(parts) if parts else ""


def cmd_serve(args: argparse.Namespace) -> int:
    from echospec.stack import StackError, start_stack

    for flag, v in (("--port", args.port), ("--verifier-port", args.verifier_port),
                    ("--draft-port", args.draft_port)):
        if not 0 <= v <= 65535:
            _die(f"{flag} {v}: a port is in [0, 65535] (0: a free port)", 2)
    if not -1 <= args.http_port <= 65535:
        _die(f"--http-port {args.http_port}: a port is in [0, 65535] (-1: no gateway)", 2)
    _check_tls(args)
    if args.api_key == "":
        # `--api-key "$KEY"` with KEY unset would otherwise start a server that answers anyone
        _die('--api-key "": an empty key turns the check off; give a key, or leave --api-key out '
             "for a server without one", 2)
    api_key = args.api_key if args.api_key is not None else os.environ.get("ECHOSPEC_API_KEY", "")
    from echospec.services.common.auth import check_api_key
    try:
        check_api_key(api_key)
    except ValueError as exc:
        _die(f"{'--api-key' if args.api_key is not None else 'ECHOSPEC_API_KEY'}: {exc}", 2)
    from echospec.services.common.config import CoordinatorConfig
    from echospec.services.verifier.engine import MAX_CTX, MAX_THREADS

    limits = CoordinatorConfig()
    if not 1 <= args.k <= limits.k_max:
        _die(f"--k {args.k}: drafts per round must be in [1, {limits.k_max}]", 2)
    if not 1 <= args.max_tokens <= limits.max_tokens_limit:
        _die(f"--max-tokens {args.max_tokens}: must be in [1, {limits.max_tokens_limit}]", 2)
    if args.n_ctx < 16:
        _die(f"--n-ctx {args.n_ctx}: the KV capacity must be at least 16 tokens", 2)
    if not 0 <= args.threads <= MAX_THREADS:
        _die(f"--threads {args.threads}: must be in [0, {MAX_THREADS}] (0: the usable CPUs less one)", 2)
    if args.n_ctx > MAX_CTX:
        _die(f"--n-ctx {args.n_ctx}: the KV capacity is at most {MAX_CTX} tokens", 2)
    if not -1 <= args.metrics_port <= 65535:
        _die(f"--metrics-port {args.metrics_port}: a port is in [0, 65535] (-1: off)", 2)
    if not 1 <= args.batch_max <= 256:
        _die(f"--batch-max {args.batch_max}: sessions per engine iteration must be in [1, 256]", 2)
    if not 1 <= args.prefill_chunk <= 1 << 20:
        _die(f"--prefill-chunk {args.prefill_chunk}: must be >= 1", 2)
    if not 1 <= args.decode_steps <= 1024:
        _die(f"--decode-steps {args.decode_steps}: greedy steps per engine call must be in [1, 1024]", 2)
    ports = [p for p in (args.port, args.verifier_port, args.draft_port, max(args.http_port, 0)) if p]
    if len(set(ports)) != len(ports):
        _die("--port, --verifier-port, --draft-port and --http-port must differ", 2)
    if args.metrics_port > 0 and args.metrics_port in ports:
        _die(f"--metrics-port {args.metrics_port} is also a service port", 2)
    from echospec.services.common import logs
    logs.setup(args.log_level, args.log_format)
    # ports first: a busy one is reported before the model is fetched or loaded
    for name, flag, port in (("coordinator", "--port", args.port),
                             ("verifier", "--verifier-port", args.verifier_port),
                             ("draft", "--draft-port", args.draft_port),
                             ("gateway", "--http-port", max(args.http_port, 0)),
                             ("metrics", "--metrics-port", max(args.metrics_port, 0))):
        _check_bind(name, flag, args.host, port)
    if args.chat_template:   # a bad file is named before the model is fetched or loaded
        from echospec.services.coordinator.server import read_chat_template
        from echospec.services.text.chat_template import ChatTemplate
        try:
            ChatTemplate(read_chat_template(args.chat_template))
        except ValueError as exc:
            _die(str(exc) if str(exc).startswith("--chat-template") else
                 f"--chat-template {args.chat_template}: {exc}", 2)
    model = _resolve_model(args.model)
    _check_model(model)
    _say(f"loading {model} ...")
    try:
        stack = start_stack(model, port=args.port, spec=args.spec, host=args.host,
                            verifier_port=args.verifier_port, draft_port=args.draft_port,
                            processes=args.processes, n_ctx=args.n_ctx, n_threads=args.threads,
                            k=args.k, max_tokens=args.max_tokens, adaptive_k=not args.fixed_k,
                            metrics_port=args.metrics_port, log_level=args.log_level,
                            log_format=args.log_format, batch_max=args.batch_max,
                            prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
                            decode_steps=args.decode_steps, http_port=args.http_port, api_key=api_key,
                            tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                            tls_ca=args.tls_ca or "", tls_client_ca=args.tls_client_ca or "",
                            chat_template=os.path.abspath(args.chat_template) if args.chat_template else "")
    except StackError as exc:
        msg = str(exc)
        if "metrics port" in msg:
            msg += " (--metrics-port)"
        _die(msg)
    # the stack is running: a signal from here on (the announcement included) stops it
    try:
        _say(f"draft service    listening on {stack.draft_target}")
        _say(f"verifier service listening on {stack.verifier_target}")
        for name, mp in sorted(stack.metrics_ports.items()):
            who = "all services" if not args.processes else name
            _say(f"metrics          on http://{_url_host(args.host)}:{mp}/metrics ({who})")
        if stack.http_url:
            _say(f"HTTP gateway     on {stack.http_url}/v1 (OpenAI-compatible)")
        security = ", ".join(s for s in ("TLS" if args.tls_cert else "",
                                         "mTLS on internal ports" if args.tls_client_ca else "",
                                         "API key required" if api_key else "") if s)
        _say(f"coordinator      listening on {stack.target} (spec default: "
             f"{'on' if args.spec else 'off'}{'; ' + security if security else ''}); "
             f"Ctrl-C stops")
        warning = _exposure_warning(args.host, api_key, bool(args.tls_client_ca))
        if warning:
            _say(f"warning: {warning}")
        sys.stderr.flush()
        # short sleeps: the kernel may deliver the signal to another thread (gRPC's, the child
        # processes' stderr readers), which does not interrupt this sleep; the handler then runs
        # when it returns
        while True:
            _raise_if_interrupted()
            time.sleep(0.25)
            # the draft service is optional: a dead one is restarted (a few times) and the
            # verifier decodes plainly meanwhile
            for note in stack.revive():
                _say(f"the {note}")
            gone = stack.exited()
            if gone:   # a verifier, coordinator or gateway child died: the stack cannot serve
                _say(f"the {gone}; stopping every service")
                # the children's shutdown names the cause: "... exited with status -9 (SIGKILL)"
                stack.stop(SHUTDOWN_GRACE_S, "the " + gone.partition(": ")[0])
                return 1
    except Interrupted as sig:
        _say(f"{sig} received: stopping every service; requests in flight get "
             f"{SHUTDOWN_GRACE_S:g} s to finish, then end with UNAVAILABLE (shutting down)")
        stack.stop(SHUTDOWN_GRACE_S, str(sig))
        _say(f"stopped ({sig})")
    finally:
        stack.stop(SHUTDOWN_GRACE_S)   # a no-op after a signal: the stack is stopped
    return 0


def _check_tls(args: argparse.Namespace) -> None:
    """Exit 2 with a message when the TLS options are incomplete or name missing files."""
    if bool(args.tls_cert) != bool(args.tls_key):
        _die("--tls-cert and --tls-key go together", 2)
    if (args.tls_ca or args.tls_client_ca) and not args.tls_cert:
        _die("--tls-ca and --tls-client-ca need --tls-cert and --tls-key", 2)
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-ca", args.tls_ca), ("--tls-client-ca", args.tls_client_ca)):
        if path and not Path(path).is_file():
            _die(f"{flag} {path}: no such file", 2)
    # gRPC reports unusable PEM only as "cannot bind" (TSI_INVALID_ARGUMENT in its log): check here
    if args.tls_cert:
        import ssl
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                args.tls_cert, args.tls_key, password=lambda: b"")   # never prompt on the terminal
        except (ssl.SSLError, OSError) as exc:
            _die(f"--tls-cert {args.tls_cert} --tls-key {args.tls_key}: not a PEM certificate "
                 f"chain and its unencrypted private key ({_ssl_reason(exc)})", 2)
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-client-ca", args.tls_client_ca)):
        if path:
            _check_ca(flag, path)


def _ssl_reason(exc: Exception) -> str:
    import ssl
    if isinstance(exc, ssl.SSLError):
        return exc.reason or "OpenSSL cannot read it"   # e.g. KEY_VALUES_MISMATCH
    return exc.strerror or str(exc)


def _check_ca(flag: str, path: str) -> None:
    """Exit 2 unless `path` is a readable file with at least one PEM CA certificate."""
    import ssl
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        _die(f"{flag} {path}: not a PEM CA certificate ({_ssl_reason(exc)})", 2)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---- client helpers ------------------------------------------------------------

def _check_target_form(target: str) -> None:
    """Exit 2 for a --target that is a URL or has no port: gRPC would dial the URL's text, or
    port 443, and the command would wait out the connect timeout and report nothing reachable.
    gRPC's own target URIs (dns:///host:port, unix:path, ...) pass."""
    import ipaddress

    from echospec_client.client import _URI_SCHEMES

    example = "the target is host:port, e.g. 127.0.0.1:50051 or [::1]:50051"
    scheme = target.split("://", 1)[0].lower() if "://" in target else ""
    if scheme in ("http", "https", "grpc", "grpcs"):
        _die(f"--target {target}: a URL; {example} (the HTTP gateway's URL is for HTTP clients)", 2)
    if scheme or target.startswith(_URI_SCHEMES):
        return
    if any(c.isspace() or not c.isprintable() for c in target):
        return   # the client names the character
    if target.startswith("["):
        has_port = "]:" in target
    else:
        host, sep, _ = target.rpartition(":")
        if ":" in host:   # a bare IPv6 address has no port; anything else the client explains
            try:
                ipaddress.IPv6Address(target)
            except ValueError:
                return
            has_port = False
        else:
            has_port = bool(sep)
    if not has_port:
        _die(f"--target {target}: no port; {example}", 2)


@contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    """Yield a coordinator host:port: --target, or a private stack for this command."""
    if args.target is not None:
        if not args.target.strip():
            _die("--target must be host:port, not empty", 2)
        _check_target_form(args.target)
        yield args.target
        return
    from echospec.stack import StackError, start_stack

    model = _resolve_model(args.model)
    _check_model(model)
    print("echospec: no --target given; starting a private stack on loopback ...", file=sys.stderr)
    try:
        stack = start_stack(model, port=0, spec=False, n_threads=getattr(args, "threads", 0) or 0)
    except StackError as exc:
        _die(str(exc))
    try:
        yield stack.target
    finally:
        stack.stop(0.5)


def _client(args: argparse.Namespace, target: str):
    """The light client (echospec_client.Client) to `target` with the command's --timeout (the
    default per call: connection wait and call together), --connect-timeout, --api-key and
    TLS options; exits 2 on a certificate file it cannot read."""
    from echospec_client import Client

    if args.tls_ca:
        _check_ca("--tls-ca", args.tls_ca)
    try:
        return Client(target, timeout=args.timeout, connect_timeout=args.connect_timeout,
                      api_key=args.api_key, root_certificates=args.tls_ca,
                      tls=True if args.tls else None, server_name=args.tls_server_name)
    except ValueError as exc:
        _die(str(exc), 2)


def _client_error(exc, target: str, what: str = "") -> "NoReturn":  # noqa: F821
    """Exit with the message of a echospec_client.ClientError: 2 for INVALID_ARGUMENT (arguments
    the server refuses are bad arguments too, like argparse's), 1 for everything else. `what`
    (e.g. "workload 2/5 'code'") starts the message when the failing call needs naming."""
    import grpc

    from echospec_client import ConnectError

    pre = f"{what}: " if what else ""
    if isinstance(exc, ConnectError) and exc.cause:
        _die(f"{pre}cannot connect to {target}: {exc.cause}")
    if isinstance(exc, ConnectError) and exc.tls_mismatch:
        fix = ("drop --tls and --tls-ca" if exc.uses_tls else
               "add --tls (and --tls-ca CA.pem when a private CA signed its certificate)")
        _die(f"{pre}cannot connect to {target}: {exc.tls_mismatch}: {fix}")
    if isinstance(exc, ConnectError):
        flag = "--timeout" if exc.bound == "timeout" else "--connect-timeout"
        why = f": {exc.reason}" if exc.reason else ""
        _die(f"{pre}no coordinator reachable at {target} within {exc.waited_s:g} s ({flag}){why}; the "
             f"target is host:port, e.g. 127.0.0.1:{DEFAULT_PORT} or [::1]:{DEFAULT_PORT}; start a "
             f"coordinator with `echospec serve`")
    code = 2 if exc.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    hint = ("; give it more time with --timeout SECONDS" if exc.code ==
            grpc.StatusCode.DEADLINE_EXCEEDED and exc.details.startswith("the call did not")
            else "")
    _die(f"{pre}{exc.code.name}: {exc.details}{hint}", code)


# ---- argument types (argparse exits 2 with the message) ----------------------------

def _int32(text: str) -> int:
    """An integer that fits the protocol's int32 fields."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    if not -(2 ** 31) <= v < 2 ** 31:
        raise argparse.ArgumentTypeError(f"{v} is out of range (a 32-bit integer)")
    return v


MAX_TIMEOUT_S = 1e6   # about 11.5 days
FLOAT32_MAX = 3.4028234663852886e38   # the protocol's temperature, top_p and min_p are float32


def _seconds(text: str) -> float:
    """A deadline: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite positive number of seconds")
    if v > MAX_TIMEOUT_S:   # gRPC turns larger deadlines into an immediate DEADLINE_EXCEEDED
        raise argparse.ArgumentTypeError(f"{text} seconds: at most {MAX_TIMEOUT_S:.0f}")
    return v


def _utf8(text: str) -> str:
    """Text that is valid Unicode (a command line with bytes that are not UTF-8 is refused)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("text is not valid UTF-8") from None
    return text


def _check_messages(messages, where: str = "") -> None:
    """Exit 2 naming the first message the client would refuse (a role and a content: a string or
    OpenAI's list of text parts); `where` (the file) starts the message."""
    from echospec_client.client import check_messages

    at = f"{where}: " if where else ""
    if not isinstance(messages, list):
        _die(f"{at}chat messages must be a JSON list of objects, got {type(messages).__name__}", 2)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            _die(f'{at}messages[{i}] must be a JSON object with "role" and "content", got '
                 f"{json.dumps(m)[:80]}", 2)
    try:
        check_messages(messages)
    except (TypeError, ValueError) as exc:
        _die(f"{at}{exc}", 2)


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """Exit 2 on a sampling or limit flag that no coordinator accepts, before anything connects
    or a private stack starts: `generate`, `chat` and `bench` check their flags here, so a bad
    one is reported once with the same message (chat sends one request per line). The ranges are
    the coordinator's that do not depend on its configuration; the upper bounds of --max-tokens
    and --k are the server's to check (chat checks them against the limits GetInfo reports)."""
    def bad(flag: str, v, why: str) -> None:
        _die(f"{flag} {f'{v:g}' if isinstance(v, float) else v}: {why}", 2)

    seed = getattr(args, "seed", 0)
    if not 0 <= seed < 2 ** 64:
        bad("--seed", seed, "must be in [0, 2^64)")
    for flag, name, why in (("--max-tokens", "max_tokens", "must be >= 0 (0: the server's default)"),
                            ("--k", "k", "must be >= 0 (0: the server's default)"),
                            ("--top-k", "top_k", "must be >= 0 (0: off)")):
        v = getattr(args, name, 0)
        if v < 0:
            bad(flag, v, why)
    for flag, name in (("--temperature", "temperature"), ("--top-p", "top_p"), ("--min-p", "min_p")):
        v = getattr(args, name, None)
        if v is not None and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
            bad(flag, v, "must be a finite number (within float32's range)")
    top_p = getattr(args, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        bad("--top-p", top_p, "must be in (0, 1] (leave it out or 1 for off)")
    min_p = getattr(args, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        bad("--min-p", min_p, "must be in [0, 1] (0: off)")


def _gen_kwargs(args: argparse.Namespace, messages=None, prompt: str | None = None,
                max_tokens=None, spec: str | None = None) -> dict:
    """Keyword arguments of Client.complete / Client.stream from the command line."""
    kw: dict = {}
    if messages is not None:
        _check_messages(messages)
        kw["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        kw["prompt"] = prompt or ""
    kw["max_tokens"] = int(max_tokens if max_tokens is not None else args.max_tokens or 0)
    kw["stop"] = list(getattr(args, "stop", None) or [])
    if "" in kw["stop"]:
        _die("--stop '': a stop string needs at least one character", 2)
    kw["temperature"] = float(getattr(args, "temperature", 0.0) or 0.0)
    kw["top_p"] = getattr(args, "top_p", None)
    kw["top_k"] = int(getattr(args, "top_k", 0) or 0)
    kw["min_p"] = float(getattr(args, "min_p", 0.0) or 0.0)
    kw["seed"] = int(getattr(args, "seed", 0) or 0)  # range checked by the command
    mode = spec if spec is not None else getattr(args, "spec", None)
    kw["spec"] = {None: None, "off": False, "on": True}[mode]
    kw["k"] = int(getattr(args, "k", 0) or 0)
    if getattr(args, "prediction_file", None):
        kw["prediction"] = _read_text("--prediction-file", args.prediction_file)
    kw["draft_namespace"] = getattr(args, "draft_namespace", None) or ""
    return kw


def _result_json(r) -> dict:
    """The JSON of an echospec_client.Result: the result and its stats (the client's timings
    are added by the caller)."""
    import dataclasses

    return {
        "text": r.text,
        "token_ids": list(r.token_ids),
        "finish_reason": r.finish_reason,
        "spec_enabled": r.spec_enabled,
        "spec_reason": r.spec_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "verifier": r.verifier,
        "stats": dataclasses.asdict(r.stats),
    }


def _read_text(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        _die(f"{flag} {path}: {exc.strerror}", 2)
    except UnicodeDecodeError as exc:
        _die(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})", 2)


def _valid_unicode(v) -> bool:
    """False when a string anywhere in the parsed JSON value holds a lone surrogate."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
    return True


def _load_messages(path: str):
    """Chat messages from the JSON file `path`, or from standard input when path is "-"."""
    if path == "-":
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            _die(f"--messages -: standard input is not UTF-8 text ({exc.reason} at byte {exc.start})", 2)
        path = "- (standard input)"
    else:
        text = _read_text("--messages", path)
    text = text.removeprefix("\ufeff")   # the byte order mark some Windows editors write
    if not text.strip():
        _die(f"--messages {path}: the input is empty: expected a JSON list of chat messages", 2)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        _die(f"--messages {path}: not valid JSON ({type(exc).__name__}: {exc})", 2)
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data:
        _die(f"--messages {path}: expected a non-empty JSON list of chat messages", 2)
    _check_messages(data, f"--messages {path}")
    return data


# ---- generate ------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from echospec_client import ClientError

    if (args.prompt is None) == (args.messages is None):
        _die("give exactly one of a prompt argument or --messages FILE", 2)
    if args.prompt == "":
        _die("the prompt text is empty: give some text to continue", 2)
    _check_sampling_flags(args)
    messages = _load_messages(args.messages) if args.messages else None
    kw = _gen_kwargs(args, messages=messages, prompt=args.prompt)
    with _target(args) as target:
        client = _client(args, target)
        open_line = False   # streamed text not ended by a newline yet
        try:
            result = None
            for chunk in client.stream(**kw):
                if chunk.text and not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    open_line = not chunk.text.endswith("\n")
                if chunk.result is not None:
                    result = chunk.result
            if args.json:
                j = _result_json(result)
                # measured by the client, from the call to its last message (connect wait excluded)
                j["wall_s"] = round(result.wall_s, 4)
                j["ttft_s"] = None if result.ttft_s is None else round(result.ttft_s, 4)
                j["tokens_per_s"] = round(result.tokens_per_s, 2)
                print(json.dumps(j, ensure_ascii=False))
                return 0
            sys.stdout.write("\n")
            if result is not None:
                st = result.stats
                print(f"[{result.completion_tokens} tokens, finish: {result.finish_reason}, spec: "
                      f"{'on' if result.spec_enabled else 'off'}"
                      f"{' (' + result.spec_reason + ')' if result.spec_reason else ''}, tries "
                      f"{st.tries}, hits {st.hits}, kv_rolls {st.kv_rolls}]", file=sys.stderr)
            return 0
        except ClientError as exc:
            if open_line:   # the message goes on a line of its own, not after the partial text
                sys.stdout.write("\n")
                sys.stdout.flush()
            _client_error(exc, target)
        except (TypeError, ValueError) as exc:
            _die(str(exc), 2)
        finally:
            client.close()


# ---- tokenize / detokenize ----------------------------------------------------------

def _unary(args: argparse.Namespace, method: str, *call_args):
    """One unary call of the light client (--target, or a private stack); exits on an error."""
    from echospec_client import ClientError

    with _target(args) as target:
        client = _client(args, target)
        try:
            return getattr(client, method)(*call_args)
        except ClientError as exc:
            _client_error(exc, target)
        finally:
            client.close()


def cmd_tokenize(args: argparse.Namespace) -> int:
    ids = _unary(args, "tokenize", args.text)
    print(json.dumps({"token_ids": ids}) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    text = _unary(args, "detokenize", args.ids)
    print(json.dumps({"text": text}, ensure_ascii=False) if args.json else text)
    return 0


# ---- chat -------------------------------------------------------------------------

CHAT_COMMANDS = ("commands: /reset clears the history (the system prompt stays), /stats prints the "
                 "last turn's statistics, /history lists the messages, /quit or Ctrl-D ends; "
                 "Ctrl-C stops a reply; a line starting with // is sent with one / removed")


def _turn_line(r) -> str:
    """One line on a finished turn: its speed and how much of the prompt the prefix cache held."""
    s = r.stats
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f} s"
    spec = (f", spec: tries {s.tries}, hits {s.hits}" if r.spec_enabled else "")
    return (f"[{r.completion_tokens} tokens, {r.tokens_per_s:.1f} tok/s, first token {ttft}, "
            f"prompt {r.prompt_tokens} tokens ({s.cached_prompt_tokens} cached), "
            f"finish: {r.finish_reason}{spec}]")


def _stats_text(r, turns: int, history: list[dict]) -> str:
    """The /stats report of the last turn `r` (None before the first)."""
    head = f"session: {turns} turn(s), {len(history)} message(s) in the history"
    if r is None:
        return head + "\nno turn yet"
    s = r.stats
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f} s"
    spec = "on" if r.spec_enabled else "off"
    if r.spec_reason:
        spec += f" ({r.spec_reason})"
    return "\n".join([
        head,
        f"last turn: {r.completion_tokens} tokens in {r.wall_s:.3f} s ({r.tokens_per_s:.1f} tok/s), "
        f"first token after {ttft}, finish: {r.finish_reason}",
        f"prompt: {r.prompt_tokens} tokens, {s.cached_prompt_tokens} of them cached "
        f"(cached_prompt_tokens), prefill {s.prefill_ms:.1f} ms",
        f"speculation: {spec}; tries {s.tries}, hits {s.hits}, kv_rolls {s.kv_rolls}, "
        f"draft_tokens {s.draft_tokens}, acceptance rate {s.acceptance_rate:.3f}, "
        f"mean acceptance length {s.mean_acceptance_length:.3f}",
        f"T {s.t_ms:.2f} ms, V {s.v_ms:.2f} ms, overhead {s.overhead_ms:.2f} ms",
    ])


def _chat_turn(client, kw: dict, history: list[dict]):
    """Stream one reply to `history` onto stdout. Returns the Result, or None when Ctrl-C
    stopped it (the call is cancelled). Raises echospec_client.ClientError."""
    stream = client.stream(messages=history, **kw)
    result = None
    try:
        for chunk in stream:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if chunk.result is not None:
                result = chunk.result
    except KeyboardInterrupt:
        stream.close()   # cancels the call; the server frees the generation
        print("\n(stopped; the turn is dropped)", file=sys.stderr, flush=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


def _drop_oldest_turn(history: list[dict], start: int) -> bool:
    """Drop the oldest turn after the system messages (history[:start]): its user message and
    the replies up to the next user message. False when only the newest user message is left."""
    users = [i for i in range(start, len(history)) if history[i]["role"] == "user"]
    if len(users) < 2:
        return False
    del history[users[0]:users[1]]
    return True


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat: each line is a user message, the reply streams back, and
    the history (system prompt, user and assistant messages) is sent again each turn, so the
    verifier's prefix cache supplies the KV of what the previous turns already prefilled."""
    from echospec_client import ClientError

    _check_sampling_flags(args)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    kw = _gen_kwargs(args, messages=system)
    del kw["messages"]
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    with _target(args) as target:
        client = _client(args, target)
        try:
            try:
                info = client.info()
            except ClientError as exc:
                _client_error(exc, target)
            # the server's limits GetInfo reports, with the server's words for them
            if info.k_max and args.k > info.k_max:
                _die(f"--k {args.k}: must be in [0, {info.k_max}] (0: the server's default "
                     f"{info.k_default})", 2)
            if info.max_tokens_limit and args.max_tokens > info.max_tokens_limit:
                _die(f"--max-tokens {args.max_tokens}: max_tokens must be in "
                     f"[1, {info.max_tokens_limit}]", 2)
            print(f"echospec chat: {target}, model {info.model}; {CHAT_COMMANDS}",
                  file=sys.stderr, flush=True)
            # Ctrl-C stops a reply (or is ignored at the prompt) instead of ending the command
            signal.signal(signal.SIGINT, signal.default_int_handler)
            history = list(system)
            last, turns = None, 0
            # a prompt is for a person at a terminal: piped lines get none (it would land on
            # stdout between the replies, and the last one would end the output unterminated)
            interactive = sys.stdin.isatty()
            while True:
                try:
                    line = input("you> " if interactive else "")
                except EOFError:
                    if interactive:   # Ctrl-D: end the prompt's line
                        print(file=sys.stderr)
                    return 0
                except KeyboardInterrupt:
                    print("\n(Ctrl-D or /quit ends the chat)", file=sys.stderr, flush=True)
                    continue
                cmd = line.strip()
                if not cmd:
                    continue
                if cmd.startswith("/") and not cmd.startswith("//"):
                    if cmd in ("/quit", "/exit"):
                        return 0
                    if cmd == "/reset":
                        history = list(system)
                        print("(history cleared)", flush=True)
                    elif cmd == "/stats":
                        print(_stats_text(last, turns, history), flush=True)
                    elif cmd == "/history":
                        for m in history:
                            print(f"{m['role']}: {m['content']}")
                        if not history:
                            print("(no messages)")
                        sys.stdout.flush()
                    elif cmd == "/help":
                        print(CHAT_COMMANDS, flush=True)
                    else:
                        print(f"unknown command {cmd.split()[0]}; {CHAT_COMMANDS}", file=sys.stderr,
                              flush=True)
                    continue
                if line.startswith("//"):
                    line = line[1:]
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:   # stdin bytes that are not UTF-8 (surrogateescape)
                    print("echospec: the line is not valid UTF-8 text; it is not sent",
                          file=sys.stderr, flush=True)
                    continue
                history.append({"role": "user", "content": line})
                dropped = 0
                while True:
                    try:
                        result = _chat_turn(client, kw, history)
                    except ClientError as exc:
                        # a history that outgrew the context loses its oldest turns, one at a time
                        if "fit the context" in exc.details and _drop_oldest_turn(history, len(system)):
                            dropped += 1
                            continue
                        print(f"\nechospec: {exc.code.name}: {exc.details} (the turn is dropped; "
                              f"/reset clears the history)", file=sys.stderr, flush=True)
                        result = None
                    except KeyboardInterrupt:   # between the prompt and the first chunk
                        print("\n(stopped; the turn is dropped)", file=sys.stderr, flush=True)
                        result = None
                    break
                if dropped:
                    print(f"(the history outgrew the server's context: the oldest {dropped} "
                          f"turn(s) were dropped)", file=sys.stderr, flush=True)
                if result is None:
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": result.text})
                last, turns = result, turns + 1
                print(_turn_line(result), file=sys.stderr, flush=True)
        finally:
            client.close()

# ---- bench ----------------------------------------------------------------------

_WORKLOAD_FIELDS = frozenset({"id", "kind", "messages", "prompt", "max_tokens", "prediction",
                              "draft_namespace"})


def _load_workloads(path: str) -> list[dict]:
    from echospec.services.common.config import CoordinatorConfig

    max_tokens_limit = CoordinatorConfig().max_tokens_limit
    out, ids = [], set()
    lines = _read_text("--workloads", path).splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            w = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            _die(f"{path}:{n}: not valid JSON ({type(exc).__name__}: {exc})", 2)
        if not _valid_unicode(w):
            _die(f"{path}:{n}: a string is not valid Unicode (a lone surrogate)", 2)
        if not isinstance(w, dict) or not isinstance(w.get("id"), str) or not w["id"]:
            _die(f"{path}:{n}: each workload is a JSON object with a non-empty string id", 2)
        if w["id"] in ids:
            _die(f"{path}:{n}: duplicate workload id {w['id']!r}", 2)
        ids.add(w["id"])
        unknown = sorted(set(w) - _WORKLOAD_FIELDS)
        if unknown:   # a misspelt max_tokens would otherwise run with the default silently
            _die(f"{path}:{n}: unknown field {unknown[0]!r} (a workload has "
                 f"{', '.join(sorted(_WORKLOAD_FIELDS))})", 2)
        msgs, prompt = w.get("messages"), w.get("prompt")
        if (msgs is None) == (prompt is None):
            _die(f"{path}:{n}: give exactly one of messages or prompt", 2)
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            _die(f"{path}:{n}: prompt must be a non-empty string", 2)
        if msgs is not None:
            if not isinstance(msgs, list) or not msgs:
                _die(f"{path}:{n}: messages must be a non-empty list of chat messages", 2)
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
                    _die(f"{path}:{n}: messages[{i}] needs string role and content", 2)
        for key in ("prediction", "draft_namespace"):
            if key in w and not isinstance(w[key], str):
                _die(f"{path}:{n}: {key} must be a string", 2)
        mt = w.get("max_tokens", 256)
        if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= max_tokens_limit:
            _die(f"{path}:{n}: max_tokens must be an integer in [1, {max_tokens_limit}], "
                 f"got {mt!r}", 2)
        out.append(w)
    if not out:
        _die(f"{path}: no workloads", 2)
    return out


def _run_one(client, args, w: dict, spec: str) -> tuple[dict, object]:
    max_tokens = args.max_tokens or w.get("max_tokens") or 256
    kw = _gen_kwargs(args, messages=w.get("messages"), prompt=w.get("prompt"),
                     max_tokens=max_tokens, spec=spec)
    kw["temperature"] = 0.0
    kw["prediction"] = w.get("prediction", "")
    kw["draft_namespace"] = w.get("draft_namespace", "")
    r = client.complete(**kw)
    dt = r.wall_s
    s = r.stats
    return {"seconds": round(dt, 4), "tokens": r.completion_tokens,
            "tokens_per_s": round(r.completion_tokens / dt, 2) if dt > 0 else 0.0,
            "tries": s.tries, "hits": s.hits, "kv_rolls": s.kv_rolls, "draft_tokens": s.draft_tokens,
            "rounds": s.rounds, "proposals": s.proposals, "prefill_ms": round(s.prefill_ms, 3),
            "t_ms": round(s.t_ms, 3), "v_ms": round(s.v_ms, 3), "overhead_ms": round(s.overhead_ms, 3),
            "overhead_share": round(s.overhead_share, 4), "spec_enabled": r.spec_enabled,
            "spec_reason": r.spec_reason,
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
            "sources": s.sources}, r


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def cmd_bench(args: argparse.Namespace) -> int:
    from echospec_client import ClientError

    if args.threads < 0:
        _die(f"--threads {args.threads}: must be >= 0 (0: the usable CPUs less one)", 2)
    if args.repeat < 1:
        _die(f"--repeat {args.repeat}: must be >= 1", 2)
    _check_sampling_flags(args)
    workloads = _load_workloads(args.workloads)
    rows = []
    with _target(args) as target:
        client = _client(args, target)
        i, w = 0, workloads[0]
        try:
            for i, w in enumerate(workloads, 1):
                print(f"echospec bench: [{i}/{len(workloads)}] {w['id']} ...", file=sys.stderr, flush=True)
                if args.warmup and i == 1:
                    _run_one(client, args, w, "off")
                offs, ons, identical = [], [], True
                for _ in range(args.repeat):   # off and on alternate: load drifts hit both alike
                    off, roff = _run_one(client, args, w, "off")
                    on, ron = _run_one(client, args, w, "on")
                    identical &= list(roff.token_ids) == list(ron.token_ids) and roff.text == ron.text
                    offs.append(off)
                    ons.append(on)
                off, on = _median_run(offs), _median_run(ons)
                row = {"id": w["id"], "kind": w.get("kind", ""), "identical": identical, "off": off, "on": on}
                if args.repeat > 1:
                    row["off_seconds"] = [x["seconds"] for x in offs]
                    row["on_seconds"] = [x["seconds"] for x in ons]
                rows.append(row)
                if args.json:
                    print(json.dumps(row, ensure_ascii=False), flush=True)
        except ClientError as exc:
            # the run stops at the first failure (a server that is down would fail every later
            # workload too), with the finished rows shown and the failed workload named
            if not args.json and rows:
                _print_table(rows)
                sys.stdout.flush()
            _client_error(exc, target, f"workload {i}/{len(workloads)} {w['id']!r} failed "
                                       f"({len(rows)} finished)")
        finally:
            client.close()
    if not args.json:
        _print_table(rows)
    return 0 if all(r["identical"] for r in rows) else 1


def _print_table(rows: list[dict]) -> None:
    hdr = (f"{'workload':<15} {'off s':>7} {'on s':>7} {'net':>7} {'off tok/s':>9} {'on tok/s':>9} "
           f"{'tokens':>6} {'tries':>5} {'hits':>5} {'kv_rolls':>8} {'T ms':>6} {'V ms':>6} "
           f"{'ovh ms':>6} {'identical':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        off, on = r["off"], r["on"]
        net = (off["seconds"] / on["seconds"] - 1.0) * 100 if on["seconds"] > 0 else 0.0
        print(f"{r['id']:<15} {off['seconds']:>7.2f} {on['seconds']:>7.2f} {net:>+6.1f}% "
              f"{off['tokens_per_s']:>9.1f} {on['tokens_per_s']:>9.1f} {on['tokens']:>6} {on['tries']:>5} "
              f"{on['hits']:>5} {on['kv_rolls']:>8} {on['t_ms']:>6.2f} {on['v_ms']:>6.2f} "
              f"{on['overhead_ms']:>6.2f} {'yes' if r['identical'] else 'NO':>9}")
    t_off = sum(r["off"]["seconds"] for r in rows)
    t_on = sum(r["on"]["seconds"] for r in rows)
    if t_on > 0:
        print(f"total: off {t_off:.2f} s, on {t_on:.2f} s, net {(t_off / t_on - 1) * 100:+.1f}% "
              f"(positive = speculation faster); identical: "
              f"{sum(r['identical'] for r in rows)}/{len(rows)}")


# ---- argument parsing ------------------------------------------------------------

def _add_client_args(p: argparse.ArgumentParser,
                     json_help: str | None = "print one JSON object") -> None:
    p.add_argument("--target", type=_utf8,
                   help="coordinator host:port, e.g. 127.0.0.1:50051 (default: start a private stack)")
    p.add_argument("--model", help="GGUF file or model name (smollm2-135m, gemma3-270m) for a private "
                                   "stack (default: SmolLM2-135M-Instruct Q4_1)")
    if json_help is not None:
        p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--connect-timeout", type=_seconds, default=10.0,
                   help="seconds to wait for the coordinator to accept the connection (default 10; "
                        "--timeout bounds it too)")
    p.add_argument("--api-key", type=_utf8, default=None,
                   help="sent as `authorization: Bearer KEY` metadata (default: $ECHOSPEC_API_KEY)")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="CA certificate(s) of the coordinator's TLS certificate (turns TLS on)")
    p.add_argument("--tls", action="store_true",
                   help="TLS with the system's root certificates (when --tls-ca is not given)")
    p.add_argument("--tls-server-name", metavar="NAME", type=_utf8,
                   help="check the server's certificate against NAME instead of the target's host")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", choices=["on", "off"], help="speculation (default: the server's --spec)")
    p.add_argument("--k", type=_int32, default=0, help="max drafts per round (0: server default)")
    p.add_argument("--max-tokens", type=_int32, default=0, help="0: server default")
    p.add_argument("--temperature", type=float, default=0.0, help="<= 0: greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="in (0, 1]; 1: off (default)")
    p.add_argument("--top-k", type=_int32, default=0, help=">= 0; 0: off (default)")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0: off (default)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2^64) (default 0, a fixed seed like any other: the "
                        "same request samples the same output; give different seeds for "
                        "different samples); greedy decoding does not use it")
    p.add_argument("--stop", action="append", type=_utf8, help="stop string (repeatable)")
    p.add_argument("--timeout", type=_seconds, default=600.0,
                   help="seconds for the connection and the call together (default 600)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echospec", description="Speculative-decoding LLM service on CPUs.")
    ap.add_argument("--version", action="version", version=f"echospec {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="start the draft, verifier and coordinator services on loopback")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="coordinator port (default 50051)")
    p.add_argument("--model", help="GGUF file, or a model name fetched on first use: smollm2-135m "
                                   "(the default, SmolLM2-135M-Instruct Q4_1), gemma3-270m (Gemma 3 "
                                   "270M base Q4_K_M)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template for chat messages, used instead of the model's own "
                        "(needed for chat with a model that has none and is not ChatML)")
    p.add_argument("--spec", action="store_true", help="speculate by default for requests that allow it")
    p.add_argument("--host", type=_utf8, default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--verifier-port", type=int, default=0, help="0: a free port")
    p.add_argument("--draft-port", type=int, default=0, help="0: a free port")
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: the usable CPUs less one)")
    p.add_argument("--n-ctx", type=int, default=2048, help="KV capacity per session (tokens, default 2048)")
    p.add_argument("--k", type=int, default=4, help="default drafts per round (the most a round drafts; default 4, at most 32)")
    p.add_argument("--fixed-k", action="store_true",
                   help="always draft k tokens (default: the live cost model picks each round's length)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="max_tokens of a request that sets none (default 256, at most 8192)")
    p.add_argument("--processes", action="store_true", help="run each service in its own process")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus /metrics on this port (-1: off, 0: a free port); with "
                        "--processes the verifier and draft serve theirs on free ports (all URLs "
                        "are printed)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="INFO (default) logs one line per request")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object per line")
    p.add_argument("--batch-max", type=int, default=1,
                   help="sessions the verifier's scheduler serves per iteration (default 1; >= 2 refuses"
                        " speculation)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens per prefill step (default 256): a long prompt never stalls"
                        " others for longer")
    p.add_argument("--decode-steps", type=int, default=8,
                   help="greedy steps the engine runs per call for each decoding generation when nothing else waits"
                        " (default 8; 1: one call per token); anything else that arrives ends a run"
                        " after its current step")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep finished generations' KV for reuse by prompts sharing a prefix")
    p.add_argument("--http-port", type=int, default=-1,
                   help="serve the OpenAI-compatible HTTP gateway on this port (-1: off, default; "
                        "0: a free port)")
    p.add_argument("--api-key", default=None,
                   help="clients of the coordinator and the gateway must send `authorization: "
                        "Bearer KEY` (default: env ECHOSPEC_API_KEY; none: no check)")
    p.add_argument("--tls-cert", help="PEM certificate: every service listens with TLS (HTTPS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that signed --tls-cert, for the services' calls to "
                                    "each other (default: --tls-cert itself, if self-signed)")
    p.add_argument("--tls-client-ca", help="PEM CA: the internal ports (verifier, draft) demand "
                                           "client certificates it signed (mTLS)")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("generate", help="generate text from a prompt or chat messages")
    p.add_argument("prompt", nargs="?", type=_utf8, help="prompt text")
    p.add_argument("--messages", help="JSON file with a list of chat messages ('-': standard input)")
    p.add_argument("--prediction-file", help="text file with the expected output (a draft source, "
                   "like OpenAI's predicted outputs)")
    p.add_argument("--draft-namespace", type=_utf8, default="",
                   help="share draft memory with earlier requests of this namespace (default: none)")
    _add_client_args(p, "print one JSON object: the result, its stats, wall_s, ttft_s, tokens_per_s")
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat (streamed replies, /reset, /stats)")
    p.add_argument("--system", type=_utf8, help="system message (default: none; the chat template "
                                                "may add its own)")
    _add_client_args(p, json_help=None)
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("tokenize", help="token ids of TEXT (no special tokens added)")
    p.add_argument("text", type=_utf8)
    _add_client_args(p)
    p.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds for the connection and the call together (default 60)")
    p.set_defaults(fn=cmd_tokenize)

    p = sub.add_parser("detokenize", help="text of token ids")
    p.add_argument("ids", nargs="+", type=_int32)
    _add_client_args(p)
    p.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds for the connection and the call together (default 60)")
    p.set_defaults(fn=cmd_detokenize)

    p = sub.add_parser("bench", help="run workloads greedy with speculation off and on")
    p.add_argument("--workloads", required=True, help="JSONL: id, messages (or prompt); optional "
                   "max_tokens (default 256), prediction (text) and draft_namespace")
    p.add_argument("--k", type=_int32, default=0, help="drafts per round (0: server default)")
    p.add_argument("--max-tokens", type=_int32, default=0, help="override each workload's max_tokens")
    p.add_argument("--threads", type=_int32, default=0, help="engine threads of a private stack")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up run")
    p.add_argument("--repeat", type=_int32, default=1,
                   help="off/on pairs per workload, alternating; the table shows the median run of each")
    p.add_argument("--timeout", type=_seconds, default=900.0,
                   help="seconds to connect, and for each generation (default 900)")
    _add_client_args(p, "print one JSON line per workload (as each finishes) instead of the table")
    p.set_defaults(fn=cmd_bench)
    return ap


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("echospec")
    except PackageNotFoundError:
        return "(not installed)"


def _numeric_options(ap: argparse.ArgumentParser) -> set[str]:
    """The option strings of ap and its subcommands that take one number."""
    out: set[str] = set()
    for a in ap._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                out |= _numeric_options(sp)
        elif a.option_strings and a.nargs is None and a.type in (int, float, _int32, _seconds):
            out.update(a.option_strings)
    return out


def _join_negative_values(argv: list[str], numeric: set[str]) -> list[str]:
    """`--temperature -inf` as `--temperature=-inf`: argparse takes a value that starts with a
    dash for an option unless it looks like -1 or -.5, so -inf, -nan and -1e-3 would otherwise
    end in "expected one argument"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        if a in numeric and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{a}={argv[i + 1]}")
                i += 2
                continue
        out.append(a)
        i += 1
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; an unknown option is reported with its subcommand's usage."""
    ap = build_parser()
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv), _numeric_options(ap))
    args, extra = ap.parse_known_args(argv)
    if extra:
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The `echospec` command. SIGINT/SIGTERM are handled from here on: `serve` stops what it
    started (also mid-startup) and exits 0; the client commands exit 130 (SIGINT) or 143."""
    _install_signal_handlers()
    # the subcommand from the raw arguments: a signal may land while they are still being parsed
    raw = sys.argv[1:] if argv is None else argv
    serving = next((a for a in raw if not a.startswith("-")), None) == "serve"
    if not serving and "GRPC_VERBOSITY" not in os.environ:
        # gRPC core's own log lines (a failed TLS handshake, ...) are not for the user of a client
        # command: the command says what went wrong. Read when grpc loads, which is later.
        os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        args = parse_args(argv)
        return args.fn(args)
    except Interrupted as sig:
        if serving:
            print(f"echospec: {sig} during startup: stopped what was started", file=sys.stderr)
            return 0
        return 128 + sig.signum
    except KeyboardInterrupt:   # `chat` hands SIGINT back to Python's handler for Ctrl-C
        print(file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # the reader of stdout went away (`... | head`): stop quietly, as a command killed by
        # SIGPIPE would; stdout goes to /dev/null so the flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
