"""`echospec serve` stops cleanly on SIGTERM/SIGINT at any moment of its startup and after it:
nothing it started is left running, its ports are free, and it exits 0 (interrupted, not failed).

Each run is a fresh `echospec serve` in its own session, so every process it started (threads
mode: itself; --processes: three children) shares its session id and can be found in /proc.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402
from ports import unused_ports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ECHOSPEC = ROOT / ".venv" / "bin" / "echospec"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_model(path, arch="llama", n_vocab=320, n_ctx_train=512, seed=0)
    return str(path)


def free_ports(n: int) -> list[int]:
    return unused_ports(n)


def session_members(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) == sid:   # fields[3]: session id
            out.append(int(d))
    return out


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# `echospec serve` whose first SIGTERM exception is lost, as when the signal lands while Python
# runs a callback (an import lock's weakref callback, a __del__) and ignores what it raises
LOSES_FIRST_SIGNAL = """
import signal, sys
from echospec import cli
install = cli._install_signal_handlers
def losing_install():
    install()
    handler = signal.getsignal(signal.SIGTERM)
    def lose(signum, frame):
        try:
            handler(signum, frame)
        except cli.Interrupted:
            print("lost the handler's exception", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lose)
cli._install_signal_handlers = losing_install
sys.exit(cli.main(sys.argv[1:]))
"""


def run_and_signal(model: str, processes: bool, delay_s: float | None, sig=signal.SIGTERM,
                   lose_first: bool = False):
    """Start serve, send `sig` after delay_s (None: once the coordinator line is printed)."""
    ports = free_ports(3)
    head = [sys.executable, "-c", LOSES_FIRST_SIGNAL] if lose_first else [str(ECHOSPEC)]
    cmd = [*head, "serve", "--model", model, "--port", str(ports[0]), "--verifier-port",
           str(ports[1]), "--draft-port", str(ports[2]), "--n-ctx", "256", "--threads", "1"]
    if processes:
        cmd.append("--processes")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    err = []
    if delay_s is None:
        for line in p.stderr:
            err.append(line)
            if "coordinator      listening" in line:
                break
    else:
        time.sleep(delay_s)
    p.send_signal(sig)
    try:
        rest = p.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        rest = p.communicate()[1]
    err.append(rest or "")
    deadline = time.monotonic() + 15
    while session_members(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session_members(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return p.returncode, "".join(err), left, ports


# 0.05 s: the interpreter may not have reached main() yet (then SIGTERM's default action ends a
# process that has started nothing); later moments land in the model check, the service starts
# and the wait for SERVING.
@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("delay_s", [0.05, 0.5, 1.0, 1.5, 2.5, 4.0, None],
                         ids=lambda d: "after-listening" if d is None else f"{d}s")
def test_sigterm_at_any_moment_leaves_nothing_running(model, processes, delay_s):
    rc, err, left, ports = run_and_signal(model, processes, delay_s)
    assert left == [], f"still running: {left}\n{err}"
    assert all(port_free(pt) for pt in ports), err
    if delay_s is not None and rc == -signal.SIGTERM and not err.strip():
        # ended before main() installed its handlers (still importing: 0.05 s always, later
        # moments on a loaded host): it printed nothing and, as checked above, left nothing
        return
    assert rc == 0, err
    assert "Traceback" not in err, err
    if delay_s is None:   # a running stack says what stops, why, and what became of the calls
        assert "echospec: SIGTERM received: stopping every service; requests in flight get 2 s" \
            in err, err
        assert "echospec: stopped (SIGTERM)" in err, err
        for name, port in zip(("coordinator", "verifier", "draft"), ports):
            assert f"{name} service on port {port} stopped (SIGTERM): no call was in flight" \
                in err, err


def test_sigint_after_listening_with_processes(model):
    rc, err, left, ports = run_and_signal(model, True, None, signal.SIGINT)
    assert (rc, left) == (0, []), err
    assert "SIGINT received: stopping every service" in err and "stopped (SIGINT)" in err, err


def test_a_lost_signal_exception_still_stops_the_stack(model):
    rc, err, left, ports = run_and_signal(model, False, None, lose_first=True)
    assert (rc, left) == (0, []), err
    assert "lost the handler's exception" in err, err
    assert "SIGTERM received: stopping every service" in err and "stopped (SIGTERM)" in err, err
    assert all(port_free(pt) for pt in ports), err


def test_a_failed_start_still_exits_non_zero(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    p = subprocess.run([str(ECHOSPEC), "serve", "--model", str(bad), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "unusable" in p.stderr


# a signal whose exception an extension module's init turns into an ImportError (grpc's cygrpc
# does, when SIGTERM lands while it loads): the command loads its modules in parse_args
SIGNAL_IN_AN_IMPORT = """
import os, signal, sys
from echospec import cli
def importing(argv):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    except BaseException:
        raise ImportError("cannot initialise module strings") from None
cli.parse_args = importing
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("cmd, rc", [("serve", 0), ("generate", 128 + signal.SIGTERM)])
def test_a_signal_turned_into_an_import_error_is_still_the_signal(cmd, rc):
    p = subprocess.run([sys.executable, "-c", SIGNAL_IN_AN_IMPORT, cmd, "hi"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == rc, p.stderr
    assert "Traceback" not in p.stderr and "ImportError" not in p.stderr, p.stderr
    if cmd == "serve":
        assert "SIGTERM during startup: stopped what was started" in p.stderr, p.stderr
