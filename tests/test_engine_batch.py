"""es_forward_batch (engine.forward_batch): one forward over several sessions gives each
session bitwise what Session.forward / Session.prefill give it alone, in any order and
on any thread count; a bad item fails alone with its KV cache unchanged. A malformed item (not
a session, a short tuple, a bad head or logits) is refused before any item of the batch runs."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec._engine import ffi
from echospec.services.verifier.engine import EngineError, Model, forward_batch

N_VOCAB = 256

# (history prefilled alone, the steps: (tokens, head, logits)) per session
PLAN = [
    (70, [(1, "all", "last"), (1, "all", "last")]),     # decode past a KV block boundary
    (0, [(40, "last", "last"), (30, "last", "none")]),  # a prompt in chunks
    (10, [(5, "all", "all"), (5, "all", "none")]),      # verifies of [pending] + 4 drafts
    (60, [(9, "all", "all"), (1, "all", "none")]),
]


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, tmp_path_factory):
    arch, mt = request.param
    path = tmp_path_factory.mktemp("batch") / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, matrix_type=mt, seed=5)
    m = Model(str(path))
    yield m
    m.close()


def _tokens(k: int, pos: int, n: int) -> list[int]:
    return [(p * 37 + k * 101 + 5) % N_VOCAB for p in range(pos, pos + n)]


def _sessions(model, n_threads: int) -> list:
    out = []
    for k, (hist, _) in enumerate(PLAN):
        s = model.new_session(n_ctx=128, n_threads=n_threads)
        if hist:
            s.prefill(_tokens(k, 0, hist))
        out.append(s)
    return out


def _alone(s, tokens, head, logits):
    if head == "last":
        tok, lg = s.prefill(tokens, logits=logits != "none")
        return np.array([tok], dtype=np.int32), lg
    return s.forward(tokens, logits=logits)


def _same(a, b) -> bool:
    (am, al), (bm, bl) = a, b
    if not np.array_equal(am, bm) or (al is None) != (bl is None):
        return False
    return al is None or np.array_equal(al.view(np.uint32), bl.view(np.uint32))


@pytest.mark.parametrize("n_threads,order_seed", [(1, None), (2, 1), (3, 2)])
def test_forward_batch_equals_each_session_alone(model, n_threads, order_seed):
    ref_sessions, got_sessions = _sessions(model, 1), _sessions(model, n_threads)
    order = list(range(len(PLAN)))
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    for r in range(2):
        items, want = [], {}
        for k in order:
            hist, steps = PLAN[k]
            n, head, logits = steps[r]
            toks = _tokens(k, hist + sum(s[0] for s in steps[:r]), n)
            want[k] = _alone(ref_sessions[k], toks, head, logits)
            items.append((got_sessions[k], toks, head, logits))
        got = forward_batch(items)
        for k, res in zip(order, got):
            assert not isinstance(res, EngineError), res
            assert _same(res, want[k]), f"session {k} round {r}"
            assert got_sessions[k].n_past == ref_sessions[k].n_past


def test_a_bad_item_fails_alone_with_its_kv_unchanged(model):
    a, b, c = (model.new_session(n_ctx=16, n_threads=2) for _ in range(3))
    ref = model.new_session(n_ctx=16, n_threads=1)
    for s in (a, b, c, ref):
        s.prefill([1, 2, 3])
    got = forward_batch([(a, [4, 5], "all", "all"), (b, [4, 10 ** 6], "all", "none"),
                         (c, [4] * 14, "all", "none"), (b, [7], "last", "last")])
    want = ref.forward([4, 5], logits="all")
    assert _same(got[0], want) and a.n_past == 5
    assert isinstance(got[1], EngineError) and got[1].name == "ES_ERR_INVALID_ARG"
    assert "same session" in got[1].message
    assert isinstance(got[2], EngineError) and got[2].name == "ES_ERR_CAPACITY" and "KV cache full" in got[2].message
    assert isinstance(got[3], EngineError) and got[3].name == "ES_ERR_INVALID_ARG"   # b's second item
    assert b.n_past == 3 and c.n_past == 3
    # their caches are unchanged: the same step alone now gives the reference
    ref.rollback(3)
    want_b = ref.forward([4, 9], logits="all")
    assert _same(forward_batch([(b, [4, 9], "all", "all")])[0], want_b)
    ref.rollback(3)
    assert _same(forward_batch([(c, [4, 9], "all", "all")])[0], want_b)
    # a token out of range alone, beside a good item
    ref.rollback(3)
    ref.forward([4, 9])                      # c's history now
    want_c = ref.forward([8], logits="last")
    got = forward_batch([(a, [-1], "all", "none"), (c, [8], "all", "last")])
    assert isinstance(got[0], EngineError) and "outside the vocabulary" in got[0].message and a.n_past == 5
    assert _same(got[1], want_c)
    with pytest.raises(ValueError):
        forward_batch([(a, [1], "first", "none")])


def test_thread_count_per_call_is_bitwise_neutral(model):
    """Session.threads changes how many of the pool's threads a call uses between calls;
    the results alone and batched (the first item's count runs the batch) stay the
    reference's, and a count outside [1, pool_threads] is refused, unchanged."""
    ref_sessions, got_sessions = _sessions(model, 1), _sessions(model, 3)
    for s in got_sessions:
        assert s.pool_threads == 3 and s.threads == 3
    counts = [1, 3, 2, 1, 2, 3]
    for r in range(6):
        items, want = [], []
        for k, (ref, got) in enumerate(zip(ref_sessions, got_sessions)):
            toks = [(r * 7 + k * 13 + i) % model.info.n_vocab for i in range(1 + (k + r) % 3)]
            want.append(_alone(ref, toks, "all", "last"))
            got.threads = counts[(r + k) % len(counts)]
            assert got.threads == counts[(r + k) % len(counts)]
            items.append((got, toks, "all", "last"))
        if r % 2:   # every session alone, on its own count
            res = [forward_batch([it])[0] for it in items]
        else:
            res = forward_batch(items)
        for k, (g, w) in enumerate(zip(res, want)):
            assert not isinstance(g, EngineError), g
            assert _same(g, w), f"session {k} round {r}"
    s = got_sessions[0]
    s.threads = 2
    for bad in (0, -1, 4, 2 ** 31 - 1):
        with pytest.raises(EngineError) as ei:
            s.threads = bad
        assert ei.value.name == "ES_ERR_INVALID_ARG" and "out of range" in ei.value.message
        assert s.threads == 2
    with pytest.raises(EngineError):
        s.threads = 1.5
    s.close()
    with pytest.raises(EngineError):
        s.threads = 1


@pytest.mark.parametrize("bad, exc, message", [
    (lambda s: ("not a session", [1], "all", "none"), TypeError, "items[64]: the session must be a Session, not str"),
    (lambda s: (s, [1], "all"), TypeError, "items[64] must be a (session, tokens, head, logits) tuple"),
    (lambda s: (s, [1], "first", "none"), ValueError, "items[64]: head must be 'all' or 'last', not 'first'"),
    (lambda s: (s, [1], ["all"], "none"), ValueError, "items[64]: head must be 'all' or 'last'"),
    (lambda s: (s, [1], "last", True), ValueError, "items[64]: logits must be one of"),
])
def test_forward_batch_checks_every_item_before_running_any(tiny_model, bad, exc, message):
    # was: a batch longer than MAX_BATCH ran its first 64 items (their KV caches grew) before
    # the bad item 64 raised, so the caller lost those results; a non-Session raised
    # AttributeError '_check', a short tuple 'not enough values to unpack', a list head
    # 'unhashable type'
    from echospec.services.verifier import engine as E
    assert E.MAX_BATCH == 64
    with E.Model(tiny_model()) as m:
        sessions = [m.new_session(n_ctx=16, n_threads=1) for _ in range(E.MAX_BATCH + 1)]
        items = [(s, [1, 2], "last", "none") for s in sessions[:-1]] + [bad(sessions[-1])]
        with pytest.raises(exc) as e:
            E.forward_batch(items)
        assert message in str(e.value), str(e.value)
        assert all(s.n_past == 0 for s in sessions)
        out = E.forward_batch(items[:-1] + [(sessions[-1], [1], "all", "none")])
        assert all(not isinstance(r, Exception) for r in out) and sessions[0].n_past == 2


# -- es_decode (Session.decode): greedy steps in one engine call ---------------------------------

def test_decode_equals_one_forward_per_token(model):
    ref = model.new_session(n_ctx=64, n_threads=1)
    tok0, _ = ref.prefill(_tokens(0, 0, 12))
    want, cur = [], tok0
    for _ in range(20):
        cur = int(ref.forward([cur])[0][0])
        want.append(cur)
    for threads in (1, 2):
        s = model.new_session(n_ctx=64, n_threads=threads)
        assert s.prefill(_tokens(0, 0, 12))[0] == tok0
        got, ms = s.decode(tok0, 20)
        assert got == want and len(ms) == 20 and all(t > 0 for t in ms)
        assert s.n_past == 12 + 20
        # a stop id ends the run after the step that produced it (its first occurrence)
        s.rollback(12)
        j = next(i for i in range(10, -1, -1) if want[i] not in want[:i])
        got, _ = s.decode(tok0, 20, stop_ids=[-5, want[j]])
        assert got == want[:j + 1] and s.n_past == 12 + j + 1
        # a set interrupt: one step
        s.rollback(12)
        flag = ffi.new("int32_t *", 1)
        assert s.decode(tok0, 20, interrupt=flag)[0] == want[:1] and s.n_past == 13
        s.close()
    ref.close()


def test_decode_refusals_leave_the_kv_unchanged(model):
    s = model.new_session(n_ctx=16, n_threads=1)
    tok0, _ = s.prefill(_tokens(1, 0, 12))
    for kw, status in ((dict(max_steps=0), "INVALID_ARG"), (dict(max_steps=5), "CAPACITY"),
                       (dict(max_steps=2, token=model.info.n_vocab), "INVALID_ARG"),
                       (dict(max_steps=2, token=-1), "INVALID_ARG")):
        args = dict(token=tok0) | kw
        with pytest.raises(EngineError) as e:
            s.decode(args.pop("token"), **args)
        assert e.value.name == f"ES_ERR_{status}" and str(e.value), kw
        assert s.n_past == 12
    with pytest.raises(EngineError, match="max_steps must be an integer"):
        s.decode(tok0, 2.5)
    with pytest.raises(EngineError, match="stop id must be an integer"):
        s.decode(tok0, 2, stop_ids=["x"])
    assert s.decode(tok0, 4)[0] and s.n_past == 16   # the room that is left
    s.close()
