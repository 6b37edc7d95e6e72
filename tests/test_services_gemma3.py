"""The services on the second real model, Gemma 3 270M base Q4_K_M (fetched by scripts/fetch_model.py
by its name, gemma3-270m): raw-prompt continuations, as suits a base model; speculation on/off
byte-identical; the greedy text is llama.cpp's for the same prompt (where the bench extra's
llama-cpp-python is installed); chat messages refused for want of a chat template.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from conftest import stack_stub
from echospec.v1 import common_pb2, coordinator_pb2 as cpb

OFF, ON = common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Shopping list:\n1. milk\n2. eggs\n3.",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
]


@pytest.fixture(scope="module")
def stub(gemma3_path):
    with stack_stub(gemma3_path, spec=False, n_ctx=512) as st:
        yield st


def test_info_names_gemma3(stub):
    info = stub.GetInfo(cpb.GetInfoRequest(), timeout=30)
    assert info.arch == "gemma3" and info.n_vocab == 262144 and info.n_expert == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_on_off_byte_identical(stub, prompt):
    off = stub.Complete(cpb.CompleteRequest(text=prompt, max_tokens=48, spec=OFF), timeout=120).result
    on = stub.Complete(cpb.CompleteRequest(text=prompt, max_tokens=48, spec=ON), timeout=120).result
    assert on.text == off.text and list(on.token_ids) == list(off.token_ids)
    assert off.completion_tokens > 0 and on.spec_enabled


def _base_workloads() -> dict:
    from echospec import cli
    path = Path(__file__).resolve().parents[1] / "workloads" / "base_continuations.jsonl"
    return {w["id"]: w for w in cli._load_workloads(str(path))}


@pytest.mark.parametrize("wid", ["kestrel16", "numbered", "code_edit_pred"])
def test_base_model_workloads_speculate_byte_identically(stub, wid):
    """The seed workloads as raw continuations (workloads/base_continuations.jsonl, what the bench
    runs on this model): spec on/off identical, and drafts accepted where the text repeats."""
    w = _base_workloads()[wid]
    kw = dict(text=w["prompt"], max_tokens=64, prediction=w.get("prediction", ""))
    off = stub.Complete(cpb.CompleteRequest(spec=OFF, **kw), timeout=120).result
    on = stub.Complete(cpb.CompleteRequest(spec=ON, **kw), timeout=120).result
    assert on.text == off.text and list(on.token_ids) == list(off.token_ids)
    assert off.completion_tokens == 64 and on.spec_enabled
    if wid != "numbered":   # a list's copied drafts go stale; the other two repeat text
        assert on.stats.hits > 0, on.stats


def test_code_continuation_is_sensible(stub):
    r = stub.Complete(cpb.CompleteRequest(text=PROMPTS[0], max_tokens=24, spec=OFF), timeout=120).result
    assert r.text.startswith("    if n == 0")


def test_chat_messages_refused_without_a_template(stub):
    with pytest.raises(grpc.RpcError) as ei:
        stub.Complete(cpb.CompleteRequest(messages=[cpb.ChatMessage(role="user", content="hi")],
                                          max_tokens=4), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in ei.value.details() and "--chat-template" in ei.value.details()


def test_greedy_text_is_llama_cpps(stub, gemma3_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install -e '.[bench]') is "
                                    "not installed: this comparison runs where it is")
    llm = llama_cpp.Llama(gemma3_path, n_ctx=256, n_threads=2, verbose=False)
    ours = stub.Complete(cpb.CompleteRequest(text=PROMPTS[0], max_tokens=32, spec=OFF), timeout=120).result
    theirs = llm.create_completion(PROMPTS[0], max_tokens=32, temperature=0)["choices"][0]["text"]
    llm.close()
    assert ours.text == theirs
