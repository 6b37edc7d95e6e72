"""The C engine's logits against the numpy reference (tests/reference.py) on tiny random GGUF models.

Every architecture (llama, qwen2, qwen3 with head_dim != n_embd / n_head) times
every tensor type as the block-matrix type (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), plus mixed files (Q8_0 / F16 embeddings, tied
and untied outputs, GQA ratios, partial RoPE), over a 10-token prompt.

Tolerance: max |engine - reference| <= TOL_REL * std(reference logits) for every
logit of every position, TOL_REL = 1e-4 (the logit std of these models is
about 2 to 4.5, so that is 2e-4 to 4.5e-4 in logit units).
  * F32 / F16 / BF16: the reference is float64 over the same float weights; the
    engine's float32 arithmetic measured 0.6e-6 to 1.4e-6 of the std here.
  * Quantized types: the engine quantizes activations to int8 per 32-element
    block (per 256-element super-block for Q4_K, Q5_K, Q6_K) before each
    quantized matmul. The reference emulates that exactly
    (act_quant=True), because without it the two part by 4-7% of the std
    (measured), a gap that would hide a subtly wrong kernel. With it they agree
    to 0.5e-6 to 1e-6 of the std (measured), except where an activation x * id
    falls within ~1e-5 of a rounding boundary k + 1/2 and float32 vs float64
    round it differently (one such flip moves the logits by up to ~3% of the
    std). reference.align_rounding inverts such roundings (at most MAX_FLIPS,
    each within NEAR of a boundary) and the test reports them; any other
    difference must still meet TOL_REL.
  * Every type: the KV cache holds float16 (the reference rounds K and V the same
    way, kv_f16). A key or value whose float32 value lies within a few float32
    ulps of a float16 midpoint may round the other way in the engine (its float32
    values are a few ulps from ours); one such flip moves the logits by up to
    ~1e-4 of the std. align_rounding inverts those too, under the same limits.
  A wrong kernel, RoPE layout, bias, norm or head grouping moves the logits by
  10-100% of the std, three or more orders of magnitude over the tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest

import ggufgen
from reference import Reference, align_rounding
from echospec.services.verifier.engine import Model

TOL_REL = 1e-4       # of the reference logits' std, per element
NEAR = 1e-4          # a rounding may be inverted only if x * id is this close to k + 1/2
MAX_FLIPS = 6      # roundings within NEAR of a boundary that may be inverted (F16 KV + int8 activations)
PROMPT = [5, 17, 200, 33, 101, 7, 250, 64, 3, 150]


def _case_kwargs(arch: str, ty: str) -> dict:
    """The grid: llama tied; qwen2 untied with biases; qwen3 tied with head_dim != n_embd / n_head."""
    kw: dict = dict(arch=arch, matrix_type=ty)
    if ty in ggufgen.K_TYPES:
        kw.update(ggufgen.k_type_dims())            # n_embd 256, n_ff 512: rows a multiple of 256
        if arch == "qwen3":
            kw["head_dim"] = 128                      # n_embd / n_head = 64
    elif arch == "qwen3":
        kw["head_dim"] = 32                           # n_embd / n_head = 16
    if arch == "qwen2":
        kw["tied"] = False
    if arch != "llama":
        kw["rope_base"] = 1e6
    return kw


GRID = [pytest.param(_case_kwargs(a, t), id=f"{a}-{t}") for a in ggufgen.ARCHS for t in ggufgen.ALL_TYPES]

MIXED = [
    pytest.param(dict(arch="llama", matrix_type="Q4_1", embd_type="Q8_0", n_head=6, n_head_kv=2, n_embd=96,
                      n_ff=256), id="smollm2-like-llama-Q4_1-embd-Q8_0-tied-gqa3"),
    pytest.param(dict(arch="qwen3", matrix_type="Q4_K", embd_type="F16", tied=False, output_type="Q6_K",
                      rope_base=1e6, **ggufgen.k_type_dims()), id="qwen3-Q4_K-embd-F16-output-Q6_K"),
    pytest.param(dict(arch="qwen2", matrix_type="Q8_0", embd_type="F16", rope_base=1e6),
                 id="qwen2-Q8_0-embd-F16-tied"),
    pytest.param(dict(arch="llama", matrix_type="F32", embd_type="Q8_0", tied=False, output_type="F16"),
                 id="llama-F32-embd-Q8_0-output-F16"),
    pytest.param(dict(arch="qwen3", matrix_type="Q5_0", embd_type="Q8_0", tied=False, output_type="Q8_0"),
                 id="qwen3-Q5_0-embd-Q8_0-untied-head_dim-default"),
    pytest.param(dict(arch="llama", matrix_type="Q8_0", n_head=8, n_head_kv=2, n_embd=128, n_ff=256),
                 id="llama-gqa4"),
    pytest.param(dict(arch="qwen2", matrix_type="Q4_0", n_head=4, n_head_kv=4, rope_base=1e6), id="qwen2-mha"),
    pytest.param(dict(arch="llama", matrix_type="F16", head_dim=32, rope_dim=16), id="llama-partial-rope"),
    pytest.param(dict(arch="qwen3", matrix_type="BF16", head_dim=32, rope_dim=16), id="qwen3-partial-rope"),
]


def _check(tiny_spec, kw):
    spec = tiny_spec(**kw)
    with Model(spec.path) as m:
        info = m.info
        assert (info.arch, info.n_layer, info.n_embd, info.n_head, info.n_head_kv, info.head_dim, info.n_ff,
                info.n_vocab) == (spec.arch, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv,
                                  spec.head_dim, spec.n_ff, spec.n_vocab)
        assert info.rope_dim == spec.rope_dim
        assert info.rope_neox == (spec.arch != "llama")
        assert info.tied_output == spec.tied
        assert info.rope_freq_base == pytest.approx(spec.rope_base)
        with m.new_session(n_ctx=32, n_threads=1) as s:
            argmax, got = s.forward(PROMPT, logits="all")
    assert got.shape == (len(PROMPT), spec.n_vocab) and got.dtype == np.float32
    quantized = any(t not in ("F32", "F16", "BF16") for t in (spec.matrix_type, spec.embd_type,
                                                             kw.get("output_type", spec.matrix_type)))
    R = Reference(spec.path, act_quant=quantized)
    ref = R.forward(PROMPT)
    tol = TOL_REL * float(ref.std())
    ref, flips = align_rounding(R, PROMPT, got, tol, near=NEAR, max_flips=MAX_FLIPS)
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    print(f"{spec.arch} {spec.matrix_type} embd {spec.embd_type}: max |engine - ref| = {err.max():.3g} "
          f"({err.max() / ref.std():.2e} of std {ref.std():.3g}; tol {TOL_REL:.0e}); "
          f"rounding flips aligned: {len(flips)} {flips}")
    assert err.max() <= tol, (
        f"engine logits differ from the reference by {err.max():.4g} (= {err.max() / ref.std():.3g} of the "
        f"logit std) at position {worst[0]}, token {worst[1]}; tolerance {tol:.3g}; per-position max "
        f"{np.round(err.max(axis=1), 5).tolist()}")
    # The greedy argmax agrees wherever the reference is not within the tolerance of a tie.
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    np.testing.assert_array_equal(argmax[clear], np.argmax(ref, axis=1)[clear])


@pytest.mark.parametrize("kw", GRID)
def test_engine_matches_reference(tiny_spec, kw):
    _check(tiny_spec, kw)


@pytest.mark.parametrize("kw", MIXED)
def test_engine_matches_reference_mixed_files(tiny_spec, kw):
    _check(tiny_spec, kw)


def test_engine_matches_reference_after_decode_steps(tiny_spec):
    """Positions past a prefill: prefill 6 tokens, then 4 single-token steps, against one reference pass."""
    spec = tiny_spec(**_case_kwargs("qwen3", "Q4_1"))
    with Model(spec.path) as m, m.new_session(n_ctx=32, n_threads=2) as s:
        rows = [s.forward(PROMPT[:6], logits="all")[1]]
        rows += [s.forward([t], logits="last")[1] for t in PROMPT[6:]]
    got = np.concatenate(rows)
    R = Reference(spec.path, act_quant=True)
    tol = TOL_REL * float(R.forward(PROMPT).std())
    ref, flips = align_rounding(R, PROMPT, got, tol, near=NEAR, max_flips=MAX_FLIPS)
    assert np.abs(got - ref).max() <= tol, np.abs(got - ref).max(axis=1)
