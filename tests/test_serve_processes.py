"""`echospec serve --processes` when one of its child services dies (SIGKILL, as the OOM killer
sends): a dead verifier stops every service and `echospec serve` exits 1 naming it, leaving no
child behind; a dead draft service is restarted while the verifier decodes plainly, and the stack
keeps serving. The message naming a dead child quotes its last log line only when that line may
tell why (stand-in children)."""
from __future__ import annotations


def test_serve_processes_stops_when_a_child_service_dies(tiny_model):
    # was: the verifier process killed (OOM killer, kill -9), `echospec serve --processes` went on
    # running without a word; every request failed with UNAVAILABLE "no healthy verifier" for good
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "echospec.cli", "serve", "--model", tiny_model(), "--port", "0",
           "--n-ctx", "256", "--threads", "1", "--processes"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=root)
    try:
        err = []
        for line in p.stderr:
            err.append(line)
            if "coordinator      listening" in line:
                break
        assert p.poll() is None, "".join(err)
        ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True,
                            text=True).stdout
        verifier = [int(ln.split()[0]) for ln in ps.splitlines() if "echospec.services.verifier" in ln]
        assert len(verifier) == 1, ps
        os.kill(verifier[0], signal.SIGKILL)
        _, rest = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 1, rest
    # its last line is an INFO record (nothing about the kill): the status alone
    assert "echospec: the verifier service exited with status -9 (SIGKILL); stopping every service" in rest, rest
    time.sleep(0.2)
    left = subprocess.run(["ps", "-o", "pid=", "--ppid", str(p.pid)], capture_output=True,
                          text=True).stdout.split()
    assert not left, left


def test_serve_processes_keeps_serving_when_the_draft_service_dies(tiny_model):
    # was: the draft child killed, `echospec serve --processes` stopped every service ("the draft
    # service exited ...; stopping every service") and the client in flight was told "the
    # coordinator service is shutting down (SIGTERM)", though a verifier serves without its
    # draft service. A verifier that dies still stops the stack, and the services' shutdown
    # now names that cause, not only SIGTERM.
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import grpc

    from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "echospec.cli", "serve", "--model", tiny_model(), "--port", "0",
           "--n-ctx", "256", "--threads", "1", "--processes", "--spec"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=root)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()

    def wait_line(pattern: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ln in list(err):
                if re.search(pattern, ln):
                    return ln
            assert p.poll() is None or timeout_s == 0, "".join(err)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in:\n" + "".join(err))

    def child(name: str) -> list[int]:
        ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True,
                            text=True).stdout
        return [int(ln.split()[0]) for ln in ps.splitlines() if f"echospec.services.{name}" in ln]

    try:
        target = re.search(r"coordinator +listening on (\S+) ", wait_line("coordinator +listening")).group(1)
        [draft] = child("draft")
        os.kill(draft, signal.SIGKILL)
        line = wait_line(r"echospec: the draft service exited with status -9 \(SIGKILL\)")
        # was: "...(SIGKILL): <time> INFO echospec.draft draft service listening on ...", its
        # startup line quoted as if it were the cause
        assert "(SIGKILL); the verifier decodes plainly" in line and "restarted it (1 of 3)" in line, line
        with grpc.insecure_channel(target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            r = stub.Complete(cpb.CompleteRequest(text="a b", max_tokens=8,
                                                  spec=common_pb2.SPEC_MODE_ON), timeout=20)
            assert r.result.completion_tokens > 0
        assert p.poll() is None and "stopping every service" not in "".join(err)
        deadline = time.monotonic() + 10
        while not (child("draft") and child("draft")[0] != draft):
            assert time.monotonic() < deadline, "the draft service was not restarted"
            time.sleep(0.05)
        # a dead verifier still stops the stack, and the services say why
        [verifier] = child("verifier")
        os.kill(verifier, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    time.sleep(0.2)
    out = "".join(err)
    assert p.returncode == 1, out
    assert "echospec: the verifier service exited with status -9 (SIGKILL); stopping every" in out, out
    assert ("coordinator service on port " in out and "SIGTERM from echospec serve, because the "
            "verifier service exited with status -9 (SIGKILL))" in out), out


# -- the message naming a dead child ---------------------------------------------------------------

def _dead_child(code: str, name: str = "verifier", kill: bool = False):
    """A process-mode Stack with one child running ``code`` (python -c), once it has ended
    (killed with SIGKILL after its first line on stderr when ``kill``)."""
    import os
    import signal
    import sys
    import time

    from echospec.stack import Stack

    st = Stack("127.0.0.1", 0, 0, 0, processes=True)
    st._launch[name] = ([sys.executable, "-c", code], dict(os.environ))
    p = st._spawn(name)
    if kill:
        deadline = time.monotonic() + 20
        while not st._stderr[name].lines:
            assert time.monotonic() < deadline and p.poll() is None, "the child wrote nothing"
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
    p.wait(20)
    return st


_INFO = "2026-01-01T00:00:00.000Z INFO echospec.verifier verifier service listening on 127.0.0.1:1"
_HOLD = "import sys, time; sys.stderr.write({!r} + '\\n'); sys.stderr.flush(); time.sleep(60)"


def test_a_child_killed_after_an_info_line_is_named_by_its_status_alone():
    # was: "verifier service exited with status -9 (SIGKILL): <time> INFO ... listening on ...",
    # a startup line quoted as if it said why
    st = _dead_child(_HOLD.format(_INFO), kill=True)
    assert st._death("verifier") == "verifier service exited with status -9 (SIGKILL)"
    st = _dead_child(_HOLD.format('{"ts": "x", "level": "INFO", "logger": "echospec.verifier", '
                                  '"message": "request"}'), kill=True)
    assert st._death("verifier") == "verifier service exited with status -9 (SIGKILL)"
    st = _dead_child("pass")   # nothing on stderr
    assert st._death("verifier") == "verifier service exited with status 0"


def test_a_child_whose_last_line_tells_why_is_named_with_it():
    st = _dead_child("raise RuntimeError('engine: out of memory')")   # a traceback's last line
    assert st._death("verifier") == "verifier service exited with status 1: RuntimeError: engine: out of memory"
    error = "2026-01-01T00:00:00.000Z ERROR echospec.verifier the model file went away"
    st = _dead_child(f"import sys; print({_INFO!r}, file=sys.stderr); print({error!r}, file=sys.stderr); "
                     f"sys.exit(3)")
    assert st._death("verifier") == f"verifier service exited with status 3: {error}"
    warning = '{"ts": "x", "level": "WARNING", "logger": "echospec.verifier", "message": "low memory"}'
    st = _dead_child(_HOLD.format(warning), kill=True)
    assert st._death("verifier") == f"verifier service exited with status -9 (SIGKILL): {warning}"
    st = _dead_child("import sys; print('verifier: port 1 is taken', file=sys.stderr); sys.exit(1)")
    assert st._death("verifier") == "verifier service exited with status 1: verifier: port 1 is taken"


def test_revive_names_a_killed_draft_child_by_its_status_and_restarts_it():
    st = _dead_child(_HOLD.format(_INFO.replace("verifier", "draft")), name="draft", kill=True)
    try:
        notes = st.revive()
        assert notes == ["draft service exited with status -9 (SIGKILL); the verifier decodes plainly "
                         "without it (same output, spec_reason says so) until it is back; restarted "
                         "it (1 of 3)"], notes
        assert st._procs["draft"].poll() is None
    finally:
        st.stop(0, slack_s=1)
