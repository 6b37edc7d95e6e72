"""Process lifecycle of a service started by `echospec serve --processes` (echospec/stack.py).

`exit_with_parent` is the first thing each service's ``__main__`` does: when the parent that
started it (named by ECHOSPEC_PARENT_PID) dies in any way, even SIGKILL, the kernel sends this
process SIGTERM (Linux PR_SET_PDEATHSIG), so no service outlives the `echospec serve` that
started it and keeps holding its port. The kernel's trigger is the end of the parent *thread*
that forked the child, so the parent starts its children from its main thread.

`stop_reason` names why the parent stopped the stack (a child service that died), so the calls
a service cancels at shutdown say the real cause, not only SIGTERM.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "ECHOSPEC_PARENT_PID"
# a file where the parent writes why it stops the stack before it sends SIGTERM to each child
STOP_REASON_ENV = "ECHOSPEC_STOP_REASON_FILE"
_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Ask for SIGTERM when the parent named by ECHOSPEC_PARENT_PID dies; exit at once if it is
    already gone. A no-op without the variable or off Linux."""
    want = os.environ.get(PARENT_ENV)
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != want:   # the parent died before prctl took effect
        os._exit(1)


def stop_reason(signame: str) -> str:
    """Why this service stops on ``signame``: the signal's name, followed by the reason the
    parent `echospec serve` left in STOP_REASON_ENV's file when it stopped the stack, e.g.
    "SIGTERM from echospec serve, because the verifier service exited with status -9 (SIGKILL)"."""
    path = os.environ.get(STOP_REASON_ENV)
    if not path:
        return signame
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            why = f.read(500).strip()
    except OSError:
        return signame
    return f"{signame} from echospec serve, because {why}" if why else signame


def service_main(name: str, config_cls, serve, argv=None, errors: tuple = (),
                 needs_model: bool = False, check=None) -> int:
    """The body of `python -m echospec.services.NAME`: settings from argv and ECHOSPEC_*,
    logging, then serve(config) until SIGINT/SIGTERM.

    ``check(config)`` (optional) raises ValueError for settings the service cannot use; like
    a setting that does not parse, that exits 2.

    Returns the exit status: 2 for bad settings (a log option, a ``check`` refusal, or no model
    where needs_model), 1 when serve raises one of ``errors`` (a busy port, an unreadable model, ...), each with a
    one-line message on stderr; 0 after a clean stop.
    """
    from echospec.services.common import config as cfg
    from echospec.services.common import logs

    conf = cfg.load(config_cls, argv, prog=f"python -m echospec.services.{name}")
    try:
        logs.setup(conf.log_level, conf.log_format)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    if needs_model and not conf.model:
        print(f"{name}: no model (--model PATH or ECHOSPEC_MODEL)", file=sys.stderr)
        return 2
    if check is not None:
        try:
            check(conf)
        except ValueError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
    busy = _port_problem(getattr(conf, "host", ""), getattr(conf, "port", 0))
    if busy:   # said before gRPC's own log lines of a failed bind
        print(f"{name}: {busy} (--port / ECHOSPEC_PORT)", file=sys.stderr)
        return 1
    try:
        serve(conf)
    except errors as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    return 0


def bind_problem(host: str, port: int) -> tuple[str, str]:
    """Whether host:port can be listened on now (port 0: whether host is an address of this
    machine): ("", "") when it can, else ("host", why) for a host name that does not resolve,
    ("busy", "") for a port in use, or ("other", why)."""
    import errno
    import socket

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return "host", exc.strerror or str(exc)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return ("busy", "") if exc.errno == errno.EADDRINUSE else ("other", exc.strerror or str(exc))
    return "", ""


def _port_problem(host: str, port: int) -> str:
    """Why a service cannot listen on host:port ("" when it can, or for port 0 or no host; a bad
    host is left to the server, which names it)."""
    kind, why = bind_problem(host, port) if host and port > 0 else ("", "")
    if kind == "busy":
        return f"port {host}:{port} is already in use"
    if kind == "other":
        return f"cannot listen on {host}:{port}: {why}"
    return ""
