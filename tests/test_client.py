"""The light client (clients/python, package echospec_client).

- Its wheel builds without a C compiler (every compiler on PATH and CC/CXX fail and log),
  is py3-none-any with no extension module, also builds from its sdist (no repository around),
  and installs into a fresh venv where the server package is not importable; there it runs
  complete, stream, chat, tokenize, detokenize and info against a running stack.
- Typed results: each field equals the raw proto's; stream and complete agree; a second chat
  turn reports cached prompt tokens; errors come back as ClientError with the gRPC code.
- API key metadata and TLS roots, against a test-double coordinator with TLS that checks
  `authorization: Bearer <key>` (the real server side is another piece of work).
- Arguments are checked before anything is sent (types and ranges, text that is not Unicode, an
  API key, request id or CA it cannot use); a target that never answered and a server that went
  away are named with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from echospec_client import Chunk, Client, ClientError, ConnectError, Info, Message, Result, SpecStats
from ggufgen import write_tiny_model
from test_cli import free_port as _closed_port

ROOT = Path(__file__).resolve().parents[1]
CLIENT_DIR = ROOT / "clients" / "python"
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++", "x86_64-linux-gnu-gcc",
             "aarch64-linux-gnu-gcc", "ld")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from echospec.stack import start_stack

    path = tmp_path_factory.mktemp("client") / "tiny.gguf"
    write_tiny_model(path, arch="llama", n_vocab=320, n_ctx_train=512, seed=5)
    st = start_stack(str(path), port=0, spec=True, n_ctx=256, n_threads=1, log_level="WARNING")
    yield st
    st.stop(0.5)


# ---- the wheel: pure Python, no compiler, a fresh venv ---------------------------------------

def _no_compiler_env(tmp_path: Path) -> tuple[dict, Path]:
    """An environment where any C/C++ compiler or linker call fails and is logged."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    log = tmp_path / "compiler-calls.log"
    for name in COMPILERS:
        f = fake / name
        f.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\nexit 1\n")
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", CC=str(fake / "cc"),
               CXX=str(fake / "c++"), LDSHARED=str(fake / "cc"), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env, log


def _check_wheel(whl: Path) -> None:
    assert whl.name.endswith("-py3-none-any.whl"), whl.name
    names = zipfile.ZipFile(whl).namelist()
    native = [n for n in names if n.endswith((".so", ".pyd", ".dylib", ".dll", ".c", ".o"))]
    assert not native, native
    for mod in ("client.py", "v1/coordinator_pb2.py", "v1/coordinator_pb2_grpc.py",
                "v1/common_pb2.py"):
        assert f"echospec_client/{mod}" in names, names
    assert not any(n.startswith("echospec/") for n in names), names
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    reqs = sorted(line.split(":", 1)[1].strip() for line in meta.splitlines()
                  if line.startswith("Requires-Dist:"))
    assert [r.split(">=")[0] for r in reqs] == ["grpcio", "protobuf"], reqs


USE_SCRIPT = r"""
import json, sys
import echospec_client
from echospec_client import Client, ClientError
try:
    import echospec
    has_server = True
except ImportError:
    has_server = False
out = {"file": echospec_client.__file__, "server_importable": has_server}
with Client(sys.argv[1], timeout=60) as c:
    r = c.complete("a b c a b c a b", max_tokens=8, spec=True)
    chunks = list(c.stream("a b c a b c a b", max_tokens=8, spec=True))
    ch = c.chat([{"role": "user", "content": "a b c"}], max_tokens=6)
    ids = c.tokenize("ab ab")
    out.update(complete=r.text, complete_ids=r.token_ids, finish=r.finish_reason,
               tries=r.stats.tries, hits=r.stats.hits, kv_rolls=r.stats.kv_rolls,
               draft_tokens=r.stats.draft_tokens,
               stream="".join(x.text for x in chunks), stream_ids=chunks[-1].result.token_ids,
               chat_tokens=ch.completion_tokens, ids=ids, text=c.detokenize(ids),
               model=c.info().model)
    try:
        c.complete("x", max_tokens=-1)
    except ClientError as exc:
        out["error"] = exc.code.name
print(json.dumps(out))
"""


def test_wheel_builds_without_a_compiler_and_runs_in_a_fresh_venv(stack, tmp_path):
    env, log = _no_compiler_env(tmp_path)
    # the wheel, built in the repository (stubs generated from ../../protos)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(CLIENT_DIR)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("*.whl")
    _check_wheel(whl)
    # the sdist, unpacked away from the repository, builds the same files
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")],
                       cwd=CLIENT_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (tmp_path / "sdist").glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    (src,) = (tmp_path / "unpacked").iterdir()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist2"), str(src)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl2,) = (tmp_path / "dist2").glob("*.whl")
    _check_wheel(whl2)
    assert sorted(zipfile.ZipFile(whl2).namelist()) == sorted(zipfile.ZipFile(whl).namelist())
    assert not log.exists(), log.read_text()

    # a fresh venv; grpcio and protobuf come from this venv's site-packages through a .pth
    # (a path line: the server package's editable finder there is not loaded), so the
    # test needs no network; the wheel itself is installed with --no-deps
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; "
                                         "print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    import google.protobuf
    deps = [Path(grpc.__file__).parents[1], Path(google.protobuf.__file__).parents[2]]
    (site / "deps.pth").write_text("".join(f"{d}\n" for d in sorted(set(map(str, deps)))))
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", str(whl)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not log.exists(), log.read_text()
    script = tmp_path / "use.py"
    script.write_text(USE_SCRIPT)
    r = subprocess.run([str(py), "-I", str(script), stack.target], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["file"].startswith(str(site)), out["file"]
    assert out["server_importable"] is False
    assert out["complete"] == out["stream"] and out["complete_ids"] == out["stream_ids"]
    assert len(out["complete_ids"]) >= 1 and out["finish"] in ("eos", "length")
    assert out["hits"] + out["kv_rolls"] == out["draft_tokens"]
    assert out["chat_tokens"] >= 1
    assert out["ids"] and out["text"] == "ab ab"
    assert out["model"].endswith("tiny.gguf")
    assert out["error"] == "INVALID_ARGUMENT"


# ---- typed results against the raw protocol ------------------------------------------------

def test_results_match_the_raw_protocol(stack):
    from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc, common_pb2

    kw = dict(max_tokens=12, spec=True, k=3)
    with grpc.insecure_channel(stack.target) as ch:
        raw = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Complete(
            coordinator_pb2.CompleteRequest(text="x y z x y z x y", max_tokens=12, k=3,
                                            spec=common_pb2.SPEC_MODE_ON), timeout=60).result
    with Client(stack.target, timeout=60) as c:
        r = c.complete("x y z x y z x y", **kw)
        chunks = list(c.stream("x y z x y z x y", **kw))
    assert isinstance(r, Result) and isinstance(r.stats, SpecStats)
    assert r.text == raw.text and r.token_ids == list(raw.token_ids)
    assert (r.prompt_tokens, r.completion_tokens, r.spec_enabled, r.spec_reason) == (
        raw.prompt_tokens, raw.completion_tokens, raw.spec_enabled, raw.spec_reason)
    assert r.finish_reason == common_pb2.FinishReason.Name(raw.finish_reason).split("_")[-1].lower()
    # the stats of one call, typed and raw (another call's may differ: a round drafts what the
    # draft service has answered by the end of its forward)
    typed = Result.from_proto(raw)
    for name in ("tries", "hits", "kv_rolls", "draft_tokens", "rounds", "proposals"):
        assert getattr(typed.stats, name) == getattr(raw.stats, name), name
    assert r.stats.hits + r.stats.kv_rolls == r.stats.draft_tokens
    assert r.stats.tries >= 1 and r.spec_enabled
    assert all(isinstance(x, Chunk) for x in chunks)
    assert [x.result is not None for x in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1].result
    assert "".join(x.text for x in chunks) == last.text == r.text
    assert sum((x.token_ids for x in chunks), []) == last.token_ids == r.token_ids
    assert last.ttft_s is not None and 0 < last.ttft_s <= last.wall_s
    assert r.wall_s > 0 and r.tokens_per_s > 0


def test_logprobs_match_the_raw_protocol(stack):
    from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc
    from echospec_client import TokenLogprob

    with grpc.insecure_channel(stack.target) as ch:
        raw = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Complete(
            coordinator_pb2.CompleteRequest(text="x y z x y z", max_tokens=6, logprobs=True,
                                            top_logprobs=2), timeout=60).result
    with Client(stack.target, timeout=60) as c:
        r = c.complete("x y z x y z", max_tokens=6, logprobs=True, top_logprobs=2)
        chunks = list(c.stream("x y z x y z", max_tokens=6, logprobs=True, top_logprobs=2))
        plain = c.complete("x y z x y z", max_tokens=6)
    assert all(isinstance(x, TokenLogprob) for x in r.logprobs) and plain.logprobs == ()
    assert [(x.token_id, x.token, x.bytes, x.logprob) for x in r.logprobs] == \
        [(x.token_id, x.token, x.bytes, x.logprob) for x in raw.logprobs]
    assert [[(t.token_id, t.logprob) for t in x.top_logprobs] for x in r.logprobs] == \
        [[(t.token_id, t.logprob) for t in x.top_logprobs] for x in raw.logprobs]
    assert sum((x.logprobs for x in chunks), ()) == chunks[-1].result.logprobs == r.logprobs


@pytest.mark.parametrize("proto_name, cls, left_out", [
    ("SpecStats", SpecStats, set()), ("GenerationResult", Result, set()),
    # the fleet's addresses and load reports: for operators (grpcurl, GetConfig), not the client
    ("GetInfoResponse", Info, {"verifier_target", "draft_target", "verifiers"})])
def test_every_field_of_the_protocol_reaches_the_typed_result(proto_name, cls, left_out):
    from dataclasses import fields

    from echospec.v1 import common_pb2, coordinator_pb2

    proto = getattr(common_pb2, proto_name, None) or getattr(coordinator_pb2, proto_name)
    have = {f.name for f in fields(cls)} | left_out
    missing = [f.name for f in proto.DESCRIPTOR.fields if f.name not in have]
    assert not missing, f"{cls.__name__} lacks {missing} of echospec.v1.{proto_name}"


def test_second_chat_turn_reuses_the_prefix(stack):
    with Client(stack.target, timeout=60) as c:
        history = [Message("system", "be brief"), {"role": "user", "content": "a b c d"}]
        r1 = c.chat(history, max_tokens=6)
        history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "e f"}]
        r2 = c.chat(history, max_tokens=6)
    assert r2.prompt_tokens > r1.prompt_tokens
    assert 0 < r2.stats.cached_prompt_tokens < r2.prompt_tokens


def test_stream_left_early_and_errors(stack):
    with Client(stack.target, timeout=60) as c:
        it = c.stream("a b a b a b", max_tokens=64, spec=False)
        first = next(it)
        assert first.result is None
        it.close()                         # cancels the call; the client keeps working
        assert c.tokenize("a") == c.tokenize("a")
        with pytest.raises(ClientError) as e:
            c.complete("x", max_tokens=-1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details
        with pytest.raises(ValueError, match="exactly one"):
            c.complete("x", messages=[{"role": "user", "content": "y"}])
        with pytest.raises(TypeError, match=r"messages\[0\].content must be a string"):
            c.chat([{"role": "user", "content": 5}])
        with pytest.raises(TypeError, match="unknown argument"):
            c.complete("x", max_token=3)
        with pytest.raises(ValueError, match="out of range"):
            c.detokenize([2 ** 40])
        with pytest.raises(TypeError, match="enable_thinking must be True, False or None"):
            c.chat([{"role": "user", "content": "y"}], enable_thinking=0)
        with pytest.raises(ValueError, match="enable_thinking applies to messages"):
            c.complete("x", enable_thinking=False)
        assert c.chat([{"role": "user", "content": "y"}], max_tokens=2, enable_thinking=False).completion_tokens == 2
    with pytest.raises(ValueError, match="positive number"):
        Client(stack.target, timeout=0)


def test_unreachable_target_fails_within_the_connect_timeout():
    import time

    from ports import unused_port
    port = unused_port()                   # nothing listens there (tests/ports.py)
    c = Client(f"127.0.0.1:{port}", connect_timeout=0.5, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as e:
        c.tokenize("x")
    assert time.monotonic() - t0 < 5
    assert e.value.bound == "connect_timeout" and e.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ConnectError) as e:
        c.complete("x", timeout=0.3)
    assert e.value.bound == "timeout" and "within 0.3 s" in str(e.value)
    c.close()


def test_a_call_timeout_at_a_server_that_does_not_answer_is_deadline_exceeded():
    # was: ConnectError "no coordinator reachable at 127.0.0.1:P within 0.3 s" (the CLI added
    # "start a coordinator with `echospec serve`") although a server accepted the connection:
    # the call's own timeout ran out (a listening socket that never answers stands in for a
    # coordinator too busy to answer in time)
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        target = f"127.0.0.1:{srv.getsockname()[1]}"
        with Client(target, connect_timeout=10, timeout=30) as c:
            with pytest.raises(ClientError) as e:
                c.complete("x", timeout=0.3)
        assert not isinstance(e.value, ConnectError), e.value
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        assert e.value.details == (f"the call did not finish within its timeout of 0.3 s (the "
                                   f"server at {target} accepts connections but did not answer "
                                   f"in time)")
        # the connect wait for a server that does not answer stays a ConnectError
        with Client(target, connect_timeout=0.3, timeout=30) as c:
            with pytest.raises(ConnectError) as e:
                c.complete("x")
        assert e.value.bound == "connect_timeout"


# ---- API key and TLS (a test-double coordinator) -------------------------------------------

def _self_signed(tmp_path: Path) -> tuple[bytes, bytes]:
    """A self-signed certificate for the name echospec.test (and 127.0.0.1) and its key."""
    openssl = shutil.which("openssl")
    assert openssl, "the TLS test needs the openssl command"
    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=echospec.test", "-addext",
                    "subjectAltName=DNS:echospec.test,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True,
                   timeout=60)
    return crt.read_bytes(), key.read_bytes()


class _KeyedTokenizer:
    """Tokenize answers the length of the text, only with `authorization: Bearer sekrit`."""

    def __init__(self):
        from echospec.v1 import coordinator_pb2_grpc

        class Servicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
            def Tokenize(self, request, context):
                from echospec.v1 import coordinator_pb2

                md = dict(context.invocation_metadata())
                if md.get("authorization") != "Bearer sekrit":
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
                return coordinator_pb2.TokenizeResponse(token_ids=[len(request.text)])

        self.servicer = Servicer()


def test_api_key_and_tls_roots(tmp_path, monkeypatch):
    from echospec.v1 import coordinator_pb2_grpc

    crt, key = _self_signed(tmp_path)
    (tmp_path / "ca.pem").write_bytes(crt)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(_KeyedTokenizer().servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, crt)]))
    server.start()
    target = f"127.0.0.1:{port}"
    monkeypatch.delenv("ECHOSPEC_API_KEY", raising=False)
    try:
        with Client(target, root_certificates=crt, api_key="sekrit", timeout=10) as c:
            assert c.tls and c.tokenize("hello") == [5]
        with Client(target, root_certificates=crt.decode(), api_key="sekrit", timeout=10) as c:
            assert c.tokenize("hi") == [2]           # PEM text works as PEM bytes do
        # the CA as a file path, the key from the environment, the name checked by override
        monkeypatch.setenv("ECHOSPEC_API_KEY", "sekrit")
        with Client(f"localhost:{port}", root_certificates=str(tmp_path / "ca.pem"),
                    server_name="echospec.test", timeout=10) as c:
            assert c.tokenize("abc") == [3]
        monkeypatch.delenv("ECHOSPEC_API_KEY")
        for api_key in (None, "wrong"):
            with Client(target, root_certificates=crt, api_key=api_key, timeout=10) as c:
                with pytest.raises(ClientError) as e:
                    c.tokenize("x")
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        # a plaintext client, and a TLS client that does not trust the certificate, never connect
        for kw in ({}, {"tls": True}):
            with Client(target, api_key="sekrit", connect_timeout=1, timeout=10, **kw) as c:
                with pytest.raises(ConnectError):
                    c.tokenize("x")
        with pytest.raises(ValueError, match="no-such.pem"):
            Client(target, root_certificates=str(tmp_path / "no-such.pem"))
        with pytest.raises(ValueError, match="printable ASCII"):
            Client(target, api_key="a\nb")
        # was: every call failed with gRPC's own RESOURCE_EXHAUSTED on the metadata's size
        with pytest.raises(ValueError, match="api_key is 20000 characters long: at most 4096"):
            Client(target, api_key="a" * 20000)
        Client(target, api_key="a" * 4096).close()
    finally:
        server.stop(0)


# ---- arguments checked before anything is sent ---------------------------------------------------

@pytest.mark.parametrize("kw, exc, message", [
    # was: "bad sampling argument: Value out of range: 1099511627776", naming no argument
    ({"max_tokens": 2 ** 40}, ValueError, "max_tokens must be in [-2147483648, 2147483647]"),
    ({"seed": -1}, ValueError, "seed must be in [0, 18446744073709551615], got -1"),
    # was: "bad sampling argument: could not convert string to float: 'hot'"
    ({"temperature": "hot"}, TypeError, "temperature must be a number, got 'hot'"),
    # was: accepted, as max_tokens=5 (int() of the string, of the float)
    ({"max_tokens": "5"}, TypeError, "max_tokens must be an int, got '5'"),
    ({"max_tokens": 5.5}, TypeError, "max_tokens must be an int, got 5.5"),
    ({"k": True}, TypeError, "k must be an int, got True"),
    ({"top_p": 10 ** 400}, ValueError, "top_p must be within float32's range (about ±3.4e38)"),
    # was: stored as inf (float32 overflow), then the server's "temperature must be finite, got inf"
    ({"temperature": 1e39}, ValueError, "temperature must be within float32's range (about "
                                        "±3.4e38), got 1e+39"),
    # was: "" silently dropped, while ["a", ""] reached the server's INVALID_ARGUMENT
    ({"stop": ""}, ValueError, "stop is an empty string: a stop string needs at least one"),
    ({"stop": ["a", ""]}, ValueError, "stop[1] is an empty string"),
    # was: ClientError INTERNAL "Invalid metadata" and a gRPC core log line
    ({"request_id": "a\nb"}, ValueError, "request_id must be printable ASCII (it is sent as gRPC "
                                         "metadata), got 'a\\nb'"),
    ({"request_id": 5}, TypeError, "request_id must be a str, got int"),
    ({"logprobs": True, "top_logprobs": 21}, ValueError, "top_logprobs must be in [0, 20], got 21"),
    ({"top_logprobs": 2}, ValueError, "top_logprobs (2) needs logprobs=True"),
    ({"logprobs": 1}, TypeError, "logprobs must be True, False or None, got 1"),
])
def test_client_names_the_bad_argument(kw, exc, message):
    from echospec_client import Client
    with Client("127.0.0.1:1") as c:
        for call in (c.complete, lambda *a, **k: next(c.stream(*a, **k))):
            with pytest.raises(exc) as e:
                call("hi", **kw)
            assert str(e.value).startswith(message), e.value


def test_client_keeps_valid_numeric_arguments():
    import numpy as np

    from echospec_client.client import _fill
    from echospec_client.v1 import coordinator_pb2

    req = coordinator_pb2.CompleteRequest()
    _fill(req, "hi", None, None, {"max_tokens": np.int64(7), "seed": 2 ** 64 - 1, "top_k": 0,
                                  "temperature": 1, "top_p": 0.5, "min_p": np.float32(0.25),
                                  "k": None})
    assert (req.max_tokens, req.seed, req.temperature, req.top_p, req.min_p, req.k) == \
        (7, 2 ** 64 - 1, 1.0, 0.5, 0.25, 0)
    assert req.HasField("top_p")


@pytest.mark.parametrize("kwargs, error", [
    ({"prediction": 0}, TypeError), ({"prediction": []}, TypeError),
    ({"draft_namespace": False}, TypeError), ({"spec": 1}, ValueError)])
def test_the_client_refuses_falsy_values_of_the_wrong_type(kwargs, error):
    # was: prediction=0 or [] and draft_namespace=False went out as "", spec=1 as True
    from echospec_client import Client
    with Client("127.0.0.1:1") as c:
        with pytest.raises(error):
            c.complete("a", **kwargs)


@pytest.mark.parametrize("call, name", [
    (lambda c: c.stream("a\udcff"), "prompt"),
    (lambda c: c.complete(messages=[{"role": "user", "content": "\udcff"}]), "messages[0].content"),
    (lambda c: c.stream("x", stop=["ok", "\udcff"]), "stop[1]"),
    (lambda c: c.stream("x", prediction="\udcff"), "prediction"),
    (lambda c: c.tokenize("\udcff"), "text"),
], ids=["prompt", "message", "stop", "prediction", "tokenize"])
def test_client_names_text_that_is_not_unicode(call, name):
    # was: protobuf's "UnicodeEncodeError: 'utf-8' codec can't encode character '\udcff' in
    # position 0", naming no argument (raised before anything is sent, so no server is needed)
    from echospec_client import Client
    with Client("127.0.0.1:1") as c:
        with pytest.raises(ValueError) as e:
            call(c)
    assert not isinstance(e.value, UnicodeError)
    assert str(e.value).startswith(f"{name} is not valid Unicode"), e.value


@pytest.mark.parametrize("key", ["ключ", "é", " lead"])
def test_client_refuses_an_api_key_it_cannot_send(key):
    # was: ClientError INTERNAL "Invalid metadata" from every call, and gRPC's C-core log lines
    # (a non-ASCII key), or UNAUTHENTICATED for the right key (a space at an end)
    from echospec_client import Client
    with pytest.raises(ValueError, match="api_key must"):
        Client("127.0.0.1:1", api_key=key)


def test_the_client_refuses_unusable_certificates_and_long_request_ids():
    # was: a 3 s wait then "no coordinator reachable" (gRPC only logged "Could not load any root
    # certificate"); a 20 KB request id got RESOURCE_EXHAUSTED from the server
    from echospec_client import Client
    with pytest.raises(ValueError, match="root_certificates: not a PEM CA certificate"):
        Client("127.0.0.1:1", root_certificates=b"garbage")
    with Client("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match="request_id must be at most 64 characters"):
            c.complete("a", request_id="r" * 65)


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "[::1]:50051", "localhost:65535", "::1",
                                    "dns:///echospec:50051", "unix:/tmp/echospec.sock", "example.com"])
def test_client_keeps_every_target_grpc_accepts(target):
    from echospec_client import Client
    Client(target).close()


# ---- a target that never answered, a server that went away ---------------------------------------

def test_client_says_why_nothing_answered():
    # was: "no coordinator reachable at 127.0.0.1:P within 0.5 s" for a refused port and a host
    # name that does not resolve alike: a typo in the port and one in the name read the same
    from echospec_client import Client, ConnectError
    port = _closed_port()
    with Client(f"127.0.0.1:{port}", connect_timeout=0.5, timeout=30) as c:
        with pytest.raises(ConnectError) as e:
            c.tokenize("x")
    assert e.value.reason == f"connection refused: nothing listens on port {port} of 127.0.0.1"
    assert str(e.value).endswith(f"within 0.5 s ({e.value.reason})"), str(e.value)
    with Client("no-such-host.invalid:50051", connect_timeout=0.5, timeout=30) as c:
        with pytest.raises(ConnectError) as e:
            c.tokenize("x")
    assert e.value.reason.startswith("the host name 'no-such-host.invalid' does not resolve ("), \
        e.value.reason


def test_client_of_a_server_that_went_away_says_so(tiny_model):
    # was: UNAVAILABLE "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: Failed
    # to connect to remote host: Connection refused"
    import grpc

    from echospec.stack import start_stack
    from echospec_client import Client, ClientError

    st = start_stack(tiny_model(), n_ctx=256, n_threads=1)
    try:
        c = Client(st.target, connect_timeout=10)
        assert c.tokenize("ab")
    finally:
        st.stop(0)
    with c:
        with pytest.raises(ClientError) as e:
            c.tokenize("ab")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.details.startswith(f"the server at {st.target} went away"), e.value.details


def test_an_empty_messages_or_token_ids_list_is_named():
    with Client("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match="messages is empty: at least one message is required"):
            c.chat([])
        with pytest.raises(ValueError, match="token_ids is empty"):
            c.complete(token_ids=[])


def test_tree_nodes_reaches_the_request_and_is_checked():
    # was: TypeError "unknown argument(s): tree_nodes", though gRPC and HTTP take it
    from echospec_client import client as cl
    from echospec_client.v1 import coordinator_pb2
    for v in (-1, 0, 8, 63):
        req = coordinator_pb2.CompleteRequest()
        cl._fill(req, "hi", None, None, {"tree_nodes": v})
        assert req.tree_nodes == v
    for bad, exc in ((64, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(exc, match="tree_nodes"):
            cl._fill(coordinator_pb2.CompleteRequest(), "hi", None, None, {"tree_nodes": bad})
