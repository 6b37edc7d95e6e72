"""Long context on tiny models: a KV cache filled to n_ctx 4096, rollback and verify at its end.

The attention works by KV blocks of 64 positions fixed by absolute position
(engine_c/src/attention.c): calls of up to 8 tokens split each head's blocks
across threads (key split), longer calls split the tokens (query split). Both
must give every query bitwise the result it has alone. Checked here with
np.array_equal (bitwise):
  * a 12-token call (query split) and a 5-token call (key split) that cross a
    block boundary near position 4032 == the same tokens one at a time;
  * the last call that fills the cache to exactly n_ctx == single steps;
  * rollback from the full cache, then the same tokens again == the first time;
  * n_threads 1 and 2 agree.
And against the numpy reference (tests/reference.py) over 200 positions (four
blocks: the fold of block results is exercised, which a 10-token prompt is not).
"""
from __future__ import annotations

import numpy as np
import pytest

import ggufgen
from reference import Reference, align_rounding
from echospec.services.verifier.engine import ES_ERR_CAPACITY, EngineError, Model

N_CTX = 4096
RNG = np.random.default_rng(4096)
FILL = [int(t) for t in RNG.integers(0, 320, size=N_CTX)]
P0 = 4026                     # verify [P0, P0 + 12) crosses the block boundary at 4032

MODELS = [
    pytest.param(dict(arch="llama", matrix_type="Q4_1", n_head=6, n_head_kv=2, n_embd=96, n_ff=256),
                 id="llama-Q4_1-gqa3"),
    pytest.param(dict(arch="qwen3", matrix_type="Q8_0", head_dim=128, rope_base=1e6), id="qwen3-Q8_0-hd128"),
]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tiny_model):
    m = Model(tiny_model(**request.param))
    yield m
    m.close()


def _filled(model, n_threads: int, n_past: int):
    s = model.new_session(n_ctx=N_CTX, n_threads=n_threads)
    for a in range(0, n_past, 1000):
        s.prefill(FILL[a:min(a + 1000, n_past)])
    assert s.n_past == n_past
    return s


def _singles(s, toks):
    outs = [s.forward([t], logits="all") for t in toks]
    return np.concatenate([a for a, _ in outs]), np.concatenate([lg for _, lg in outs])


@pytest.mark.parametrize("n_threads", [1, 2])
def test_full_cache_verify_equals_single_steps_and_rollback_is_exact(model, n_threads):
    toks = FILL[P0:]
    with _filled(model, n_threads, P0) as s:
        a1, l1 = _singles(s, toks[:12])
        s.rollback(P0)
        a12, l12 = s.forward(toks[:12], logits="all")          # query split
        assert np.array_equal(a12, a1) and np.array_equal(l12, l1)
        s.rollback(P0 + 3)
        a5, l5 = s.forward(toks[3:8], logits="all")            # key split, across position 4032
        assert np.array_equal(a5, a1[3:8]) and np.array_equal(l5, l1[3:8])
        s.rollback(P0)
        s.prefill(toks[:N_CTX - 7 - P0])
        assert s.n_past == N_CTX - 7
        a7, l7 = _singles(s, toks[-7:])                        # up to exactly n_ctx
        assert s.n_past == N_CTX
        with pytest.raises(EngineError) as e:
            s.forward([1])
        assert e.value.status == ES_ERR_CAPACITY and s.n_past == N_CTX
        s.rollback(N_CTX - 7)
        b7, m7 = s.forward(toks[-7:], logits="all")            # the same 7 tokens in one call
        assert np.array_equal(b7, a7) and np.array_equal(m7, l7)
        s.rollback(P0)                                         # far back from the full cache
        b1, m1 = _singles(s, toks[:12])
        assert np.array_equal(b1, a1) and np.array_equal(m1, l1)
    if n_threads == 2:
        with _filled(model, 1, P0) as s1:
            c1, k1 = _singles(s1, toks[:12])
        assert np.array_equal(c1, a1) and np.array_equal(k1, l1)


def test_attention_over_several_blocks_matches_reference(tiny_spec):
    """200 positions (blocks 0..3) against the numpy reference, within the tight tolerance of
    tests/test_engine_reference.py (1e-4 of the logit std, rounding flips aligned)."""
    spec = tiny_spec(arch="llama", matrix_type="Q8_0", n_head=6, n_head_kv=2, n_embd=96, n_ff=256)
    toks = FILL[:200]
    with Model(spec.path) as m, m.new_session(n_ctx=256, n_threads=2) as s:
        rows = [s.forward(toks[:120], logits="all")[1], s.forward(toks[120:192], logits="all")[1]]  # query split
        rows += [s.forward(toks[i:i + 4], logits="all")[1] for i in range(192, 200, 4)]          # key split
    got = np.concatenate(rows)
    R = Reference(spec.path, act_quant=True)
    tol = 1e-4 * float(R.forward(toks).std())
    # K and V values that are small against their terms (cancellation) differ from the float64
    # reference by tens of float32 ulps, so their float16 roundings are searched 64 ulps wide
    ref, flips = align_rounding(R, toks, got, tol, near=1e-4, max_flips=8, near_f16=64 * 2.0 ** -13,
                                max_tries=150)
    err = np.abs(got - ref).max()
    print(f"200 positions: max |engine - ref| {err:.3g} ({err / ref.std():.2e} of std); flips {flips}")
    assert err <= tol, np.abs(got - ref).max(axis=1)
