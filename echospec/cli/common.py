"""What the `echospec` commands share: signal handling, messages and exits, the default model,
the client helpers (a --target or a private stack, the light client, its errors), argument types
and the client commands' common options."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# Nothing here imports grpc (echospec_client, the services' config) at module level: `main` sets
# GRPC_VERBOSITY first, which gRPC reads when it loads.


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

    path = Path(__file__).resolve().parents[2] / "scripts" / "fetch_model.py"
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
    if value is None:
        return _default_model()
    if not value.strip():
        _die("--model is empty: give the path of a GGUF file or a model name (leave the option "
             "out for the default model)", 2)
    if not Path(value).exists():
        mod = _fetch_model_module()
        if mod is not None and value in mod.MODELS:
            return _default_model(value)
        if mod is not None and "/" not in value and not value.lower().endswith(".gguf"):
            _die(f"--model {value}: no such file, and not a model name; the names are "
                 f"{', '.join(sorted(mod.MODELS))} (or give the path of a GGUF file)", 2)
    return value


def _check_chat_template(path: str) -> str:
    """A --chat-template file, read and compiled before any model is fetched or loaded: its
    absolute path, or exit 2 naming the problem."""
    from echospec.services.coordinator.server import read_chat_template
    from echospec.services.text.chat_template import ChatTemplate

    try:
        ChatTemplate(read_chat_template(path))
    except ValueError as exc:
        _die(str(exc) if str(exc).startswith("--chat-template") else f"--chat-template {path}: {exc}", 2)
    return os.path.abspath(path)


def _check_bind(name: str, flag: str, host: str, port: int, host_flag: str = "--host") -> None:
    """Exit with a clear message when host:port cannot be bound (``host_flag``: the option that
    gave host)."""
    from echospec.services.rpc.lifecycle import bind_problem

    kind, why = bind_problem(host, port)
    if kind == "host":
        _die(f"{host_flag} {host}: not an address of this machine ({why})", 2)
    if kind == "busy":
        _die(f"{name} port {host}:{port} is already in use; pick another with {flag}")
    if kind == "other":
        _die(f"cannot listen on {host}:{port} for the {name}: {why}")


def _check_model(path: str, check_weights: bool = False) -> None:
    """Exit 2 when path is no regular file, 1 when the engine refuses it (its message: a
    corrupt file, a NaN or infinite weight with the tensor named). check_weights: the full
    weights check (`--check-weights`), else the default one (every scale and float value)."""
    p = Path(path)
    if p.is_dir():   # a --model that names no file is a bad argument (exit 2), as a bad name is
        _die(f"model {path} is a directory, not a GGUF file", 2)
    if not p.exists():
        _die(f"model file not found: {path}", 2)
    if not p.is_file():
        _die(f"model {path} is not a regular file (a GGUF file is needed)", 2)
    from echospec.services.verifier.engine import EngineError, Model
    try:
        Model(str(p), repack=False, check_weights=check_weights).close()   # no repacked copy
    except EngineError as exc:
        _die(f"model {path} is unusable: {exc}")



def _check_mmproj(path: str, model: str) -> None:
    """Exit 2 when the --mmproj file is missing, not a projector the engine reads, or does not
    fit the model (services/verifier/vision.py: architecture, output width, deepstack)."""
    if not path:
        return
    p = Path(path)
    need = "the projector GGUF of a Qwen3-VL model is needed"
    if p.is_dir():
        _die(f"--mmproj {path}: is a directory ({need})", 2)
    if not p.exists():
        _die(f"--mmproj {path}: no such file ({need})", 2)
    if not p.is_file():
        _die(f"--mmproj {path}: not a regular file ({need})", 2)
    from echospec.services.verifier.engine import EngineError, Model
    from echospec.services.verifier.vision import ProjectorMismatch, load_vision
    try:
        m = Model(model, repack=False)
        try:
            load_vision(str(p), m.info).close()
        finally:
            m.close()
    except EngineError as exc:   # the model's (load_vision names the projector's itself)
        _die(f"--mmproj {path}: the model {model} cannot be loaded: {exc}", 2)
    except ProjectorMismatch as exc:
        _die(str(exc), 2)


def prior_problem(path: str, model: str) -> str:
    """Why a verifier serving ``model`` would refuse the draft prior at ``path`` (missing, not a
    prior, of another vocabulary than the model's: PriorError's message), or "" when it reads it.
    An unreadable model checks the file alone (loading the model names that problem)."""
    from echospec.services.draft.prior import DraftPrior, PriorError
    from echospec.services.verifier.engine import EngineError, Model

    try:
        with Model(model, repack=False) as m:
            n_vocab = m.info.n_vocab
    except EngineError:
        n_vocab = None
    try:
        DraftPrior.load(path, n_vocab)
    except PriorError as exc:
        return str(exc)
    return ""


def _check_draft_prior(setting: str, model: str) -> None:
    """Exit 2 when --draft-prior names a file the verifier would refuse, before the services
    start; "auto" and "off" pass (auto's cached file is checked by the verifier, which names it)."""
    from echospec.services.draft.prior import setting_kind

    if setting_kind(setting) == "file":
        why = prior_problem(setting, model)
        if why:
            _die(f"--draft-prior: {why}", 2)


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

    from echospec_client.limits import GRPC_URI_SCHEMES

    example = "the target is host:port, e.g. 127.0.0.1:50051 or [::1]:50051"
    scheme = target.split("://", 1)[0].lower() if "://" in target else ""
    if scheme in ("http", "https", "grpc", "grpcs"):
        _die(f"--target {target}: a URL; {example} (the HTTP gateway's URL is for HTTP clients)", 2)
    if scheme or target.startswith(GRPC_URI_SCHEMES):
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
        for flag, value in (("--model", args.model), ("--chat-template", getattr(args, "chat_template", None)),
                            ("--mmproj", getattr(args, "mmproj", None))):
            if value is not None and (value or flag == "--model"):
                _die(f"{flag} applies to a private stack; the server at --target {args.target} "
                     f"uses its own (leave out {flag}, or leave out --target)", 2)
        yield args.target
        return
    from echospec.stack import StackError, start_stack

    template = getattr(args, "chat_template", None)
    template = _check_chat_template(template) if template else ""
    model = _resolve_model(args.model)
    _check_model(model)
    mmproj = getattr(args, "mmproj", "") or ""
    _check_mmproj(mmproj, model)
    print("echospec: no --target given; starting a private stack on loopback ...", file=sys.stderr)
    try:
        stack = start_stack(model, port=0, spec=False, n_threads=getattr(args, "threads", 0) or 0,
                            chat_template=template, tree_nodes=getattr(args, "tree_nodes", 0) or 0,
                            mmproj=mmproj)
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

    from echospec.services.common.config import CoordinatorConfig

    port = CoordinatorConfig().port   # the coordinator's default, for the example
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
             f"target is host:port, e.g. 127.0.0.1:{port} or [::1]:{port}; start a "
             f"coordinator with `echospec serve`")
    # a request above the server's message limit is a bad argument as well (the client says so)
    code = 2 if exc.code == grpc.StatusCode.INVALID_ARGUMENT or (
        exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and
        exc.details.startswith("the request is ")) else 1
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
        # the file is JSON: name what is missing or wrong in JSON's words (the client's, which
        # follow, speak Python: None, dict)
        if not isinstance(m.get("role"), str):
            _die(f'{at}messages[{i}]: "role" must be a string' + (
                f", got {json.dumps(m['role'])[:80]}" if "role" in m else ", and there is none"), 2)
        content = m.get("content")
        if not isinstance(content, (str, list)) and not (content is None and m.get("tool_calls")):
            _die(f'{at}messages[{i}]: "content" must be a string or a list of text parts' + (
                f", got {json.dumps(content)[:80]}" if "content" in m else ", and there is none"), 2)
        for j, p in enumerate(content if isinstance(content, list) else []):
            if isinstance(p, dict) and p.get("type") == "image_url":   # OpenAI's, a data URL
                _die(f"{at}messages[{i}].content[{j}]: an image_url part is not read from a "
                     f"messages file; name the image file instead (generate --image FILE, a "
                     f"bench workload's \"image\" field)", 2)
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
    from echospec_client.limits import FLOAT32_MAX, MAX_REPEAT_PENALTY, MIN_REPEAT_PENALTY

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
    for flag, name in (("--frequency-penalty", "frequency_penalty"),
                       ("--presence-penalty", "presence_penalty")):
        v = getattr(args, name, 0.0)
        if not -2.0 <= v <= 2.0:
            bad(flag, v, "must be in [-2, 2] (0: off)")
    rep = getattr(args, "repeat_penalty", None)
    if rep is not None and not MIN_REPEAT_PENALTY <= rep <= MAX_REPEAT_PENALTY:
        bad("--repeat-penalty", rep, f"must be in [{MIN_REPEAT_PENALTY:g}, {MAX_REPEAT_PENALTY:g}] (1: off)")
    last_n = getattr(args, "repeat_last_n", 0)
    if last_n < -1:
        bad("--repeat-last-n", last_n, "must be >= -1 (-1: the whole context, 0: 64)")


def _gen_kwargs(args: argparse.Namespace, messages=None, prompt: str | None = None,
                max_tokens=None, spec: str | None = None) -> dict:
    """Keyword arguments of Client.complete / Client.stream from the command line."""
    kw: dict = {}
    if messages is not None:
        _check_messages(messages)
        # the fields the client sends (a tool history's calls and ids included), nothing else
        kw["messages"] = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name") if k in m}
                          for m in messages]
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
    kw["frequency_penalty"] = float(getattr(args, "frequency_penalty", 0.0) or 0.0)
    kw["presence_penalty"] = float(getattr(args, "presence_penalty", 0.0) or 0.0)
    kw["repeat_penalty"] = getattr(args, "repeat_penalty", None)
    kw["repeat_last_n"] = int(getattr(args, "repeat_last_n", 0) or 0)
    mode = spec if spec is not None else getattr(args, "spec", None)
    kw["spec"] = {None: None, "off": False, "on": True}[mode]
    kw["k"] = int(getattr(args, "k", 0) or 0)
    if getattr(args, "prediction_file", None):
        kw["prediction"] = _read_text("--prediction-file", args.prediction_file)
    kw["draft_namespace"] = getattr(args, "draft_namespace", None) or ""
    if getattr(args, "request_tree_nodes", 0):   # generate --tree-nodes: this request's
        kw["tree_nodes"] = args.request_tree_nodes
    grammars = [(flag, kind) for flag, kind in (("--json-schema", "json_schema"), ("--lark", "lark"),
                                                ("--gbnf", "gbnf")) if getattr(args, kind, None)]
    if getattr(args, "json_object", False):
        grammars.append(("--json-object", "json_object"))
    if len(grammars) > 1:
        _die(f"{grammars[0][0]} and {grammars[1][0]}: give at most one grammar", 2)
    if grammars:
        flag, kind = grammars[0]
        kw["grammar"] = {kind: True if kind == "json_object" else _read_text(flag, getattr(args, kind))}
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
        "moves": [dataclasses.asdict(m) for m in r.moves],
        "stats": dataclasses.asdict(r.stats),
    }


def _read_text(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        _die(f"{flag} {path}: {exc.strerror}", 2)
    except UnicodeDecodeError as exc:
        _die(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})", 2)


IMAGE_MAX_BYTES = 4 * 1024 * 1024
"""The largest image file the CLI sends (the coordinator's default image_max_bytes and gRPC
message size: a larger one would be refused after the upload)."""

_IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                     (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))


def image_media_type(data: bytes) -> str:
    """The media type a file's first bytes say (PNG, JPEG, WebP, GIF), "" for none of them."""
    for sig, media in _IMAGE_SIGNATURES:
        if data.startswith(sig):
            return media
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return ""


def load_image(flag: str, path: str) -> dict:
    """An image file as a client image part ({"type": "image", "image", "media_type"}).

    Raises:
        ValueError: "<flag> <path>: ..." for a missing, unreadable, empty or oversized file, a
            directory, device or FIFO, or one that is not a PNG, JPEG, WebP or GIF image.
    """
    try:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"{flag} {path}: is a directory, not an image file")
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):   # a FIFO would block, /dev/zero never end
            raise ValueError(f"{flag} {path}: not a regular file (a device, FIFO or socket); "
                             f"name an image file")
        if st.st_size > IMAGE_MAX_BYTES:
            raise ValueError(f"{flag} {path}: the file is {st.st_size} bytes, above the limit of "
                             f"{IMAGE_MAX_BYTES} bytes of an image")
        with p.open("rb") as f:   # at most the limit, should the file grow meanwhile
            data = f.read(IMAGE_MAX_BYTES + 1)
        if len(data) > IMAGE_MAX_BYTES:
            raise ValueError(f"{flag} {path}: the file is above the limit of {IMAGE_MAX_BYTES} "
                             f"bytes of an image")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not data:
        raise ValueError(f"{flag} {path}: the file is empty")
    media = image_media_type(data)
    if not media:
        raise ValueError(f"{flag} {path}: not a PNG, JPEG, WebP or GIF image (the file starts "
                         f"with {data[:8].hex()})")
    from echospec_client import image_part
    return image_part(data, media)


def read_image(flag: str, path: str) -> dict:
    """``load_image``, a bad file ending the command (exit 2) before any call."""
    try:
        return load_image(flag, path)
    except ValueError as exc:
        _die(str(exc), 2)


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



# ---- the client commands' options ----------------------------------------------------

def _add_client_args(p: argparse.ArgumentParser,
                     json_help: str | None = "print one JSON object") -> None:
    p.add_argument("--target", type=_utf8,
                   help="coordinator host:port, e.g. 127.0.0.1:50051 (default: start a private stack)")
    p.add_argument("--model", help="GGUF file or model name (smollm2-135m, gemma3-270m) for a private "
                                   "stack (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for a private stack, in place of the model's own "
                        "(a model without one, such as gemma3-270m, needs it for chat messages)")
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
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted once per occurrence in the last --repeat-last-n "
                        "tokens (0: off, default)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted once from every token in the last --repeat-last-n "
                        "tokens (0: off, default)")
    p.add_argument("--repeat-penalty", type=float, default=None,
                   help="> 0: llama.cpp's repeat penalty over the last --repeat-last-n tokens "
                        "(1: off, default)")
    p.add_argument("--repeat-last-n", type=_int32, default=0,
                   help="tokens of prompt + output the penalties count (0: 64, default; -1: the "
                        "whole context)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2^64) (default 0, a fixed seed like any other: the "
                        "same request samples the same output; give different seeds for "
                        "different samples); greedy decoding does not use it")
    p.add_argument("--stop", action="append", type=_utf8, help="stop string (repeatable)")
    p.add_argument("--timeout", type=_seconds, default=600.0,
                   help="seconds for the connection and the call together (default 600)")


