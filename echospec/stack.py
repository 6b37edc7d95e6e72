"""Start the services together: ``start_stack`` for `echospec serve` and the tests. It starts
the draft, verifier and coordinator services, with the HTTP gateway in front of the coordinator
when ``http_port >= 0``, and so sits above all four of them (beside the CLI, not inside one).

Two modes:
    processes=False (default)  the gRPC servers in this process, each with its own port and
                               thread pool. The services talk over loopback gRPC as when
                               deployed, with two exceptions: the coordinator's GenerateTokens
                               call to a verifier of this process, and the verifier's
                               ProposeStream to a draft service of this process, go straight to
                               the servicer (services/rpc/inproc.py: no serialization, no
                               HTTP/2), while their other calls still cross gRPC. Fast to
                               start; what the tests use.
    processes=True             child processes (python -m echospec.services.draft /
                               .verifier / .coordinator / .gateway), as docker-compose runs
                               them: every call crosses loopback gRPC; closer to the
                               deployment (no shared GIL).
Every port defaults to 0 (a free port); the coordinator's is the public one.
The draft and verifier start first; the coordinator waits for the verifier.

In process mode a child that dies is seen by ``Stack.exited`` (the verifier, coordinator or
gateway: the stack cannot serve without it) or ``Stack.revive`` (the draft service: optional,
since a verifier without it decodes plainly with the same output; restarted on its port up to
DRAFT_RESTARTS times).

Example:
    stack = start_stack(os.path.expanduser("~/.cache/echospec/SmolLM2-135M-Instruct.Q4_1.gguf"), port=50051, spec=True)
    # or, with the config objects (what `echospec serve` builds from its command line):
    # stack = start(StackConfigs(coordinator=CoordinatorConfig(model=path, spec=True)))
    print(stack.target)      # "127.0.0.1:50051"
    stack.stop()
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echospec.services.common import logs
from echospec.services.rpc import grpc_util
from echospec.services.rpc.grpc_util import host_port
from echospec.services.common.config import (CoordinatorConfig, DraftConfig, GatewayConfig,
                                             VerifierConfig, setting_fields, setting)
from echospec.services.rpc.lifecycle import PARENT_ENV, STOP_REASON_ENV

ROOT = Path(__file__).resolve().parents[1]
DRAFT_RESTARTS = 3     # times `revive` starts a dead draft child again
STOP_ORDER = ("gateway", "coordinator", "verifier", "draft")   # each before the one it calls
STOP_SLACK_S = 10.0    # seconds past the grace for all the children together, then SIGKILL
EXIT_AFTER_GRACE_S = 1.0   # a service's own exit once its grace has ended (the next is not held)


class StackError(RuntimeError):
    """A service of the stack could not start (the message says which and why)."""


@dataclass
class Stack:
    """Handles of a running stack. ``target`` is the coordinator's host:port."""

    host: str
    coordinator_port: int
    verifier_port: int
    draft_port: int
    processes: bool
    _servers: dict[str, Any] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _stderr: dict[str, Any] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)   # service -> bound /metrics port
    _launch: dict[str, tuple] = field(default_factory=dict)      # name -> (argv, env) of its child
    _restarts: dict[str, int] = field(default_factory=dict)      # name -> times revive restarted it
    _termed: dict[str, float] = field(default_factory=dict)      # name -> when stop() sent SIGTERM
    _reason_file: str = ""        # where stop() leaves its reason for the children (lifecycle.py)
    http_port: int = 0            # the gateway's port (0: no gateway)
    tls: bool = False             # the services listen with TLS (the gateway with HTTPS)

    @property
    def http_url(self) -> str:
        """The gateway's base URL, e.g. "http://127.0.0.1:8000" ("" without a gateway)."""
        if not self.http_port:
            return ""
        return f"{'https' if self.tls else 'http'}://{host_port(self.host, self.http_port)}"

    @property
    def target(self) -> str:
        return host_port(self.host, self.coordinator_port)

    @property
    def verifier_target(self) -> str:
        return host_port(self.host, self.verifier_port)

    @property
    def draft_target(self) -> str:
        return host_port(self.host, self.draft_port)

    @property
    def verifier(self) -> Any:
        """The in-process VerifierServer (threads mode only)."""
        return self._servers.get("verifier")

    def _death(self, name: str) -> str:
        """ "<name> service exited with status -9 (SIGKILL)", with ": <its last log line>" when
        that line says something about the failure (``failure_line``): a WARNING, ERROR or
        CRITICAL record, a traceback's last line, a service's one-line error; not an INFO line,
        such as its startup line when it was killed from outside."""
        rc = self._procs[name].returncode
        how = f"status {rc}"
        if rc < 0:
            try:
                how += f" ({signal.Signals(-rc).name})"
            except ValueError:
                pass
        tee = self._stderr.get(name)
        last = failure_line(tee.last(0.5)) if tee is not None else ""
        return f"{name} service exited with {how}" + (f": {last}" if last else "")

    def exited(self) -> str:
        """In process mode, what ended a child service the stack cannot serve without (the
        verifier, coordinator or gateway) that is no longer running: e.g. "verifier service
        exited with status -9 (SIGKILL)", or "verifier service exited with status 1: <its last
        log line>" when that line tells why (``_death``); "" while they run (and always in
        threads mode). The others keep running until stop(). The draft service is ``revive``'s."""
        for name in ("verifier", "coordinator", "gateway"):
            p = self._procs.get(name)
            if p is not None and p.poll() is not None:
                return self._death(name)
        return ""

    def revive(self) -> list[str]:
        """In process mode, restart a draft child that died (on its port, up to DRAFT_RESTARTS
        times; the verifier reconnects by itself and decodes plainly meanwhile). Call it from the
        thread that started the stack (the child dies with that thread, lifecycle.py).

        Returns:
            One message per death found, saying its cause and what follows: e.g. "draft service
            exited with status -9 (SIGKILL); the verifier decodes plainly without it (same
            output) until it is back; restarted it (1 of 3)" (``_death`` says when the child's
            last log line is quoted). [] when nothing died.
        """
        p = self._procs.get("draft")
        if p is None or p.poll() is None or "draft" not in self._launch:
            return []
        msg = (f"{self._death('draft')}; the verifier decodes plainly without it (same output, "
               f"spec_reason says so)")
        n = self._restarts.get("draft", 0)
        if n >= DRAFT_RESTARTS:
            del self._procs["draft"]
            return [f"{msg}; not restarted again after {n} restarts: speculation stays off "
                    f"until the stack is restarted"]
        self._restarts["draft"] = n + 1
        self._spawn("draft")
        return [f"{msg} until it is back; restarted it ({n + 1} of {DRAFT_RESTARTS})"]

    def _spawn(self, name: str) -> subprocess.Popen:
        argv, env = self._launch[name]
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        self._procs[name] = p
        self._termed.pop(name, None)
        self._stderr[name] = _StderrTee(p, name)
        return p

    def kill_draft(self) -> None:
        """Stop the draft service abruptly (SIGKILL in process mode, no grace in threads mode)."""
        if self.processes:
            p = self._procs.get("draft")
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        else:
            handle, _ = self._servers.pop("draft", (None, None))
            if handle is not None:
                handle.stop(0).wait()

    def stop(self, grace_s: float = 1.0, reason: str = "", slack_s: float = STOP_SLACK_S) -> None:
        """Stop gateway, coordinator, then verifier, then draft (graceful: calls in flight get
        grace_s seconds, then end with UNAVAILABLE naming ``reason``, e.g. "SIGTERM"; in process
        mode each child gets SIGTERM, which names itself, and ``reason`` too unless it is a
        signal's name: "SIGTERM from echospec serve, because <reason>"). Idempotent.

        In process mode a child gets its SIGTERM (after a SIGCONT, which wakes a stopped one)
        once the children before it have exited, or have had their grace and
        EXIT_AFTER_GRACE_S more: a service's calls in flight keep the services below it during
        its grace, and a child that does not exit holds the others back no longer. All of them
        share one deadline, grace_s + slack_s seconds after the first SIGTERM; a child still
        running then (hung, or stopped again) gets SIGKILL. Past its grace, one "echospec:"
        line on stderr names the children still running and when they will be killed."""
        if self.processes:
            if reason and reason not in signal.Signals.__members__ and self._reason_file:
                try:
                    Path(self._reason_file).write_text(reason)
                except OSError:
                    pass
            self._stop_children(grace_s, slack_s)
            if self._reason_file:
                Path(self._reason_file).unlink(missing_ok=True)
                self._reason_file = ""
            return
        g = self._servers.pop("gateway", None)
        if g is not None:
            g.stop(grace_s, reason)
        c = self._servers.pop("coordinator", None)
        if c is not None:
            c.stop(grace_s, reason)
        v = self._servers.pop("verifier", None)
        if v is not None:
            v.stop(grace_s, reason)
        d = self._servers.pop("draft", None)
        if d is not None:
            d[0].stop(grace_s, reason).wait()

    def _stop_children(self, grace_s: float, slack_s: float) -> None:
        """``stop`` in process mode: SIGTERM in STOP_ORDER, one deadline, then SIGKILL. A child
        leaves ``_procs`` once it has exited, so a stop cut short (an exception in the main
        thread) is finished by the next one, which sends no second SIGTERM: a service takes that
        one as the end of its grace."""
        children = [(n, self._procs[n]) for n in STOP_ORDER if n in self._procs]
        for n, p in children:
            if p.poll() is not None:
                del self._procs[n]
        children = [(n, p) for n, p in children if p.poll() is None]
        termed = [(n, p, self._termed[n]) for n, p in children if n in self._termed]
        waiting = [(n, p) for n, p in children if n not in self._termed]   # not signalled yet
        kill_at = time.monotonic() + grace_s + slack_s
        warned = False
        while True:
            now = time.monotonic()
            while waiting and all(p.poll() is not None or now >= t + grace_s + EXIT_AFTER_GRACE_S
                                  for _, p, t in termed):
                name, p = waiting.pop(0)
                self._termed[name] = now
                _terminate(p)
                termed.append((name, p, now))
            for n, p, _ in termed:
                if p.poll() is not None:
                    self._procs.pop(n, None)
            running = [(n, p, t) for n, p, t in termed if p.poll() is None]
            if not running and not waiting:
                return
            if now >= kill_at:
                break
            if not warned and any(now >= t + grace_s + EXIT_AFTER_GRACE_S for _, _, t in running):
                warned = True
                names = ", ".join(f"the {n} service (pid {p.pid}, SIGTERM {now - t:.1f} s ago)"
                                  for n, p, t in running)
                logs.write_stderr_line(
                    f"echospec: still waiting for {names} to exit; SIGKILL to every child still "
                    f"running in {kill_at - now:.1f} s")
            time.sleep(0.02)
        for n, p in [(n, p) for n, p, _ in termed] + waiting:
            if p.poll() is None:
                p.kill()
                p.wait()
            self._procs.pop(n, None)


def _terminate(p: subprocess.Popen) -> None:
    """SIGTERM to a child, after SIGCONT: a stopped process (SIGSTOP, SIGTSTP) holds SIGTERM
    pending until it is continued, so it would only end at the SIGKILL deadline."""
    try:
        p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
    except ProcessLookupError:   # it exited meanwhile
        pass


_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z ([A-Z]+) ")   # logs.TextFormatter


def failure_line(line: str) -> str:
    """``line`` (a child's last line on stderr) when it may say why the child ended, else "".

    An INFO or DEBUG record of the services' logs (text or JSON format, logs.py) says nothing
    of a failure: e.g. "... INFO echospec.draft draft service listening on ...", the last line
    of a child killed from outside. Anything else is kept: a WARNING, ERROR or CRITICAL record,
    a traceback's last line ("RuntimeError: ..."), a service's one-line error ("verifier:
    ..."), a message of the C runtime.
    """
    line = line.strip()
    if line in ("", "(no message)"):
        return ""
    level = ""
    m = _LOG_RECORD.match(line)
    if m:
        level = m.group(1)
    elif line.startswith("{"):
        try:
            rec = json.loads(line)
            level = str(rec.get("level", "")) if isinstance(rec, dict) else ""
        except ValueError:
            pass
    return "" if level in ("DEBUG", "INFO") else line


def _free_port(host: str) -> int:
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]   # IPv6 for "::1"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _PortHold:
    """The ports a stack was told to use (each service's, the coordinator's /metrics), bound by
    a bare socket until the service that listens on it starts. Without it the free port that the
    kernel gives a service started before (port 0: the draft service, then the verifier) could
    be one of them, since nothing listens there yet, and the later service would find its own
    port taken. A port that cannot be held (another program has it) is left
    alone: its service reports the clash when it binds."""

    def __init__(self, addrs: list[tuple[str, int]]):
        self._socks: dict[int, list[socket.socket]] = {}
        for host, port in addrs:
            if port <= 0:
                continue
            try:
                family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
                s = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            self._socks.setdefault(port, []).append(s)

    def held(self) -> list[int]:
        return sorted(self._socks)

    def release(self, *ports: int) -> None:
        for port in ports:
            for s in self._socks.pop(port, []):
                s.close()

    def close(self) -> None:
        self.release(*list(self._socks))


@setting_fields
@dataclass
class StackConfig:
    """What `echospec serve` says beyond the services' own settings: the ports of the services
    behind the coordinator (0: a free port) and how the services run."""

    verifier_port: int = setting(0, "verifier port (0: a free port)", serve="--verifier-port")
    draft_port: int = setting(0, "draft service port (0: a free port)", serve="--draft-port")
    http_port: int = setting(-1, "serve the OpenAI-compatible HTTP gateway on this port (-1: off; "
                             "0: a free port)", serve="--http-port")
    processes: bool = setting(False, "run each service in its own process", serve="--processes")


@dataclass
class StackConfigs:
    """The settings of a stack: its own and each service's. The settings every service shares
    are said once, on the coordinator's config (host, metrics_host, logging, TLS, API key, message size; the
    model, which the verifier loads), and the verifier's tls_client_ca (mTLS on the internal
    ports); ``start`` hands them to the others."""

    stack: StackConfig = field(default_factory=StackConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def parts(self) -> tuple:
        return self.stack, self.coordinator, self.verifier, self.draft, self.gateway

    def replace(self, **settings: Any) -> "StackConfigs":
        """A copy with settings by field name, each given to the config whose field is the
        `echospec serve` option of that name (tls_client_ca: the verifier's), else to the first
        of stack, coordinator, verifier, draft and gateway that has it (port: the coordinator's).

        Raises:
            TypeError: a name no config has.
        """
        parts = {"stack": self.stack, "coordinator": self.coordinator, "verifier": self.verifier,
                 "draft": self.draft, "gateway": self.gateway}
        changes: dict[str, dict] = {k: {} for k in parts}
        for name, value in settings.items():
            having = [(k, f) for k, c in parts.items() for f in dataclasses.fields(c) if f.name == name]
            owner = next((k for k, f in having if f.metadata["serve"]),
                         having[0][0] if having else None)
            if owner is None:
                raise TypeError(f"no service has a setting {name!r}")
            changes[owner][name] = value
        return StackConfigs(**{k: dataclasses.replace(c, **changes[k]) for k, c in parts.items()})


def start_stack(model_path: str, port: int = 0, spec: bool | None = None, *,
                ready_timeout_s: float = 180.0, **settings: Any) -> Stack:
    """Start draft, verifier and coordinator (and the gateway with ``http_port >= 0``): a
    keyword convenience over ``start`` for the tests and the CLI's private stacks. Every setting
    not given keeps its config dataclass's default; the ports default to 0 (a free port).

    Args:
        model_path: GGUF file (verifier model; coordinator tokenizer and chat template).
        port: coordinator port (0: a free port).
        spec: the coordinator's --spec default (None: CoordinatorConfig's).
        ready_timeout_s: seconds each service gets to report SERVING.
        settings: any field of StackConfig, CoordinatorConfig, VerifierConfig, DraftConfig or
            GatewayConfig by name (the first of them that has it): verifier_port, processes,
            n_ctx, n_threads, batch_threads, k, max_tokens, min_n, max_n, http_port, api_key,
            tls_cert, ... (see ``start`` for who shares what).
    Raises:
        StackError: a service failed to start. TypeError: an unknown setting.
    """
    if spec is not None:
        settings["spec"] = spec
    configs = StackConfigs().replace(model=str(model_path), port=port, **settings)
    return start(configs, ready_timeout_s)


def start(configs: StackConfigs, ready_timeout_s: float = 180.0) -> Stack:
    """Start draft, verifier and coordinator on the coordinator's host, with the HTTP gateway in
    front when ``configs.stack.http_port >= 0``.

    The coordinator's config holds what the services share: host, log_level, log_format,
    max_message_bytes, tls_cert and tls_key (every service listens with TLS; the certificate
    must name the host), tls_ca (the CA with which the services verify each other; "": tls_cert
    itself, right for a self-signed certificate), api_key (the coordinator's and the gateway's;
    passed to child processes in the environment, never on a command line), internal_key (the
    verifier and draft ports demand it, the coordinator and verifier send it; in the environment
    too) and the model (the verifier's too). The verifier's tls_client_ca makes the internal ports (verifier, draft)
    demand client certificates it signed (mTLS); the coordinator and verifier present tls_cert.
    The coordinator's metrics_port is the stack's /metrics (-1: off, 0: a free port), on its
    metrics_host (loopback by default, whatever host says), the others' too: in threads
    mode one for the three services; in process mode the verifier and draft each serve theirs
    on a free port (``Stack.metrics_ports``). The gateway's own (its HTTP requests, another
    registry) is on a free port of its own in both modes (``Stack.metrics_ports["gateway"]``).

    processes=True runs each service in its own process (see the module docstring). Each child
    gets SIGTERM when the thread that started it ends (Linux PR_SET_PDEATHSIG, see
    services/rpc/lifecycle.py), so call this from a thread that outlives the stack: the main
    thread, as `echospec serve` does.

    Returns:
        A Stack with the bound ports; call ``stop()`` when done.
    Raises:
        StackError: a service failed to start (port taken, model unusable, ...).
    """
    st, c, v, d, g = configs.parts()
    ca = (c.tls_ca or c.tls_cert) if c.tls_cert else ""
    shared = {"host": c.host, "log_level": c.log_level, "log_format": c.log_format,
              "tls_cert": c.tls_cert, "tls_key": c.tls_key, "tls_ca": ca}
    side = c.metrics_port >= 0 and st.processes   # the verifier's and draft's own /metrics
    c = dataclasses.replace(c, tls_ca=ca)
    mh = c.metrics_host
    ik = c.internal_key   # the verifier and draft check it; the coordinator and verifier send it
    # a draft session holds a generation's history (at most the verifier's n_ctx) and its prediction
    dcfg = dataclasses.replace(d, **shared, internal_key=ik, port=st.draft_port,
                               max_history=max(d.max_history, 2 * v.n_ctx), tls_client_ca=v.tls_client_ca,
                               max_message_bytes=c.max_message_bytes, metrics_host=mh,
                               metrics_port=_free_port(mh) if side else -1)
    vcfg = dataclasses.replace(v, **shared, internal_key=ik, model=c.model, port=st.verifier_port,
                               max_message_bytes=c.max_message_bytes, metrics_host=mh,
                               metrics_port=_free_port(mh) if side else -1)
    gcfg = None
    if st.http_port >= 0:
        gcfg = dataclasses.replace(g, **shared, port=st.http_port, api_key=c.api_key,
                                   api_keys_file=c.api_keys_file, metrics_host=mh,
                                   metrics_port=_free_port(mh) if c.metrics_port >= 0 else -1)
    hold = _PortHold([(c.host, st.draft_port), (c.host, st.verifier_port), (c.host, c.port),
                      (mh, c.metrics_port)]
                     + ([(gcfg.host, gcfg.port)] if gcfg is not None else []))
    try:
        if st.processes:
            return _start_processes(dcfg, vcfg, c, gcfg, ready_timeout_s, hold)
        return _start_threads(dcfg, vcfg, c, gcfg, ready_timeout_s, hold)
    finally:
        hold.close()


def _start_threads(dcfg: DraftConfig, vcfg: VerifierConfig, ccfg: CoordinatorConfig,
                   gcfg: GatewayConfig | None, ready_timeout_s: float, hold: _PortHold) -> Stack:
    from echospec.services.coordinator import server as cserver
    from echospec.services.draft import server as dserver
    from echospec.services.verifier import server as vserver

    from echospec.services.common.metrics import RpcMetrics

    stack = Stack(ccfg.host, 0, 0, 0, processes=False, tls=bool(ccfg.tls_cert))
    rpc_metrics = RpcMetrics()   # one registry for the three servers of this process
    try:
        hold.release(dcfg.port, dcfg.metrics_port)
        try:
            dhandle = dserver.start(dcfg, rpc_metrics)
        except Exception as exc:
            raise StackError(f"draft service: {exc}") from exc
        stack._servers["draft"] = dhandle
        stack.draft_port = dhandle[0].port
        vcfg = dataclasses.replace(vcfg, draft_target=host_port(dcfg.host, stack.draft_port))
        hold.release(vcfg.port, vcfg.metrics_port)
        try:
            v = vserver.start(vcfg, rpc_metrics)
        except Exception as exc:
            raise StackError(f"verifier: {exc}") from exc
        stack._servers["verifier"] = v
        stack.verifier_port = v.port
        ccfg = dataclasses.replace(ccfg, verifier_target=host_port(vcfg.host, v.port),
                                   draft_target=host_port(dcfg.host, stack.draft_port))
        hold.release(ccfg.port, ccfg.metrics_port)
        try:
            c = cserver.start(ccfg, verifier_wait_s=ready_timeout_s, rpc_metrics=rpc_metrics)
        except Exception as exc:
            raise StackError(f"coordinator: {exc}") from exc
        stack._servers["coordinator"] = c
        stack.coordinator_port = c.port
        if c.metrics_port:
            stack.metrics_ports["coordinator"] = c.metrics_port
        if gcfg is not None:
            from echospec.services.gateway import server as gserver
            gcfg = dataclasses.replace(gcfg, coordinator_target=host_port(ccfg.host, c.port))
            hold.release(gcfg.port)
            try:
                g = gserver.start(gcfg)
            except Exception as exc:
                raise StackError(f"gateway: {exc}") from exc
            stack._servers["gateway"] = g
            stack.http_port = g.port
            if g.metrics_port >= 0:
                stack.metrics_ports["gateway"] = g.metrics_port
    except BaseException:
        stack.stop(0)
        raise
    return stack


def _args(cfg: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("api_key", "internal_key"):   # secrets: in the environment, not in `ps`
            continue
        opt = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(opt if v else "--no-" + f.name.replace("_", "-"))
        elif isinstance(v, tuple):
            for item in v:
                out += [opt, str(item)]
        else:
            out += [opt, str(v)]
    return out


def _start_processes(dcfg: DraftConfig, vcfg: VerifierConfig, ccfg: CoordinatorConfig,
                     gcfg: GatewayConfig | None, ready_timeout_s: float, hold: _PortHold) -> Stack:
    host = ccfg.host
    dcfg = dataclasses.replace(dcfg, port=dcfg.port or _free_port(host))
    vcfg = dataclasses.replace(vcfg, port=vcfg.port or _free_port(host),
                               draft_target=host_port(dcfg.host, dcfg.port))
    ccfg = dataclasses.replace(ccfg, port=ccfg.port or _free_port(host),
                               verifier_target=host_port(vcfg.host, vcfg.port),
                               draft_target=host_port(dcfg.host, dcfg.port),
                               metrics_port=(_free_port(ccfg.metrics_host) if ccfg.metrics_port == 0
                                             else ccfg.metrics_port))
    stack = Stack(host, ccfg.port, vcfg.port, dcfg.port, processes=True, tls=bool(ccfg.tls_cert))
    services = [("draft", dcfg, "echospec.v1.DraftService"),
                ("verifier", vcfg, "echospec.v1.VerifierService"),
                ("coordinator", ccfg, "echospec.v1.CoordinatorService")]
    if gcfg is not None:
        gcfg = dataclasses.replace(gcfg, port=gcfg.port or _free_port(host),
                                   coordinator_target=host_port(ccfg.host, ccfg.port))
        services.append(("gateway", gcfg, ""))
    env = dict(os.environ)
    env.pop("ECHOSPEC_API_KEY", None)
    if ccfg.api_key:
        env["ECHOSPEC_API_KEY"] = ccfg.api_key
    env.pop("ECHOSPEC_INTERNAL_KEY", None)
    if ccfg.internal_key:   # the coordinator's, the verifier's and the draft service's
        env["ECHOSPEC_INTERNAL_KEY"] = ccfg.internal_key
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[PARENT_ENV] = str(os.getpid())   # each child dies with this process (lifecycle.py)
    fd, stack._reason_file = tempfile.mkstemp(prefix="echospec-stop-")
    os.close(fd)
    env[STOP_REASON_ENV] = stack._reason_file
    try:
        for name, cfg, svc in services:
            stack._launch[name] = ([sys.executable, "-m", f"echospec.services.{name}",
                                    *_args(cfg)], env)
            hold.release(cfg.port, cfg.metrics_port)
            p = stack._spawn(name)
            if name == "gateway":
                _wait_port(name, p, stack._stderr[name], cfg.host, cfg.port, ready_timeout_s)
                stack.http_port = cfg.port
                if cfg.metrics_port >= 0:
                    stack.metrics_ports[name] = cfg.metrics_port
                continue
            tls = grpc_util.Tls(cfg.tls_cert, cfg.tls_key, ca=cfg.tls_ca)
            _wait_process(name, p, stack._stderr[name], host_port(cfg.host, cfg.port), svc,
                          ready_timeout_s, tls)
            if cfg.metrics_port >= 0:
                stack.metrics_ports[name] = cfg.metrics_port
    except BaseException:
        stack.stop(0)
        raise
    return stack


class _StderrTee:
    """Copy a child's stderr lines to ours (its logs) and keep the last ones for error messages.
    The pipe is always drained, so a child that logs a lot never blocks on it."""

    def __init__(self, p: subprocess.Popen, name: str, keep: int = 20):
        self.lines: list[str] = []
        self._keep = keep
        self._thread = threading.Thread(target=self._run, args=(p,), name=f"stderr-{name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, p: subprocess.Popen) -> None:
        for raw in p.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines = (self.lines + [line])[-self._keep:]
            try:
                logs.write_stderr_line(raw)
            except (OSError, ValueError):   # our stderr is closed: keep draining
                pass

    def last(self, timeout_s: float = 2.0) -> str:
        """The last non-empty line once the child's stderr is closed."""
        self._thread.join(timeout_s)
        lines = [ln for ln in self.lines if ln.strip()]
        return lines[-1].strip() if lines else "(no message)"


def _wait_port(name: str, p: subprocess.Popen, tee: _StderrTee, host: str, port: int,
               timeout_s: float) -> None:
    """Wait until the child accepts TCP connections on host:port (the gateway)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if p.poll() is not None:
            raise StackError(f"{name} exited with status {p.returncode}: {tee.last()}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise StackError(f"{name}: not listening on {host_port(host, port)} after "
                                 f"{timeout_s:.0f} s")
            time.sleep(0.05)


def _wait_process(name: str, p: subprocess.Popen, tee: _StderrTee, target: str, service: str,
                  timeout_s: float, tls: grpc_util.Tls | None = None) -> None:
    from echospec.services.coordinator.server import wait_serving

    ch = grpc_util.channel(target, 1 << 20, tls)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if p.poll() is not None:
                raise StackError(f"{name} exited with status {p.returncode}: {tee.last()}")
            try:
                wait_serving(ch, service, min(1.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise StackError(f"{name}: {exc}") from None
    finally:
        ch.close()
