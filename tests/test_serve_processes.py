"""`echospec serve --processes` when one of its child services dies (SIGKILL, as the OOM killer
sends): a dead verifier stops every service and `echospec serve` exits 1 naming it, leaving no
child behind; a dead draft service is restarted while the verifier decodes plainly, and the stack
keeps serving. The message naming a dead child quotes its last log line only when that line may
tell why (stand-in children). The children run in the repository's root: every file setting named
relatively (model, projector, TLS files, keys file, chat template) reaches them as an absolute path
of the caller's directory, and a stack so started serves."""
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


# -- the file settings a child gets ----------------------------------------------------------------

# `echospec serve` as far as its children's command lines: each child's argv is recorded where the
# stack would start it (Stack._spawn), no child starts, and the gateway's wait stops the stack
_ARGV_OF_CHILDREN = r"""
import json, sys
from echospec import cli, stack
argv = {}
def spawn(self, name):
    argv[name] = self._launch[name][0]
    self._stderr[name] = None
def stop(*a, **kw):
    raise stack.StackError("stopped by the test once every child's command line was made")
stack.Stack._spawn = spawn
stack._wait_process = lambda *a, **kw: None
stack._wait_port = stop
try:
    cli.main(sys.argv[1:])
finally:
    print(json.dumps(argv))
"""


def _opts(argv: list[str]) -> dict[str, str]:
    """A child's `--name value` pairs."""
    return {a: v for a, v in zip(argv, argv[1:]) if a.startswith("--") and not v.startswith("--")}


# the file settings, each a file of the caller's directory named relatively (_caller_files)
_REL = {"--model": "m.gguf", "--mmproj": "p.gguf", "--tls-cert": "cert.pem", "--tls-key": "key.pem",
        "--tls-ca": "ca.pem", "--tls-client-ca": "clients-ca.pem", "--api-keys-file": "keys.json",
        "--chat-template": "t.jinja"}
_KEY = "key-of-team-a-1d2f"


def _caller_files(d, pki) -> list[str]:
    """The files of _REL in ``d`` (Qwen3-VL and its projector; one CA signs the services'
    certificate and, as --tls-client-ca, their client certificates); `serve`'s options naming them."""
    import json
    import os
    import shutil
    from pathlib import Path

    models = Path(__file__).resolve().parent / "data" / "models"
    os.symlink(models / "qwen3vl-Q8_0.gguf", d / "m.gguf")
    os.symlink(models / "qwen3vl-mmproj-F16.gguf", d / "p.gguf")
    for name in ("cert", "key", "ca"):
        shutil.copy(pki[name], d / f"{name}.pem")
    shutil.copy(pki["ca"], d / "clients-ca.pem")
    (d / "keys.json").write_text(json.dumps({_KEY: "team-a"}))
    (d / "t.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    return [x for kv in _REL.items() for x in kv]


def test_serve_processes_gives_its_children_the_relative_file_settings_as_absolute_paths(pki, tmp_path):
    # the children run in the repository's root: a relative --mmproj, TLS file or keys file would
    # be looked for there, not in the directory `echospec serve` was started in
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-c", _ARGV_OF_CHILDREN, "serve", "--processes", "--port", "0", "--http-port", "0",
           "--n-ctx", "256", "--threads", "1", *_caller_files(tmp_path, pki["a"])]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 1 and "stopped by the test" in r.stderr, r.stderr
    children = {name: _opts(argv) for name, argv in json.loads(r.stdout.splitlines()[-1]).items()}
    assert sorted(children) == ["coordinator", "draft", "gateway", "verifier"], children
    tls = ["--tls-cert", "--tls-key", "--tls-ca"]
    want = {"draft": tls + ["--tls-client-ca"], "verifier": ["--model", "--mmproj", *tls, "--tls-client-ca"],
            "coordinator": ["--model", *tls, "--api-keys-file", "--chat-template"],
            "gateway": [*tls, "--api-keys-file"]}
    for name, flags in want.items():
        for flag in flags:
            got = children[name].get(flag, "")
            assert os.path.isabs(got) and os.path.samefile(got, tmp_path / _REL[flag]), (name, flag, got)
    # and nothing else a child gets names a file of the caller's directory relatively
    for name, opts in children.items():
        for flag, value in opts.items():
            assert not (value and (tmp_path / value).exists()) or os.path.isabs(value), (name, flag, value)


def test_serve_processes_started_with_relative_file_settings_serves_over_them(pki, tmp_path):
    """The same options, the stack started: every child finds its files (the projector, the TLS
    certificate, key and CAs, the keys file, the template), and a client with a tenant's key gets
    a completion over TLS."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import grpc

    from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "echospec.cli", "serve", "--processes", "--port", "0", "--n-ctx", "256",
           "--threads", "1", *_caller_files(tmp_path, pki["a"])]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)})
    err = []
    try:
        for line in p.stderr:
            err.append(line)
            if "coordinator      listening" in line:
                break
        up = re.search(r"coordinator +listening on \S+:(\d+)", err[-1] if err else "")
        assert up and p.poll() is None, "".join(err)
        port = up.group(1)
        creds = grpc.ssl_channel_credentials(root_certificates=Path(pki["a"]["ca"]).read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            r = stub.Complete(cpb.CompleteRequest(text="a b", max_tokens=4), timeout=60,
                              metadata=(("authorization", f"Bearer {_KEY}"),))
        assert r.result.completion_tokens > 0
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, "".join(err)
