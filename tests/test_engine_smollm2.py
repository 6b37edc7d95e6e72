"""The C engine on the real model, SmolLM2-135M-Instruct Q4_1, against the numpy reference.

The prompt is rendered with SmolLM2's chat template (ChatML with its default
system message) and tokenized with the model's own tokenizer. The engine
decodes 64 greedy tokens; the reference (float64, with the engine's int8
activation quantization emulated; tests/reference.py) is run along the
engine's path and reports its own argmax and top-2 margin at every step.

Why the real-model tolerances are loose where the tiny-model ones are tight
(tests/test_engine_reference.py holds the engine to 1e-4 of the logit std):
with int8 activations, a value a few ulps from a rounding boundary rounds one
way in one float32 implementation and the other way in another, and over 30
layers of 576-3072 quantized activations per token such flips always happen
and add up. Measured on this model (3 chat prompts, 64 steps each):
  * two correct references that differ only in float precision (float32 vs
    float64, same int8 emulation) differ on the first-step logits by up to
    0.88 (max) and 0.22 (rms) logit units; the engine vs the float64 reference
    by 0.81 / 0.17; the int8 emulation vs exact float64 arithmetic by 0.70 / 0.16;
  * the change of the top-2 margin between engine and reference along the
    path: median 0.10-0.14, 90th percentile 0.25-0.30, max 0.39 logit units.
So no independent float reference can hold this engine tighter than about
0.4 logit units per decision. The tolerances:
  FIRST_STEP_RMS = 0.5, FIRST_STEP_MAX = 2.5 logit units (logit std about 3.4);
  NEAR_TIE = 0.5: where the engine's token differs from the reference's argmax,
  the reference's top-2 margin must be below this and the engine's token must be
  the reference's second choice. A broken kernel, RoPE or tokenizer gives rms
  errors of several logits and diverges at margins of several logits.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import chatml
from echospec.services.verifier.engine import Model

N_STEPS = 64
PROMPT = "Give me three tips for staying healthy."
FIRST_STEP_RMS = 0.5
FIRST_STEP_MAX = 2.5
NEAR_TIE = 0.5
MAX_PARTINGS = 4          # near-tie partings allowed over the 64 steps (measured: 1-2)
COMMON_WORDS = {"the", "and", "to", "of", "a", "is", "for", "your", "in", "you", "it", "that", "with", "can"}


@pytest.fixture(scope="module")
def engine_model(smollm2_path):
    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return list(smollm2_tokenizer.encode(chatml(PROMPT)))


@pytest.fixture(scope="module")
def engine_run(engine_model, prompt_ids):
    """Engine greedy decode: (tokens [64], logits rows float32 [64, n_vocab]) after prefill."""
    with engine_model.new_session(n_ctx=256, n_threads=2) as s:
        am, last = s.forward(prompt_ids, logits="last")
        toks, rows = [int(am[-1])], [last[0]]
        for _ in range(N_STEPS - 1):
            am, last = s.forward([toks[-1]], logits="last")
            toks.append(int(am[0]))
            rows.append(last[0])
    return toks, np.stack(rows)


@pytest.fixture(scope="module")
def reference_run(smollm2_reference, prompt_ids, engine_run):
    """The reference along the engine's path: its argmax, top-2 and margin at each of the 64 steps."""
    toks, _ = engine_run
    return smollm2_reference.greedy(prompt_ids, N_STEPS, force=toks, keep_logits=True)


def test_model_info(engine_model):
    i = engine_model.info
    assert (i.arch, i.n_layer, i.n_embd, i.n_head, i.n_head_kv, i.head_dim, i.n_ff, i.n_vocab) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert (i.rope_dim, i.rope_neox, i.tied_output) == (64, False, True)
    assert i.rope_freq_base == pytest.approx(100000.0)
    assert i.norm_eps == pytest.approx(1e-5)


def test_first_step_logits_close_to_reference(engine_run, reference_run):
    got = engine_run[1][0].astype(np.float64)
    ref = reference_run.logits_first
    d = got - ref
    rms, mx = float(np.sqrt(np.mean(d * d))), float(np.abs(d).max())
    print(f"first-step logits: rms {rms:.3f}, max {mx:.3f} logit units (tol {FIRST_STEP_RMS} / {FIRST_STEP_MAX}); "
          f"reference std {ref.std():.3f}")
    assert rms <= FIRST_STEP_RMS and mx <= FIRST_STEP_MAX
    # The top candidates agree: the engine's top 5 are among the reference's top 10.
    assert set(np.argsort(-got)[:5]) <= set(np.argsort(-ref)[:10])


def test_greedy_continuation_matches_reference_up_to_near_ties(engine_run, reference_run, smollm2_tokenizer):
    toks, _ = engine_run
    g = reference_run
    partings = [i for i in range(N_STEPS) if g.tokens[i] != toks[i]]
    lines = []
    for i in partings:
        lines.append(f"step {i}: engine {toks[i]!r} ({smollm2_tokenizer.decode([toks[i]])!r}), reference "
                     f"{g.tokens[i]!r} ({smollm2_tokenizer.decode([g.tokens[i]])!r}), reference top-2 margin "
                     f"{g.margins[i]:.4f} (near-tie < {NEAR_TIE})")
    if partings:
        print(f"engine and reference part at {len(partings)} of {N_STEPS} steps, each a near-tie; identical for "
              f"the first {partings[0]} tokens:\n  " + "\n  ".join(lines))
    else:
        print(f"engine and reference agree on all {N_STEPS} greedy tokens (smallest reference margin "
              f"{min(g.margins):.4f})")
    for i in partings:
        assert g.margins[i] < NEAR_TIE, "parting at a clear decision: " + lines[partings.index(i)]
        assert toks[i] == g.top2[i][1], "engine's token is not the reference's second choice: " + \
            lines[partings.index(i)]
    assert len(partings) <= MAX_PARTINGS, "\n".join(lines)


def test_continuation_is_sensible_english(engine_run, smollm2_tokenizer):
    toks, _ = engine_run
    text = smollm2_tokenizer.decode(toks)
    print(f"engine continuation: {text!r}")
    body = text.split("<|im_end|>")[0]
    assert len(body) >= 120, text                             # the answer is not cut short
    ascii_ok = sum(c.isascii() and (c.isalnum() or c in " \n.,:;'!?-()\"") for c in body) / len(body)
    assert ascii_ok > 0.95, text
    words = re.findall(r"[A-Za-z']+", body.lower())
    assert len(words) >= 25, text
    assert len(COMMON_WORDS & set(words)) >= 5, text
    assert len(set(words)) >= 0.4 * len(words), text          # not a loop of one phrase
    assert any(w in words for w in ("health", "healthy", "water", "sleep", "exercise", "diet")), text


def test_smollm2_verify_equals_decode_steps_bitwise(engine_model, prompt_ids, engine_run):
    """A verify-shaped call (last token + 8 drafts) on the real model equals 9 decode steps, bitwise."""
    toks, _ = engine_run
    run = toks[:9]
    with engine_model.new_session(n_ctx=256, n_threads=2) as a, \
            engine_model.new_session(n_ctx=256, n_threads=1) as b:
        a.forward(prompt_ids)
        b.forward(prompt_ids)
        am_batch, batch = a.forward(run, logits="all")
        single = [b.forward([t], logits="last") for t in run]
        assert np.array_equal(batch, np.concatenate([lg for _, lg in single]))
        assert np.array_equal(am_batch, np.concatenate([am for am, _ in single]))
        assert list(am_batch[:8]) == toks[1:9]        # the greedy path accepts its own continuation
        # Roll back the batch to 3 accepted tokens and continue: equals the straight decode.
        a.rollback(len(prompt_ids) + 3)
        _, cont = a.forward(run[3:5], logits="all")
        assert np.array_equal(cont, batch[3:5])


KV_F16_KLD_MEAN = 1e-5    # nats, over the positions of the prompt and the 64-step path (measured 1.0e-6)
KV_F16_KLD_MAX = 2e-4     # (measured 2.1e-5)


def test_f16_kv_cache_stays_close_to_a_float32_cache(smollm2_reference, prompt_ids, engine_run):
    """The KV cache type: the float16 cache (the engine's, kv_f16=True in the reference) against a
    float32 cache, on the float64 reference with everything else equal and exact activations
    (act_quant off: with int8 activations, the rounding flips any small difference sets off
    would be measured instead of the cache), along the prompt and the engine's 64-token path.
    Bound: KL(p_f32 || p_f16) of the next-token distributions, mean <= KV_F16_KLD_MEAN and
    max <= KV_F16_KLD_MAX nats per position (the measured figures are printed)."""
    toks = list(prompt_ids) + engine_run[0]
    R = smollm2_reference
    try:
        R.act_quant = False
        R.kv_f16 = False
        a = R.forward(toks)
        R.kv_f16 = True
        b = R.forward(toks)
    finally:
        R.kv_f16, R.act_quant = True, True

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    la, lb = log_softmax(a), log_softmax(b)
    kld = (np.exp(la) * (la - lb)).sum(axis=1)
    print(f"f16 vs f32 KV cache over {len(toks)} positions: KLD mean {kld.mean():.2e}, max {kld.max():.2e} nats; "
          f"argmax agrees at {np.mean(a.argmax(1) == b.argmax(1)):.3f} of positions")
    assert kld.mean() <= KV_F16_KLD_MEAN and kld.max() <= KV_F16_KLD_MAX


def _rss_anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    pytest.fail("no RssAnon in /proc/self/status")


def test_a_short_session_holds_the_kv_memory_it_uses(engine_model):
    # was 43.5 MB a session at n_ctx 2048 where transparent huge pages are on for every mapping:
    # a 2 MiB page held the starts of 8 (layer, KV head) runs, so the first token faulted in the
    # whole cache (30 positions use 30 x 30 layers x 2 x 192 x 2 bytes = 0.7 MB of it)
    sessions = []
    before = _rss_anon_mb()
    for _ in range(4):
        s = engine_model.new_session(n_ctx=2048, n_threads=1)
        s.prefill(list(range(100, 130)))
        sessions.append(s)
    per_session = (_rss_anon_mb() - before) / 4
    for s in sessions:
        s.close()
    assert per_session < 8, f"{per_session:.1f} MB resident per 30-token session"
