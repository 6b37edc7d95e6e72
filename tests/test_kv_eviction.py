"""KV eviction (StreamingLLM's attention sinks plus a recent window), opt-in.

Engine (es_session_params kv_sinks S, kv_window W): every layer's query at position p attends
[0, S) U (p - W, p], positions absolute. Checked on a tiny model:
  * a greedy generation four times longer than S + W, past n_ctx, completes; the KV bytes the
    engine reports stay the sinks plus the ring at every step (a plain session of that n_ctx
    stops with ES_ERR_CAPACITY);
  * every logits row matches the numpy reference (tests/reference.py) run with the same
    eviction rule (the tight tolerance of test_engine_long_context.py), and the reference
    without eviction does not match the rows past S + W (so the rule is what is compared);
  * es_decode past n_ctx gives the same tokens; a rollback as deep as the ring holds works,
    one deeper is refused naming eviction; bad parameters are refused.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference import Reference, align_rounding
from echospec.services.verifier.engine import (ES_ERR_CAPACITY, ES_ERR_INVALID_ARG, EngineError,
                                               Model)

S, W, SLACK = 4, 28, 16
N_CTX = 64
PROMPT = [11, 200, 37, 5, 91, 150, 64, 3, 250, 18]
N_GEN = 4 * (S + W)                          # 128 tokens: 138 positions, past n_ctx 64
SPEC = dict(arch="llama", matrix_type="Q8_0", n_head=6, n_head_kv=2, n_embd=96, n_ff=256)


def _kv_bytes(info, positions_per_layer: int) -> int:
    return 2 * info.n_layer * positions_per_layer * info.n_head_kv * info.head_dim * 2


@pytest.fixture(scope="module")
def run(tiny_spec):
    """The evicting greedy run: (spec, tokens fed, logits rows [positions, n_vocab], model)."""
    spec = tiny_spec(**SPEC)
    m = Model(spec.path)
    with m.new_session(n_ctx=N_CTX, n_threads=2, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        bound = _kv_bytes(m.info, 64 + (W + SLACK + 63) // 64 * 64)   # one sink block, a ring of 64
        assert s.kv_bytes == bound
        am, lg = s.forward(PROMPT, logits="all")
        rows, fed = [lg], list(PROMPT)
        tok = int(am[-1])
        for _ in range(N_GEN):
            fed.append(tok)
            am, lg = s.forward([tok], logits="all")
            rows.append(lg)
            tok = int(am[-1])
            assert s.kv_bytes == bound
        assert s.n_past == len(PROMPT) + N_GEN > N_CTX
        yield spec, fed, np.concatenate(rows), m
    m.close()


def test_generation_runs_past_n_ctx_in_bounded_memory(run):
    spec, fed, rows, m = run
    with m.new_session(n_ctx=N_CTX, n_threads=1) as plain:
        plain.prefill(fed[:N_CTX])
        with pytest.raises(EngineError) as e:
            plain.forward([fed[N_CTX]])
        assert e.value.status == ES_ERR_CAPACITY
        assert plain.kv_bytes == _kv_bytes(m.info, N_CTX)
    # the evicting session's memory does not grow with the generation: at 1024 positions as at 0
    with m.new_session(n_ctx=N_CTX, n_threads=1, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        before = s.kv_bytes
        s.prefill((fed * 8)[:1024])
        assert s.n_past == 1024 and s.kv_bytes == before
    assert rows.shape == (len(fed), m.info.n_vocab)


def test_logits_match_the_reference_with_the_same_eviction_rule(run):
    spec, fed, rows, m = run
    R = Reference(spec.path, act_quant=True, kv_sinks=S, kv_window=W)
    tol = 1e-4 * float(R.forward(fed).std())
    ref, flips = align_rounding(R, fed, rows, tol, near=1e-4, max_flips=8, near_f16=64 * 2.0 ** -13,
                                max_tries=150)
    err = np.abs(rows - ref).max()
    print(f"{len(fed)} positions: max |engine - ref| {err:.3g} ({err / ref.std():.2e} of std); flips {flips}")
    assert err <= tol, np.abs(rows - ref).max(axis=1)
    # greedy: the engine's tokens are the reference's argmax wherever its margin is clear
    top = np.sort(ref, axis=1)
    clear = (top[:, -1] - top[:, -2]) > 4 * tol
    assert np.array_equal(rows.argmax(axis=1)[clear], ref.argmax(axis=1)[clear])
    assert clear.mean() > 0.9
    # without eviction the reference agrees only before position S + W
    full = Reference(spec.path, act_quant=True).forward(fed)
    dev = np.abs(rows - full).max(axis=1)
    assert dev[:S + W].max() <= 4 * tol
    assert dev[S + W:].min() > 10 * tol, dev[S + W:].min()


def test_decode_rollback_and_bad_parameters(run):
    spec, fed, rows, m = run
    with m.new_session(n_ctx=N_CTX, n_threads=2, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        s.prefill(PROMPT)
        toks, _ = s.decode(fed[len(PROMPT)], N_GEN)        # in the engine, past n_ctx
        assert toks == [int(t) for t in rows[len(PROMPT):].argmax(axis=1)]
        n = s.n_past
        reach = s.min_rollback
        ring = (W + SLACK + 63) // 64 * 64
        assert reach == n - (ring - W + 1)
        with pytest.raises(EngineError, match="out of reach.*KV eviction"):
            s.rollback(reach - 1)
        assert s.n_past == n
        s.rollback(reach)
        a, lg = s.forward(fed[reach:], logits="all")
        assert np.array_equal(lg, rows[reach:])
        s.rollback(0)                                       # a reset always works
        assert s.min_rollback == 0
    for sinks, window in [(4, 0), (-1, 16), (0, -1), (4, 1 << 20)]:
        with pytest.raises(EngineError) as e:
            m.new_session(n_ctx=N_CTX, kv_sinks=sinks, kv_window=window)
        assert e.value.status == ES_ERR_INVALID_ARG and "kv_window" in e.value.message

