"""`echospec serve`: the draft, verifier and coordinator services (and the HTTP gateway) together,
until SIGINT or SIGTERM. Its options are the config dataclasses' settings that say so
(services/common/config.py), with their defaults; the stack's own are echospec.stack.StackConfig."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from echospec.cli.common import (Interrupted, _check_bind, _check_ca, _check_chat_template, _check_draft_prior,
                                 _check_mmproj, _check_model,
                                 _resolve_model, _die, _raise_if_interrupted, _say, _ssl_reason, _url_host, _utf8)
from echospec.services.common.config import CoordinatorConfig, check_ranges, setting_name
from echospec.stack import StackConfigs

SHUTDOWN_GRACE_S = 2.0   # seconds requests in flight get to finish on SIGINT/SIGTERM


def _exposure_warning(host: str, api_key: str, mtls: bool, internal_key: str = "") -> str:
    """"" for a loopback --host; else what the address exposes that README's "Exposure" says to
    protect: the internal verifier and draft ports (without mTLS or an internal key), and the
    coordinator and the gateway (without an API key)."""
    import ipaddress

    h = host.strip("[]")
    try:
        if h == "localhost" or ipaddress.ip_address(h).is_loopback:
            return ""
    except ValueError:
        pass   # a host name: it may resolve to a public address
    parts = []
    if not mtls and not internal_key:
        parts.append("the internal verifier and draft ports listen there too, where anyone who "
                     "reaches them can open sessions (add --internal-key or --tls-client-ca, or "
                     "keep the address on a private network)")
    if not api_key:
        parts.append("the coordinator and the gateway answer anyone (add --api-key)")
    return f"--host {host} is not loopback: " + "; ".join(parts) if parts else ""


PARTS = ("stack", "coordinator", "verifier", "draft", "gateway")   # StackConfigs' fields


def serve_fields() -> list[tuple[str, dataclasses.Field]]:
    """(part of StackConfigs, field) of every setting `echospec serve` offers: the fields whose
    metadata names a serve option (services/common/config.py's ``setting``)."""
    return [(part, f) for part, cfg in zip(PARTS, StackConfigs().parts())
            for f in dataclasses.fields(cfg) if f.metadata.get("serve")]


def _serve_help(f: dataclasses.Field) -> str:
    """The option's help: the field's, with its default and range where it has them."""
    md, default = f.metadata, f.default
    text = md["serve_help"]
    if isinstance(default, bool) or default == "" or "(default" in text:
        return text
    extra = ""
    if md["range"]:
        lo, hi, _ = md["range"]
        if isinstance(hi, str):   # another setting's default (k_max for k)
            hi = getattr(CoordinatorConfig(), hi)
        extra = f", in [{lo}, {hi}]"
    return f"{text} (default {default}{extra})"


def add_parser(sub) -> None:
    """The `serve` parser, built from the config dataclasses: one option per setting it offers,
    with the field's default (dest: the field's name)."""
    p = sub.add_parser("serve", help="start the draft, verifier and coordinator services on loopback")
    for _, f in serve_fields():
        md = f.metadata
        if isinstance(f.default, bool):
            p.add_argument(md["serve"], dest=f.name, default=f.default,
                           action="store_false" if md["negated"] else "store_true",
                           help=_serve_help(f))
        elif f.name == "model":   # not given: the default model ("" is refused)
            p.add_argument(md["serve"], dest=f.name, default=None, help=_serve_help(f),
                           metavar="MODEL")
        elif f.name in ("api_key", "internal_key"):   # not given: the variable ("" is refused)
            p.add_argument(md["serve"], dest=f.name, default=None,
                           help=f"{md['serve_help']} (default: env {md['env']})")
        else:
            # file paths (the model, the TLS files) may hold any bytes; other text must be UTF-8
            kind = type(f.default)
            if kind is str and f.name != "model" and not f.name.startswith("tls_"):
                kind = _utf8
            p.add_argument(md["serve"], dest=f.name, default=f.default, type=kind,
                           choices=md["choices"] or None, help=_serve_help(f),
                           metavar=None if md["choices"] else md["serve"][2:].replace("-", "_").upper())
    p.set_defaults(fn=cmd_serve)


def _serve_flag(name: str) -> str:
    """A setting as `echospec serve` spells it ("--threads" for n_threads)."""
    return next((f.metadata["serve"] for _, f in serve_fields() if f.name == name),
                setting_name(name))


def configs_of(args: argparse.Namespace) -> StackConfigs:
    """The stack's settings from `serve`'s parsed options (the rest: the dataclasses' defaults)."""
    base = StackConfigs()
    changes: dict[str, dict] = {part: {} for part in PARTS}
    for part, f in serve_fields():
        value = getattr(args, f.name)
        changes[part][f.name] = "" if f.name == "model" and value is None else value
    return StackConfigs(**{part: dataclasses.replace(cfg, **changes[part])
                           for part, cfg in zip(PARTS, base.parts())})


_PATH_SETTINGS = ("mmproj", "tls_cert", "tls_key", "tls_ca", "tls_client_ca", "api_keys_file",
                  "chat_template")


def _absolute_paths(configs: StackConfigs) -> StackConfigs:
    """``configs`` with its file settings (and a --draft-prior file) made absolute from the
    caller's directory: the services read them there also as --processes children, which run
    in another directory. The model is made absolute once resolved (a name is no path)."""
    from echospec.services.draft.prior import setting_kind

    parts = {}
    for f in dataclasses.fields(configs):
        cfg = getattr(configs, f.name)
        if not dataclasses.is_dataclass(cfg):
            continue
        names = {g.name for g in dataclasses.fields(cfg)}
        changes = {n: os.path.abspath(getattr(cfg, n)) for n in _PATH_SETTINGS
                   if n in names and getattr(cfg, n)}
        if "draft_prior" in names and setting_kind(cfg.draft_prior) == "file":
            changes["draft_prior"] = os.path.abspath(cfg.draft_prior)
        if changes:
            parts[f.name] = dataclasses.replace(cfg, **changes)
    return dataclasses.replace(configs, **parts) if parts else configs


def cmd_serve(args: argparse.Namespace) -> int:
    from echospec.services.common.auth import check_api_key
    from echospec.stack import StackError, start

    model_given = args.model is not None   # left out: the default model ("" given: refused)

    for name, flag, env, what in (("api_key", "--api-key", "ECHOSPEC_API_KEY", "the API key"),
                                  ("internal_key", "--internal-key", "ECHOSPEC_INTERNAL_KEY",
                                   "the internal key")):
        value = getattr(args, name)
        if value == "":
            # `--api-key "$KEY"` with KEY unset would otherwise start a server that answers anyone
            _die(f'{flag} "": an empty key turns the check off; give a key, or leave {flag} out '
                 "for a server without one", 2)
        given = value is not None
        value = value if given else os.environ.get(env, "")
        setattr(args, name, value)
        try:
            check_api_key(value, what)
        except ValueError as exc:
            _die(f"{flag if given else env}: {exc}", 2)
    if args.api_keys_file:   # an unusable keys file stops serve before a model is loaded
        from echospec.services.common.tenants import Tenants
        try:
            Tenants.load(args.api_keys_file)
        except ValueError as exc:
            _die(f"--api-keys-file: {exc}", 2)
    configs = configs_of(args)
    for cfg in configs.parts():
        try:
            check_ranges(cfg, _serve_flag)
        except ValueError as exc:
            _die(str(exc), 2)
    _check_tls(args)
    st, c = configs.stack, configs.coordinator
    ports = [p for p in (c.port, st.verifier_port, st.draft_port, max(st.http_port, 0)) if p]
    if len(set(ports)) != len(ports):
        _die("--port, --verifier-port, --draft-port and --http-port must differ", 2)
    if c.metrics_port > 0 and c.metrics_port in ports:
        _die(f"--metrics-port {c.metrics_port} is also a service port", 2)
    from echospec.services.common import logs
    logs.setup(c.log_level, c.log_format)
    # ports first: a busy one is reported before the model is fetched or loaded
    for name, flag, port in (("coordinator", "--port", c.port),
                             ("verifier", "--verifier-port", st.verifier_port),
                             ("draft", "--draft-port", st.draft_port),
                             ("gateway", "--http-port", max(st.http_port, 0))):
        _check_bind(name, flag, c.host, port)
    _check_bind("metrics", "--metrics-port", c.metrics_host, max(c.metrics_port, 0),
                "--metrics-host")
    if c.chat_template:   # a bad file is named before the model is fetched or loaded
        c = dataclasses.replace(c, chat_template=_check_chat_template(c.chat_template))
        configs = dataclasses.replace(configs, coordinator=c)
    configs = _absolute_paths(configs)
    for env in ("ECHOSPEC_PRIORS", "ECHOSPEC_CACHE"):   # where --draft-prior auto looks, also in a child
        if os.environ.get(env):
            os.environ[env] = os.path.abspath(os.environ[env])
    c = configs.coordinator
    # the file's absolute path: --processes children run in another directory
    model = os.path.abspath(_resolve_model(c.model if model_given else None))
    _check_model(model, configs.verifier.check_weights)
    _check_mmproj(configs.verifier.mmproj, model)
    _check_draft_prior(configs.verifier.draft_prior, model)
    _say(f"loading {model} ...")
    try:
        stack = start(dataclasses.replace(configs, coordinator=dataclasses.replace(c, model=model)))
    except StackError as exc:
        msg = str(exc)
        if "metrics port" in msg:
            msg += " (--metrics-port)"
        _die(msg)
    api_key = args.api_key or args.api_keys_file   # either: clients need a key
    # the stack is running: a signal from here on (the announcement included) stops it
    try:
        _say(f"draft service    listening on {stack.draft_target}")
        _say(f"verifier service listening on {stack.verifier_target}")
        for name, mp in sorted(stack.metrics_ports.items()):
            who = name if args.processes or name == "gateway" else "all services"
            _say(f"metrics          on http://{_url_host(args.metrics_host)}:{mp}/metrics ({who})")
        if stack.http_url:
            _say(f"HTTP gateway     on {stack.http_url}/v1 (OpenAI-compatible)")
        security = ", ".join(s for s in ("TLS" if args.tls_cert else "",
                                         "mTLS on internal ports" if args.tls_client_ca else "",
                                         "internal key required" if args.internal_key else "",
                                         "API key required" if api_key else "",
                                         "tenants' keys" if args.api_keys_file else "") if s)
        _say(f"coordinator      listening on {stack.target} (spec default: "
             f"{'on' if args.spec else 'off'}{'; ' + security if security else ''}); "
             f"Ctrl-C stops")
        warning = _exposure_warning(args.host, api_key, bool(args.tls_client_ca),
                                    args.internal_key)
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


