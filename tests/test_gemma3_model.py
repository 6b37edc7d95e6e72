"""gemma3 (Gemma 3's text decoder) in the engine, against transformers and llama.cpp.

tests/data/models/gemma3-Q8_0.gguf was made the way real files are made (scripts/make_fixtures.py:
a tiny random Gemma3ForCausalLM with SmolLM2's tokenizer, llama.cpp's converter and quantizer): 6
layers, 4 / 1 heads of 64, a sliding window of 16 on layers 0-4 (layer 5 global), local RoPE base
10000, global 1e6, tied Q8_0 embedding. Its .ref.npz holds transformers' float32 logits on the
file's own dequantized weights and llama.cpp's logits, for four prompts, the last one (40 tokens)
longer than twice the window.

Its local layers keep their KV in rings of round_up(16 + swa_slack, 64) positions (320 with the
default slack): the sizes the engine reports, rollback within and beyond a ring's reach, the prefix
cache reusing only a reachable prefix, and speculation on/off identity on a prompt that wraps the
rings are checked here too, and the real Gemma 3 270M's KV at n_ctx 8192.

The engine quantizes activations to int8 blocks (as llama.cpp does), so its logits differ from
transformers' float ones by about as much as llama.cpp's do. Stated bounds, per prompt:
  - max |ours - transformers| <= 1.25 * max |llama.cpp - transformers| + 0.1, and the same for the
    median with + 0.02 (on par with llama.cpp);
  - the argmax equals transformers' wherever transformers' top-2 margin exceeds 0.5.
A wrong window, RoPE base, norm or activation moves the logits by O(1) (logit std 1.1).
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from echospec.services.common.config import VerifierConfig
from echospec.services.verifier.engine import SWA_SLACK, EngineError, Model
from echospec.services.verifier.generation_loop import GenerationRequest, check, run_generation
from echospec.services.verifier.sessions import Sampling, VerifierCore
from echospec.stack import start_stack
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from fixture_checks import (check_batch_is_each_session_alone, check_logits_on_par_with_llama_cpp,
                            check_one_call_is_single_steps, prompts)

MODELS = Path(__file__).resolve().parent / "data" / "models"
NAME = "gemma3-Q8_0"
LONG = 3            # the prompt longer than the window


@pytest.fixture(scope="module")
def model():
    m = Model(str(MODELS / f"{NAME}.gguf"))
    yield m, np.load(MODELS / f"{NAME}.ref.npz")
    m.close()


def test_model_info(model):
    m, _ = model
    i = m.info
    assert i.arch == "gemma3"
    assert (i.n_layer, i.n_embd, i.n_head, i.n_head_kv, i.head_dim, i.n_ff) == (6, 128, 4, 1, 64, 512)
    assert (i.n_swa, i.n_swa_layers) == (16, 5)          # llama.cpp's default pattern: every 6th layer global
    assert i.rope_freq_base == 1e6 and i.rope_freq_base_swa == 1e4 and i.rope_freq_scale == 1.0
    assert i.rope_neox and i.tied_output and i.norm_eps == pytest.approx(1e-6)


def test_the_long_prompt_runs_past_the_window(model):
    _, z = model
    assert len(z[f"p{LONG}_tokens"]) >= 40


def test_logits_on_par_with_llama_cpp_against_transformers(model):
    m, z = model
    check_logits_on_par_with_llama_cpp(m, z, top_logits=True)


def test_past_the_window_rows_follow_transformers(model):
    """The rows whose window leaves the first positions out (16 and later) are as close as the
    others: a window one position too wide or too narrow shows there."""
    m, z = model
    toks = [int(t) for t in z[f"p{LONG}_tokens"]]
    s = m.new_session(n_ctx=64, n_threads=2)
    _, lg = s.forward(toks, logits="all")
    s.close()
    tf, ll = z[f"p{LONG}_subset_logits"], z[f"p{LONG}_llama_subset_logits"]
    late = np.abs(lg[16:, z["subset"]] - tf[16:]).max()
    assert late <= 1.25 * float(np.abs(ll[16:] - tf[16:]).max()) + 0.1


def test_one_call_is_bitwise_single_steps_past_the_window(model):
    m, z = model
    toks = [int(t) for t in z[f"p{LONG}_tokens"]]

    def after_a_rollback(s, rows, threads):
        # a rollback across the window, then a verify-sized call: the same rows again
        s.rollback(21)
        _, again = s.forward(toks[21:26], logits="all")
        assert np.array_equal(again, np.stack(rows[21:26])), f"after a rollback, {threads} threads"

    check_one_call_is_single_steps(m, toks, then=after_a_rollback)


def test_a_batch_of_sessions_is_each_session_alone(model):
    m, z = model
    check_batch_is_each_session_alone(m, [toks for _, toks in prompts(z)])


# -- the local layers' KV rings ------------------------------------------------------------------

def ring_of(info, slack: int = SWA_SLACK) -> int:
    """Positions a local layer keeps: the window plus the slack, in whole blocks of 64."""
    return -(-(info.n_swa + slack) // 64) * 64


def position_bytes(info) -> int:
    """K and V of one position in one layer (F16)."""
    return 2 * info.n_head_kv * info.head_dim * 2


def test_local_layers_keep_a_ring_at_n_ctx_8192(model):
    m, _ = model
    i = m.info
    n_global = i.n_layer - i.n_swa_layers
    with m.new_session(n_ctx=8192, n_threads=1) as s, m.new_session(n_ctx=8192, n_threads=1, swa_full=True) as f:
        assert ring_of(i) == 320
        assert s.kv_bytes == (n_global * 8192 + i.n_swa_layers * 320) * position_bytes(i)   # 2.4 MiB
        assert f.kv_bytes == i.n_layer * 8192 * position_bytes(i)                            # 12 MiB
        assert s.n_ctx == f.n_ctx == 8192
    with m.new_session(n_ctx=300, n_threads=1) as short:    # shorter than a ring: every position
        assert short.kv_bytes == i.n_layer * 320 * position_bytes(i)
    with pytest.raises(EngineError, match="swa_slack"):
        m.new_session(n_ctx=256, swa_slack=-1)
    with pytest.raises(TypeError, match="swa_full"):
        m.new_session(n_ctx=256, swa_full=1)


def test_rollback_within_the_rings_reach_is_exact_and_beyond_it_refused(model):
    m, _ = model
    toks = [(i * 53 + 7) % 300 + 3 for i in range(200)]
    more = [(i * 31 + 11) % 300 + 3 for i in range(60)]
    # slack 32: rings of 64 positions, so a session reaches back 64 - 16 + 1 = 49 positions
    with m.new_session(n_ctx=256, n_threads=2, swa_slack=32) as s, \
            m.new_session(n_ctx=256, n_threads=1, swa_full=True) as f:
        _, a = s.forward(toks, logits="all")       # in pieces of 32 tokens
        _, b = f.forward(toks, logits="all")
        assert np.array_equal(a, b)
        assert s.min_rollback == 200 - 49 and f.min_rollback == 0
        with pytest.raises(EngineError) as ei:
            s.rollback(200 - 50)
        assert ei.value.name == "ES_ERR_INVALID_ARG"
        assert "out of reach" in ei.value.message and "n_past >= 151, or to 0" in ei.value.message
        assert s.n_past == 200
        s.rollback(151)                             # the deepest: the next window starts at the ring's end
        f.rollback(151)
        _, a = s.forward(more, logits="all")
        _, b = f.forward(more, logits="all")
        assert np.array_equal(a, b)
        s.rollback(0)                               # a reset always works
        assert s.min_rollback == 0 and s.n_past == 0


def _generate(core, prompt, max_tokens):
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, eos_ids=frozenset(), sampling=Sampling())
    check(core, req)
    return list(run_generation(core, req, threading.Event()))


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_the_prefix_cache_reuses_only_a_prefix_the_rings_reach():
    cfg = VerifierConfig(model=str(MODELS / f"{NAME}.gguf"), n_ctx=1024, n_threads=1, max_k=8)
    warm, cold = VerifierCore(cfg), VerifierCore(dataclasses.replace(cfg, prefix_cache=False))
    try:
        assert warm.swa_slack == SWA_SLACK      # rings of 320 positions: 305 back from the furthest
        p1 = [(i * 37) % 300 + 3 for i in range(400)]
        _generate(warm, p1, 8)
        (entry,) = warm.prefix_cache._entries.values()
        assert entry[2] >= len(entry[1]) - 305 > 60         # 305 back from the furthest position written
        # sharing 60 tokens, fewer than the session reaches: nothing reused, a cold run's output
        p2 = p1[:60] + [(i * 11) % 300 + 3 for i in range(40)]
        got = _generate(warm, p2, 12)
        assert got[0].cached_prompt_tokens == 0
        assert _tokens(got) == _tokens(_generate(cold, p2, 12))
        # sharing all 400: reused, the same output again
        p3 = p1 + [5, 6, 7]
        got = _generate(warm, p3, 12)
        assert got[0].cached_prompt_tokens == 400
        assert _tokens(got) == _tokens(_generate(cold, p3, 12))
    finally:
        warm.close()
        cold.close()


def test_a_verifier_with_a_large_max_k_reaches_back_a_whole_verify(model):
    m, _ = model
    toks = [(i * 13) % 300 + 3 for i in range(600)]
    core = VerifierCore(VerifierConfig(model=str(MODELS / f"{NAME}.gguf"), n_ctx=1024, n_threads=1, max_k=400))
    try:
        assert core.swa_slack == 401
        with core.new_engine_session() as s:
            s.forward(toks, logits="none")
            s.rollback(600 - 400)                   # a verify of 400 drafts, all rejected
    finally:
        core.close()
    with m.new_session(n_ctx=1024, n_threads=1) as s:   # the default slack does not reach that far
        s.forward(toks, logits="none")
        assert s.min_rollback == 600 - (320 - 16 + 1)
        with pytest.raises(EngineError, match="out of reach"):
            s.rollback(600 - 400)


def test_speculation_on_off_identical_on_a_prompt_that_wraps_the_rings():
    """Past the rings of 320 positions, with drafts rejected (rollbacks on wrapped rings) and the
    prefix cache in play: the second prompt shares 50 tokens with the cached sessions, fewer than
    they reach back, so it is prefilled whole. K is fixed: the live cost model may skip drafting
    on a busy host, and then no draft meets the output's turns to be rejected."""
    st = start_stack(str(MODELS / f"{NAME}.gguf"), spec=False, n_ctx=1024, n_threads=1, k=4,
                     adaptive_k=False)
    ch = grpc.insecure_channel(st.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        p = [((i * 3) % 17) * 13 + 5 for i in range(420)]
        q = p[:50] + [(i * 7) % 200 + 50 for i in range(380)]
        rolls = []
        for prompt in (p, q):
            off, on = [stub.Complete(cpb.CompleteRequest(token_ids=prompt, max_tokens=48, spec=spec),
                                     timeout=120).result
                       for spec in (common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON)]
            assert off.stats.cached_prompt_tokens == 0                      # q: p's sessions do not reach 50
            assert on.stats.cached_prompt_tokens == len(prompt) - 1         # the OFF run's KV, reused
            assert list(on.token_ids) == list(off.token_ids) and off.completion_tokens == 48
            assert on.stats.tries > 0
            rolls.append((on.stats.kv_rolls, on.stats))
        assert rolls[0][0] > 0, rolls[0][1]                             # rejected drafts on p
    finally:
        ch.close()
        st.stop()


def test_gemma3_270m_at_n_ctx_8192_keeps_the_window_in_its_local_layers(gemma3_path, monkeypatch):
    m = Model(gemma3_path, repack=False)
    try:
        i = m.info
        assert (i.n_layer, i.n_swa_layers, i.n_swa, i.n_head_kv, i.head_dim) == (18, 15, 512, 1, 256)
        assert ring_of(i) == 768
        with m.new_session(n_ctx=8192, n_threads=1) as s:
            assert s.kv_bytes == (3 * 8192 + 15 * 768) * position_bytes(i) == 36_962_304     # 35.25 MiB
        with m.new_session(n_ctx=8192, n_threads=1, swa_full=True) as f:
            assert f.kv_bytes == 18 * 8192 * position_bytes(i) == 150_994_944               # 144 MiB
        monkeypatch.setenv("ECHOSPEC_MEM_AVAILABLE", "64M")   # the rings fit, every position does not
        with m.new_session(n_ctx=8192, n_threads=1) as s:
            assert s.kv_bytes < 64 << 20
        with pytest.raises(EngineError) as ei:
            m.new_session(n_ctx=8192, n_threads=1, swa_full=True)
        assert ei.value.name == "ES_ERR_NOMEM" and "needs 144.0 MiB" in ei.value.message
    finally:
        m.close()
