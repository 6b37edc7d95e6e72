"""Shared pytest fixtures: tiny generated GGUF models, the real SmolLM2 model, references.

Fixtures:
    tiny_model          factory(**write_tiny_model kwargs) -> path (str) of a cached tiny GGUF file
    tiny_spec           factory(**kwargs) -> ggufgen.TinySpec (same cache)
    smollm2_path        path (str) of SmolLM2-135M-Instruct Q4_1, from scripts/fetch_model.py fetch()
    gemma3_path         path (str) of Gemma 3 270M Q4_K_M, from scripts/fetch_model.py fetch_gemma()
    smollm2_reference   reference.Reference over it (float64, act_quant=True), built once per session
    smollm2_tokenizer   object with encode(text) -> list[int] and decode(ids) -> str
    smollm2_stub        a CoordinatorService stub on a stack over SmolLM2 (speculation off by
                        default, n_ctx 1024), one stack per test module

Helpers (import from conftest):
    stack_stub(model_path, **settings)   context manager: a CoordinatorService stub on a stack
                                         started by start_stack(model_path, **settings)
    pki                 per module: {"a": ..., "b": ...}, two throwaway PKIs (each the dict of PEM
                        paths of test_gateway_security.make_pki), and "junk", the path of a file
                        that holds no PEM (test_gateway_security.py has a pki of its own)
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

# The numpy reference does many small matrix-vector products. On a shared
# 2-core machine a multi-threaded BLAS spins against other processes and runs
# several times slower, so default it to one thread (set before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests fork children (pexpect's pty spawn) while gRPC servers run threads in
# this process; grpcio's fork handlers then print "skipping fork() handlers"
# and can break the child before its exec. Nothing here uses gRPC across a
# fork, so leave the handlers out (read when grpc is first imported).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Draft priors (`echospec prior`) are looked up in an empty directory of the test run's own, so a
# prior built on this machine for the real model changes no test's rounds; the prior's tests give
# theirs by path (services/draft/prior.py: priors_dir).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
os.environ["ECHOSPEC_PRIORS"] = tempfile.mkdtemp(prefix="echospec-test-priors-")
atexit.register(shutil.rmtree, os.environ["ECHOSPEC_PRIORS"], True)

import pytest  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
for p in (str(TESTS_DIR), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import ggufgen  # noqa: E402


def _load_fetch_model():
    spec = importlib.util.spec_from_file_location("echospec_fetch_model", REPO / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory):
    """Factory: write (once per distinct kwargs) a tiny model and return its TinySpec."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict = {}

    def make(**kwargs) -> ggufgen.TinySpec:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            name = "_".join(f"{k}-{v}" for k, v in key) or "default"
            cache[key] = ggufgen.write_tiny_model(root / f"{name}.gguf", **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_spec):
    """Factory: path (str) of a tiny model written with write_tiny_model(**kwargs)."""
    return lambda **kwargs: tiny_spec(**kwargs).path


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default real model, fetched (or found in the cache) by scripts/fetch_model.py."""
    return str(_load_fetch_model().fetch(verbose=False))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M, fetched (or found in the cache) by scripts/fetch_model.py."""
    return str(_load_fetch_model().fetch_gemma(verbose=False))


@contextlib.contextmanager
def stack_stub(model_path: str, **settings):
    """A CoordinatorService stub on an in-process stack over model_path (start_stack(model_path,
    **settings)); the channel closed and the stack stopped on exit."""
    import grpc
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    st = start_stack(model_path, **settings)
    ch = grpc.insecure_channel(st.target)
    try:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    finally:
        ch.close()
        st.stop()


@pytest.fixture(scope="session")
def smollm2_api(smollm2_path):
    """The default model's stack with its HTTP gateway (speculation off unless a request asks,
    n_ctx 1024), shared by the API test modules of a session: ``.stack``, ``.stub`` (a
    CoordinatorService stub) and ``.openai`` (the official client on the gateway's /v1)."""
    import types

    import grpc
    import openai
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    st = start_stack(smollm2_path, spec=False, n_ctx=1024, http_port=0)
    ch = grpc.insecure_channel(st.target)
    oc = openai.OpenAI(base_url=st.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield types.SimpleNamespace(stack=st, stub=coordinator_pb2_grpc.CoordinatorServiceStub(ch), openai=oc)
    finally:
        oc.close()
        ch.close()
        st.stop(0.5)


@pytest.fixture(scope="module")
def smollm2_stub(smollm2_path):
    with stack_stub(smollm2_path, spec=False, n_ctx=1024) as stub:
        yield stub


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """numpy reference over SmolLM2 in float64 with engine-style int8 activations (see reference.py)."""
    import numpy as np
    from reference import Reference
    return Reference(smollm2_path, dtype=np.float64, act_quant=True)


class _GGUFTokenizer:
    """Byte-level BPE from a GGUF's own vocab and merges with the HF `tokenizers` library.

    Used only when services/text/tokenizer.py is not there. Special (CONTROL)
    tokens such as <|im_start|> are matched as single tokens; the `smollm`
    pre-tokenizer splits digits one per token, as llama.cpp does.
    """

    def __init__(self, path: str):
        import gguf
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        r = gguf.GGUFReader(path)
        toks = r.fields["tokenizer.ggml.tokens"].contents()
        types = r.fields["tokenizer.ggml.token_type"].contents()
        merges = r.fields["tokenizer.ggml.merges"].contents()
        pre = r.fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in r.fields else "gpt2"
        vocab = {t: i for i, t in enumerate(toks)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
        pts = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            pts.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tk.pre_tokenizer = pre_tokenizers.Sequence(pts)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(toks, types) if ty == 3])
        self._tk = tk

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(path: str):
    """The project's tokenizer (services.text.tokenizer) when present, else the local helper."""
    try:
        from echospec.services.text.tokenizer import Tokenizer  # type: ignore
    except ImportError:
        return _GGUFTokenizer(path)
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    return make_tokenizer(smollm2_path)


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str, system: str = SMOLLM2_SYSTEM) -> str:
    """SmolLM2's chat template rendered for one user message plus the generation prompt."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")


@pytest.fixture
def held_prefill(monkeypatch):
    """Hold every in-process verifier's prefill until the test lets it go: returns (entered,
    release), two threading.Events; entered is set once a prefill waits. Stands for a long
    prompt on a slow host without timing anything; released at teardown whatever happens."""
    import threading

    from echospec.services.verifier import generation_loop as gl

    entered, release = threading.Event(), threading.Event()
    prefill = gl._Run.prefill

    def held(self):
        entered.set()
        release.wait(60)
        return prefill(self)

    monkeypatch.setattr(gl._Run, "prefill", held)
    yield entered, release
    release.set()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from test_gateway_security import make_pki
    return {"a": make_pki(tmp_path_factory.mktemp("pki_a")),
            "b": make_pki(tmp_path_factory.mktemp("pki_b")),
            "junk": str(_junk(tmp_path_factory.mktemp("junk")))}


def _junk(d):
    (d / "junk.pem").write_text("hello, not a certificate\n")
    return d / "junk.pem"
