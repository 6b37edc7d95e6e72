"""Bitwise contracts of the C engine (services.verifier.engine) on tiny models, and its error paths.

What speculation relies on, each compared with np.array_equal (bitwise):
  * rollback: forward A+B, roll back to len(A), forward C == forward A+C from scratch;
  * verify: one call over N tokens == N one-token calls, every logits row and argmax,
    for N below, at and above the kernel's 32-row activation tile;
  * thread count: n_threads 1, 2 and 3 give the same logits.
Errors: running past n_ctx (ES_ERR_CAPACITY), a bad token id, an empty call,
a rollback past n_past all raise EngineError and leave the KV cache as it was
(checked by running on and comparing with a session that never saw the bad call).
Sampling: seeds, temperature <= 0, top_k = 1.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import ggufgen
from echospec.services.verifier.engine import (ES_ERR_CAPACITY, ES_ERR_INVALID_ARG, MIN_CTX, EngineError, Model,
                                              sample)

RNG = np.random.default_rng(1234)
TOKENS = [int(t) for t in RNG.integers(0, 320, size=48)]

MODELS = [
    pytest.param(dict(arch="llama", matrix_type="Q4_1", embd_type="Q8_0"), id="llama-Q4_1"),
    pytest.param(dict(arch="qwen2", matrix_type="F16", tied=False, rope_base=1e6), id="qwen2-F16"),
    pytest.param(dict(arch="qwen3", matrix_type="Q4_K", embd_type="Q8_0", tied=False, output_type="Q6_K",
                      head_dim=128, **ggufgen.k_type_dims()), id="qwen3-Q4_K"),
]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tiny_model):
    m = Model(tiny_model(**request.param))
    yield m
    m.close()


@pytest.fixture(scope="module")
def small_model(tiny_model):
    m = Model(tiny_model(arch="llama", matrix_type="Q8_0"))
    yield m
    m.close()


def _run(model, chunks, n_threads=1, n_ctx=64):
    """Fresh session; forward each chunk with all logits; return (argmax, logits) concatenated."""
    with model.new_session(n_ctx=n_ctx, n_threads=n_threads) as s:
        outs = [s.forward(c, logits="all") for c in chunks]
        assert s.n_past == sum(len(c) for c in chunks)
    return np.concatenate([a for a, _ in outs]), np.concatenate([lg for _, lg in outs])


# ---- repacked weights -----------------------------------------------------------------

@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "Q5_K"])
def test_repacked_equals_mapped_weights(tiny_model, matrix_type):
    """The SIMD kernels on the repacked copy give bitwise the logits of the scalar kernels on
    the mapped weights (repack=False), for prefill, decode steps and a multi-token call."""
    k = matrix_type.startswith(("Q4_K", "Q5_K"))
    path = tiny_model(arch="llama", matrix_type=matrix_type, embd_type="Q8_0", tied=not k,
                      **(ggufgen.k_type_dims() if k else {}))
    chunks = [TOKENS[:20], TOKENS[20:21], TOKENS[21:26], TOKENS[26:27]]
    a = Model(path)
    b = Model(path, repack=False)
    try:
        am_a, lg_a = _run(a, chunks, n_threads=2)
        am_b, lg_b = _run(b, chunks, n_threads=2)
    finally:
        a.close()
        b.close()
    assert np.array_equal(am_a, am_b)
    assert lg_a.tobytes() == lg_b.tobytes()


# ---- rollback ----------------------------------------------------------------------

@pytest.mark.parametrize("n_a,n_b,n_c", [(7, 5, 6), (1, 1, 1), (12, 33, 9)])
def test_rollback_is_exact(model, n_a, n_b, n_c):
    A, B, C = TOKENS[:n_a], TOKENS[n_a:n_a + n_b], TOKENS[40 - n_c:40]
    with model.new_session(n_ctx=64, n_threads=2) as s:
        s.forward(A + B, logits="none")
        assert s.n_past == n_a + n_b
        s.rollback(n_a)
        assert s.n_past == n_a
        am, got = s.forward(C, logits="all")
    am_ref, ref = _run(model, [A + C], n_threads=2)
    assert np.array_equal(got, ref[n_a:]), "rollback then forward differs from a fresh run"
    assert np.array_equal(am, am_ref[n_a:])


def test_rollback_to_zero_and_repeat(model):
    with model.new_session(n_ctx=64, n_threads=1) as s:
        _, first = s.forward(TOKENS[:9], logits="all")
        for _ in range(3):
            s.rollback(0)
            assert s.n_past == 0
            _, again = s.forward(TOKENS[:9], logits="all")
            assert np.array_equal(first, again)
        s.rollback(9)                      # rollback to n_past itself is a no-op
        assert s.n_past == 9


# ---- verify: batch size does not change any bit --------------------------------------

@pytest.mark.parametrize("n", [2, 5, 17, 32, 33, 40])
def test_one_call_over_n_equals_n_single_steps(model, n):
    prefix, run = TOKENS[:4], TOKENS[4:4 + n]
    am_batch, batch = _run(model, [prefix, run])
    am_single, single = _run(model, [prefix] + [[t] for t in run])
    assert np.array_equal(batch, single), (
        f"rows differ: {np.nonzero((batch != single).any(axis=1))[0].tolist()}, "
        f"max diff {np.abs(batch - single).max():.3g}")
    assert np.array_equal(am_batch, am_single)


# Q4_K_M (Q4_K + Q6_K matrices, Q6_K head) and Q8_0 tiny models of each architecture: the
# packed kernels of the types users deploy, through whole forward passes.
DEPLOYED = [pytest.param(dict(arch=a, matrix_type=t, rope_base=1e6 if a != "llama" else 1e4,
                              **(dict(ggufgen.k_type_dims(), tied=a == "llama") if t == "Q4_K_M" else {})),
                         id=f"{a}-{t}")
            for a in ("llama", "qwen2", "qwen3") for t in ("Q4_K_M", "Q8_0")]


@pytest.mark.parametrize("kw", DEPLOYED)
def test_deployed_types_one_call_equals_single_steps_any_threads(tiny_model, kw):
    """One call over N tokens == N one-token calls, bitwise, for N = 5 and 33 (one and
    several activation tiles) and 1, 2 and 3 threads (the batched call on each; the
    single steps on 1 thread)."""
    m = Model(tiny_model(**kw))
    try:
        prefix = TOKENS[:3]
        am_single, single = _run(m, [prefix] + [[t] for t in TOKENS[3:36]])
        for n in (5, 33):
            for n_threads in (1, 2, 3):
                am, batch = _run(m, [prefix, TOKENS[3:3 + n]], n_threads=n_threads)
                assert np.array_equal(batch, single[:3 + n]), (n, n_threads)
                assert np.array_equal(am, am_single[:3 + n])
    finally:
        m.close()


def test_uneven_splits_equal_one_call(model):
    ref = _run(model, [TOKENS[:45]])[1]
    for cuts in ([3, 10, 11, 30], [1, 2, 3, 4, 5], [44]):
        chunks = [TOKENS[a:b] for a, b in zip([0] + cuts, cuts + [45])]
        assert np.array_equal(_run(model, chunks)[1], ref), cuts


def test_logits_modes_and_argmax(model):
    with model.new_session(n_ctx=64, n_threads=1) as s:
        am_all, all_rows = s.forward(TOKENS[:10], logits="all")
        s.rollback(0)
        am_last, last = s.forward(TOKENS[:10], logits="last")
        s.rollback(0)
        am_none, none = s.forward(TOKENS[:10], logits="none")
    assert none is None
    assert last.shape == (1, model.info.n_vocab) and all_rows.shape == (10, model.info.n_vocab)
    assert np.array_equal(last[0], all_rows[-1])
    assert np.array_equal(am_all, am_last) and np.array_equal(am_all, am_none)
    assert am_all.dtype == np.int32
    assert np.array_equal(am_all, np.argmax(all_rows, axis=1))   # np.argmax: first (lowest) id on ties


# ---- threads ---------------------------------------------------------------------------

def test_thread_count_does_not_change_any_bit(model):
    chunks = [TOKENS[:20], TOKENS[20:21], TOKENS[21:26]]
    ref = _run(model, chunks, n_threads=1)
    for nt in (2, 3):
        got = _run(model, chunks, n_threads=nt)
        assert np.array_equal(got[1], ref[1]), f"n_threads={nt} differs from 1"
        assert np.array_equal(got[0], ref[0])


def test_sessions_are_independent(model):
    a_ref = _run(model, [TOKENS[:6], TOKENS[6:12]])[1]
    b_ref = _run(model, [TOKENS[30:35], TOKENS[35:38]])[1]
    with model.new_session(n_ctx=32, n_threads=1) as a, model.new_session(n_ctx=32, n_threads=2) as b:
        a1 = a.forward(TOKENS[:6], logits="all")[1]
        b1 = b.forward(TOKENS[30:35], logits="all")[1]
        a2 = a.forward(TOKENS[6:12], logits="all")[1]
        b2 = b.forward(TOKENS[35:38], logits="all")[1]
    assert np.array_equal(np.concatenate([a1, a2]), a_ref)
    assert np.array_equal(np.concatenate([b1, b2]), b_ref)


# ---- errors leave the KV cache unchanged ------------------------------------------------

def _continues_like_fresh(s, done, more):
    """The session holding `done` continues exactly like a fresh session fed done + more."""
    got = s.forward(more, logits="all")[1]
    ref = _run(s.model, [c for c in (done, more) if c], n_ctx=s.n_ctx)[1][len(done):]
    return np.array_equal(got, ref)


def test_capacity_error_leaves_state(small_model):
    with small_model.new_session(n_ctx=MIN_CTX, n_threads=1) as s:
        full = MIN_CTX
        assert s.n_ctx == full
        s.forward(TOKENS[:full - 2])
        with pytest.raises(EngineError) as ei:
            s.forward(TOKENS[full - 2:full + 1])      # (full - 2) + 3 > full
        assert ei.value.status == ES_ERR_CAPACITY and ei.value.name == "ES_ERR_CAPACITY"
        assert ei.value.message
        assert s.n_past == full - 2
        assert _continues_like_fresh(s, TOKENS[:full - 2], TOKENS[full - 2:full])   # fills exactly
        assert s.n_past == full
        with pytest.raises(EngineError) as ei:
            s.forward(TOKENS[full:full + 1])
        assert ei.value.status == ES_ERR_CAPACITY
        assert s.n_past == full


def test_capacity_error_on_first_call(small_model):
    with small_model.new_session(n_ctx=MIN_CTX, n_threads=2) as s:
        with pytest.raises(EngineError) as ei:
            s.forward(TOKENS[:MIN_CTX + 1])
        assert ei.value.status == ES_ERR_CAPACITY
        assert s.n_past == 0
        assert _continues_like_fresh(s, [], TOKENS[:MIN_CTX])


def test_n_ctx_below_the_minimum_is_refused(small_model):
    """The engine refuses a KV capacity below ES_MIN_CTX (0 is the default, not a capacity)."""
    for bad in (1, MIN_CTX - 1):
        with pytest.raises(EngineError) as ei:
            small_model.new_session(n_ctx=bad, n_threads=1)
        assert ei.value.status == ES_ERR_INVALID_ARG and "out of range" in ei.value.message


@pytest.mark.parametrize("bad", [-1, 320, 2 ** 31 - 1])
def test_invalid_token_id_leaves_state(small_model, bad):
    n_vocab = small_model.info.n_vocab
    assert n_vocab == 320
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        s.forward(TOKENS[:5])
        with pytest.raises(EngineError) as ei:
            s.forward([TOKENS[5], bad, TOKENS[6]], logits="all")
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert s.n_past == 5
        assert _continues_like_fresh(s, TOKENS[:5], TOKENS[5:9])


@pytest.mark.parametrize("bad", [
    [5, 2 ** 64 - 1], np.array([5, 2 ** 64 - 1], dtype=np.uint64), np.array([5, 2 ** 32 + 3], dtype=np.uint64),
    [5, 2 ** 31], np.array([5, -(2 ** 63)], dtype=np.int64)], ids=["list", "uint64", "uint64-wrap", "int32+1", "int64"])
def test_token_id_outside_int32_is_quoted_as_sent(small_model, bad):
    """The message quotes the id the caller sent (a cast to int64 made uint64 2**64-1 read "token -1")."""
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        with pytest.raises(EngineError) as ei:
            s.forward(bad)
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert f"token {int(bad[1])} at index 1 does not fit in int32" in ei.value.message
        assert s.n_past == 0


def test_empty_forward_raises(small_model):
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        s.forward(TOKENS[:3])
        with pytest.raises(EngineError) as ei:
            s.forward([])
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert s.n_past == 3


@pytest.mark.parametrize("target", [6, 100, -1])
def test_rollback_outside_range_raises(small_model, target):
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        s.forward(TOKENS[:5])
        with pytest.raises(EngineError) as ei:
            s.rollback(target)
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert s.n_past == 5
        assert _continues_like_fresh(s, TOKENS[:5], TOKENS[5:8])


@pytest.mark.parametrize("bad", [[1.7], [1, 2.0], ["3"], [[1, 2]], 5, [True],
                                 [2 ** 31], [5, -2 ** 31 - 1], [2 ** 70]])
def test_tokens_must_be_integers(small_model, bad):
    """Floats, strings, nested lists, scalars and ids outside int32 are refused, not truncated
    or wrapped (found by the new-user trial: [1.7] ran token 1)."""
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        s.forward(TOKENS[:3])
        with pytest.raises(EngineError) as ei:
            s.forward(bad)
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert s.n_past == 3


@pytest.mark.parametrize("target", [1.9, 2 ** 40, "2", None])
def test_rollback_needs_an_int32(small_model, target):
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        s.forward(TOKENS[:3])
        with pytest.raises(EngineError) as ei:
            s.rollback(target)
        assert ei.value.status == ES_ERR_INVALID_ARG
        assert s.n_past == 3


@pytest.mark.parametrize("kw", [dict(n_ctx=2 ** 31), dict(n_threads=2 ** 32), dict(n_ctx=8.5)])
def test_session_params_need_int32(small_model, kw):
    with pytest.raises(EngineError) as ei:
        small_model.new_session(**kw)
    assert ei.value.status == ES_ERR_INVALID_ARG


def test_model_path_not_utf8_loads(tmp_path, tiny_model):
    """A file name that is not UTF-8 (bytes, or the str Python makes of it) opens the model
    (second new-user trial: it raised UnicodeEncodeError)."""
    path = os.fsencode(tiny_model(arch="llama", matrix_type="Q8_0"))
    link = os.fsencode(str(tmp_path)) + b"/\xfe.gguf"
    os.symlink(path, link)
    for p in (link, os.fsdecode(link)):
        m = Model(p)
        assert m.info.n_vocab == 320
        m.close()


def test_model_path_checks(tmp_path):
    with pytest.raises(TypeError):
        Model(None)
    real = tmp_path / "a"
    real.write_bytes(b"GGUF")   # a file the truncated path would name
    with pytest.raises(EngineError) as ei:
        Model(str(real) + "\x00b.gguf")
    assert ei.value.status == ES_ERR_INVALID_ARG and "NUL" in ei.value.message


def test_default_n_ctx_is_min_of_train_and_4096(small_model):
    with small_model.new_session() as s:      # n_ctx=0, n_threads=0 (all cores)
        assert s.n_ctx == min(small_model.info.n_ctx_train, 4096) == 512


# ---- sampling ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows(small_model):
    """A few real logits rows of the tiny model, float32 [8, 320]."""
    return _run(small_model, [TOKENS[:8]])[1]


def _draws(row, n, seed, **kw):
    out, rng = [], seed
    for _ in range(n):
        t, rng = sample(row, rng=rng, **kw)
        out.append(t)
    return out


@pytest.mark.parametrize("kw", [dict(temperature=float("nan")), dict(top_p=float("nan")),
                                dict(min_p=float("nan"))])
def test_sampling_rejects_nan_parameters(rows, kw):
    args = dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, rng=7)
    args.update(kw)
    with pytest.raises(ValueError):
        sample(rows[0], **args)


def test_sampling_rejects_2d_rows_and_inf_logits(rows):
    with pytest.raises(ValueError, match="1-D"):
        sample(rows[:2], temperature=0.0)
    row = rows[0].copy()
    row[3] = np.inf
    assert sample(row, temperature=0.0)[0] == 3     # greedy: the argmax
    with pytest.raises(ValueError):
        sample(row, temperature=0.8, rng=7)          # sampling: refused, not a silent pick


def test_sampling_rejects_nan_logits(rows):
    row = rows[0].copy()
    row[:] = np.nan
    with pytest.raises(ValueError, match="logit 0 is NaN"):
        sample(row, temperature=0.8, rng=7)


@pytest.mark.parametrize("temp", [0.0, -1.0, 0.8])
@pytest.mark.parametrize("at", [0, 17, 319])
def test_sampling_refuses_a_nan_logit_at_any_temperature(rows, temp, at):
    """Greedy returned the NaN's index when it was first (and passed over it elsewhere)."""
    row = rows[0].copy()
    row[at] = np.nan
    with pytest.raises(ValueError, match=f"logit {at} is NaN"):
        sample(row, temperature=temp, rng=7)


def test_sampling_refusals_name_the_cause(rows):
    row = rows[0].copy()
    row[40] = np.inf
    with pytest.raises(ValueError, match="logit 40 is \\+inf"):
        sample(row, temperature=0.8, rng=7)
    with pytest.raises(ValueError, match="top_p is NaN"):
        sample(rows[0], temperature=0.8, top_p=float("nan"), rng=7)


def test_sampling_rejects_rows_without_a_finite_logit(rows):
    row = np.full(rows.shape[1], -np.inf, np.float32)
    with pytest.raises(ValueError, match="no finite logit"):
        sample(row, temperature=1.0, rng=7)          # was: the last id, silently
    row[5] = 0.0
    assert sample(row, temperature=1.0, rng=7)[0] == 5   # one finite logit: always it


@pytest.mark.parametrize("top_k", [10 ** 12, -(2 ** 31) - 1, 2.5, "3", True])
def test_sampling_top_k_must_be_int32(rows, top_k):
    with pytest.raises(ValueError, match="top_k"):
        sample(rows[0], temperature=1.0, top_k=top_k, rng=7)


@pytest.mark.parametrize("rng, err", [(1.5, TypeError), (7.0, TypeError), (True, TypeError), (np.bool_(False), TypeError),
                                      ("7", TypeError), (None, TypeError), (2 ** 64, ValueError),
                                      (-(2 ** 63) - 1, ValueError)])
def test_sampling_rng_must_be_a_64bit_integer(rows, rng, err):
    """A float seed was truncated by int() (1.5 drew as seed 1); a bool or a 65-bit int passed silently."""
    with pytest.raises(err, match="rng"):
        sample(rows[0], temperature=1.0, rng=rng)


def test_sampling_rng_accepts_both_64bit_readings(rows):
    assert sample(rows[0], temperature=1.0, rng=-1) == sample(rows[0], temperature=1.0, rng=2 ** 64 - 1)
    assert sample(rows[0], temperature=1.0, rng=np.uint64(2 ** 64 - 1)) == sample(rows[0], temperature=1.0, rng=-1)
    assert sample(rows[0], temperature=1.0, rng=np.int64(9)) == sample(rows[0], temperature=1.0, rng=9)


def test_sampling_same_seed_same_tokens(rows):
    kw = dict(temperature=1.5, top_k=50, top_p=0.95, min_p=0.01)
    for row in rows[:3]:
        assert _draws(row, 40, seed=42, **kw) == _draws(row, 40, seed=42, **kw)


def test_sampling_different_seeds_differ(rows):
    a = _draws(rows[0], 40, seed=1, temperature=2.0)
    b = _draws(rows[0], 40, seed=2, temperature=2.0)
    assert a != b
    assert len(set(a)) > 5                          # it is sampling, not always the argmax
    assert all(0 <= t < rows.shape[1] for t in a + b)


@pytest.mark.parametrize("temp", [0.0, -1.0])
def test_sampling_temperature_zero_is_argmax_and_keeps_rng(rows, temp):
    for row in rows:
        tok, rng = sample(row, temperature=temp, top_k=40, top_p=0.5, rng=777)
        assert tok == int(np.argmax(row))
        assert rng == 777


def test_sampling_top_k_one_is_argmax(rows):
    for i, row in enumerate(rows):
        tok, rng = sample(row, temperature=1.0, top_k=1, rng=1000 + i)
        assert tok == int(np.argmax(row))


def test_sampling_advances_rng(rows):
    _, r1 = sample(rows[0], temperature=1.0, rng=5)
    _, r2 = sample(rows[0], temperature=1.0, rng=r1)
    assert len({5, r1, r2}) == 3


def test_sampling_respects_top_k(rows):
    row = rows[1]
    allowed = set(np.argsort(-row)[:3].tolist())
    assert set(_draws(row, 60, seed=9, temperature=5.0, top_k=3)) <= allowed


def test_forward_logits_that_is_not_a_name_is_a_value_error(small_model):
    # was: TypeError "unhashable type: 'list'" for logits=["all"]
    with small_model.new_session(n_ctx=32, n_threads=1) as s:
        for bad in (["all"], {"all": 1}, 1):
            with pytest.raises(ValueError, match="logits must be one of"):
                s.forward(TOKENS[:2], logits=bad)
        assert s.n_past == 0


def test_session_threads_reads_back_a_python_int(small_model):
    # was: a numpy integer set as the count came back as that numpy integer
    import numpy as np
    with small_model.new_session(n_ctx=32, n_threads=2) as s:
        s.threads = np.int64(1)
        assert type(s.threads) is int and s.threads == 1
