"""The board's architectures (qwen3moe, qwen3vl, qwen3vlmoe) in the engine and through the services.

The fixtures in tests/data/models were made the way real files are made (transformers' tiny random
models, llama.cpp's converter and quantizer; scripts/make_fixtures.py). Beside each GGUF, a .ref.npz
holds transformers' float32 logits on the file's own dequantized weights, and llama.cpp's logits.

The engine quantizes activations to int8 blocks (as llama.cpp does), so its logits differ from
transformers' float ones by about as much as llama.cpp's do; on the MoE fixtures a router near-tie
can flip an expert for a token, which moves that token's logits by O(1) in either engine. Stated
bounds, per prompt:
  - max |ours - transformers| <= 1.25 * max |llama.cpp - transformers| + 0.1, and the same for the
    median with + 0.02 (on par with llama.cpp);
  - the argmax equals transformers' wherever transformers' top-2 margin exceeds 0.5.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import stack_stub
from echospec.services.verifier.engine import EngineError, Model
from echospec.v1 import common_pb2, coordinator_pb2 as cpb
from fixture_checks import (MARGIN, check_batch_is_each_session_alone, check_logits_on_par_with_llama_cpp,
                            check_one_call_is_single_steps, prompts)
from reference import Reference

MODELS = Path(__file__).resolve().parent / "data" / "models"
FIXTURES = ["qwen3moe-Q4_K_M", "qwen3vl-Q8_0", "qwen3vlmoe-Q8_0"]
MOE = "qwen3moe-Q4_K_M"
VL = "qwen3vl-Q8_0"


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    name = request.param
    m = Model(str(MODELS / f"{name}.gguf"))
    yield name, m, np.load(MODELS / f"{name}.ref.npz")
    m.close()


def test_model_info_reports_the_architecture(fixture):
    name, m, _ = fixture
    info = m.info
    assert info.arch == name.split("-")[0]
    if "moe" in name:
        assert (info.n_expert, info.n_expert_used, info.n_ff_exp) == ((8, 4, 256) if name == MOE else (8, 2, 256))
        assert info.weight_bytes < info.file_weight_bytes
    else:
        assert info.n_expert == info.n_expert_used == 0
    if "vl" in name:
        assert info.rope_sections == (12, 10, 10, 0) and info.n_deepstack == 1
    else:
        assert info.rope_sections == (0, 0, 0, 0)
    assert info.tied_output == ("vl" in name)


def test_logits_on_par_with_llama_cpp_against_transformers(fixture):
    name, m, z = fixture
    check_logits_on_par_with_llama_cpp(m, z, label=f"{name} ")


def test_one_call_is_bitwise_single_steps_on_any_thread_count(fixture):
    name, m, z = fixture
    toks = [int(t) for t in z["p1_tokens"]]          # the prompt with repeated content
    check_one_call_is_single_steps(m, toks, label=f"{name}: ")


def test_a_batch_of_sessions_is_each_session_alone(fixture):
    name, m, z = fixture
    prompt_ids = [[int(t) for t in z[f"p{p}_tokens"]] for p in range(3)]
    check_batch_is_each_session_alone(m, prompt_ids, label=f"{name}: ")


def test_a_verify_reads_the_union_of_its_rows_experts():
    m = Model(str(MODELS / f"{MOE}.gguf"))
    z = np.load(MODELS / f"{MOE}.ref.npz")
    toks = [int(t) for t in z["p0_tokens"]]
    s = m.new_session(n_ctx=64, n_threads=2)
    s.forward(toks[:4])
    s.forward(toks[4:5])
    one = s.experts_read
    assert one == m.info.n_layer * m.info.n_expert_used     # one row: its own experts, each once
    s.forward(toks[5:10])
    five = s.experts_read
    assert one < five <= m.info.n_layer * m.info.n_expert    # the union, never a count per row
    s.close()
    m.close()


def test_multimodal_positions_follow_the_reference():
    """(t, h, w) positions through the engine against the numpy reference's interleaved MRoPE (which
    tests/test_reference_models.py checks against transformers' rotary tables)."""
    m = Model(str(MODELS / f"{VL}.gguf"))
    R = Reference(str(MODELS / f"{VL}.gguf"), dtype=np.float64, act_quant=False, kv_f16=False)
    toks = [int(t) for t in np.load(MODELS / f"{VL}.ref.npz")["p0_tokens"]]
    n = len(toks)
    text = np.repeat(np.arange(n)[:, None], 3, axis=1)
    grid = np.stack([np.full(n, 2), np.arange(n) // 3, np.arange(n) % 3], axis=1)   # an image-like patch grid
    s = m.new_session(n_ctx=64, n_threads=2)
    _, plain = s.forward(toks, logits="all")
    s.rollback(0)
    _, same = s.forward(toks, logits="all", positions=text)
    assert np.array_equal(plain, same)                        # t = h = w = position: text
    s.rollback(0)
    _, ours = s.forward(toks, logits="all", positions=grid)
    ref = R.forward(toks, pos_thw=grid)
    assert np.abs(ours - ref).max() < 0.5
    assert np.abs(ours - plain).max() > 0.5                   # the positions matter
    assert np.abs(ref - ours).max() < np.abs(ref - plain).max() / 2
    with pytest.raises(EngineError, match="positions must be non-negative"):
        s.forward(toks, positions=-grid - 1)
    with pytest.raises(EngineError, match="shape"):
        s.forward(toks, positions=grid[:, :2])
    s.close()
    m.close()


@pytest.fixture(scope="module")
def moe_stack():
    with stack_stub(str(MODELS / f"{MOE}.gguf"), spec=False, n_ctx=256, n_threads=2, k=4) as stub:
        yield stub


def test_services_report_the_experts(moe_stack):
    info = moe_stack.GetInfo(cpb.GetInfoRequest(), timeout=30)
    assert (info.arch, info.n_expert, info.n_expert_used) == ("qwen3moe", 8, 4)


def test_speculation_on_off_byte_identical_through_the_services(moe_stack):
    on_drafts = rolls = 0
    for text in ("one two three four, one two three four, one two three four, one two",
                 "The quick brown fox jumps over the lazy dog. The quick brown fox",
                 "1. apples\n2. pears\n3."):
        off = moe_stack.Complete(cpb.CompleteRequest(text=text, max_tokens=48, spec=common_pb2.SPEC_MODE_OFF),
                                 timeout=120).result
        # on, from the suffix index alone, then with a prediction that is half right (drafts accepted,
        # then rejected and rolled back)
        half = off.text[:len(off.text) // 2] + "zz zz zz zz zz zz"
        for pred in ("", half):
            on = moe_stack.Complete(cpb.CompleteRequest(text=text, max_tokens=48, spec=common_pb2.SPEC_MODE_ON,
                                                        prediction=pred), timeout=120).result
            assert on.text == off.text and list(on.token_ids) == list(off.token_ids)
            on_drafts += on.stats.draft_tokens
            rolls += on.stats.kv_rolls
    assert on_drafts > 0 and rolls > 0                        # drafts verified, some rolled back


def test_logits_close_to_llama_cpp_live(fixture):
    """Our logits against llama.cpp's on the same file, run here (the bench extra's llama-cpp-python).
    Both quantize activations; they part by under 0.6 logit units on these fixtures (router near-ties
    included); the bound is 1.0, and the argmax agrees wherever llama.cpp's top-2 margin exceeds 0.5."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install -e '.[bench]') is "
                                    "not installed: this comparison runs where it is")
    name, m, z = fixture
    llm = llama_cpp.Llama(str(MODELS / f"{name}.gguf"), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    for p, toks in prompts(z):
        llm.reset()
        llm.eval(toks)
        theirs = np.array(llm.scores[:len(toks)], dtype=np.float32)
        s = m.new_session(n_ctx=64, n_threads=2)
        am, ours = s.forward(toks, logits="all")
        s.close()
        assert np.abs(ours - theirs).max() < 1.0, f"{name} prompt {p}"
        top2 = np.sort(theirs, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > MARGIN
        np.testing.assert_array_equal(am[clear], theirs.argmax(axis=1)[clear], err_msg=f"{name} prompt {p}")
    llm.close()


def test_enable_thinking_goes_with_messages_only(moe_stack):
    msgs = [cpb.ChatMessage(role="user", content="Say hi.")]
    r = moe_stack.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=4, enable_thinking=False), timeout=60)
    assert r.result.completion_tokens == 4
    with pytest.raises(grpc.RpcError) as ei:
        moe_stack.Complete(cpb.CompleteRequest(text="Say hi.", max_tokens=4, enable_thinking=False), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "enable_thinking applies to messages" in ei.value.details()
