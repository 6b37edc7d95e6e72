"""The `echospec` command line: serve, generate, chat, tokenize, detokenize, bench.

    echospec serve [--port P] [--model PATH] [--spec] [--http-port P] [--api-key K]
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
import signal
import sys

# numpy is only used for buffers here; its OpenBLAS worker threads would spin on the
# cores the engine computes on, so keep OpenBLAS to one thread (before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib  # noqa: E402

from echospec.cli.common import (Interrupted, _install_signal_handlers, _int32,  # noqa: E402
                                 _raise_if_interrupted, _seconds)

# The command modules load when the parser is built (after `main` has set GRPC_VERBOSITY: they
# import grpc through the client and the services' config). Their functions are reachable as
# echospec.cli.NAME too.
COMMANDS = ("serve", "generate", "chat", "tokens", "bench")
_NAMES = {"cmd_serve": "serve", "_exposure_warning": "serve", "cmd_generate": "generate",
          "cmd_chat": "chat", "cmd_tokenize": "tokens", "cmd_detokenize": "tokens",
          "cmd_bench": "bench", "_load_workloads": "bench", "_say": "common",
          "_default_model": "common", "_resolve_model": "common", "_gen_kwargs": "common"}


def __getattr__(name: str):
    if name in COMMANDS or name == "common":
        return importlib.import_module(f"echospec.cli.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"echospec.cli.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'echospec.cli' has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    from echospec.cli import bench, chat, generate, prior, serve, tokens

    ap = argparse.ArgumentParser(prog="echospec", description="Speculative-decoding LLM service on CPUs.")
    ap.add_argument("--version", action="version", version=f"echospec {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve.add_parser(sub)
    generate.add_parser(sub)
    chat.add_parser(sub)
    tokens.add_parsers(sub)
    bench.add_parser(sub)
    prior.add_parser(sub)
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


class OutputFailed(Exception):
    """Writing the command's output failed (a full disk, /dev/full, an I/O error)."""


class _Output:
    """Standard output, whose write errors are OutputFailed (BrokenPipeError stays itself: the
    reader went away, handled as SIGPIPE would be)."""

    def __init__(self, stream):
        self._stream = stream

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.strerror or str(exc)) from None

    def write(self, text: str) -> int:
        return self._call(self._stream.write, text)

    def flush(self) -> None:
        self._call(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Standard output to /dev/null, so the flush at exit does not fail again."""
    stream = getattr(sys.stdout, "_stream", sys.stdout)
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """The `echospec` command. SIGINT/SIGTERM are handled from here on: `serve` stops what it
    started (also mid-startup) and exits 0; the client commands exit 130 (SIGINT) or 143."""
    _install_signal_handlers()
    # the subcommand from the raw arguments: a signal may land while they are still being parsed
    raw = sys.argv[1:] if argv is None else argv
    serving = next((a for a in raw if not a.startswith("-")), None) == "serve"
    if sys.stderr is None:   # closed (2>&-): print(file=None) would write the messages to stdout
        sys.stderr = open(os.devnull, "w")
    if sys.stdout is None:   # closed (>&-)
        if not serving:
            print("echospec: standard output is closed: nowhere to write the output", file=sys.stderr)
            return 1
        sys.stdout = open(os.devnull, "w")
    elif not serving and not isinstance(sys.stdout, _Output):
        sys.stdout = _Output(sys.stdout)
    if not serving and "GRPC_VERBOSITY" not in os.environ:
        # gRPC core's own log lines (a failed TLS handshake, ...) are not for the user of a client
        # command: the command says what went wrong. Read when grpc loads, which is later.
        os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        try:
            args = parse_args(argv)
            return args.fn(args)
        except Exception:
            # a signal's exception can come back as another: an extension module whose init it
            # interrupts (grpc's cygrpc) reports an ImportError. The signal is what happened.
            _raise_if_interrupted()
            raise
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
        # SIGPIPE would
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except OutputFailed as exc:
        _discard_stdout()
        print(f"echospec: cannot write the output: {exc}", file=sys.stderr)
        return 1


