"""`echospec serve --processes` when one of its child services dies (SIGKILL, as the OOM killer
sends): a dead verifier stops every service and `echospec serve` exits 1 naming it, leaving no
child behind; a dead draft service is restarted while the verifier decodes plainly, and the stack
keeps serving."""
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
    assert "echospec: the verifier service exited with status -9 (SIGKILL): " in rest, rest
    assert "; stopping every service" in rest
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
        assert "decodes plainly" in line and "restarted it (1 of 3)" in line, line
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
    assert "echospec: the verifier service exited with status -9 (SIGKILL): " in out, out
    assert ("coordinator service on port " in out and "SIGTERM from echospec serve, because the "
            "verifier service exited with status -9 (SIGKILL))" in out), out
