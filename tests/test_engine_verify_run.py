"""Session.verify_run (es_verify_run): speculative rounds run in the engine over a known draft
sequence give the tokens, the rounds (drafts verified and kept) and the KV cache of the verify loop
the services would run in Python (forward over [pending] + drafts, then rollback), and greedy
decoding's own tokens, on any thread count, an F16 or Q8_0 KV cache and the real model. Bad
arguments raise EngineError before any round with the KV cache unchanged; KV eviction and sparse
attention are refused. The engine's own test (engine_c/tests/test_verify_run.c) also compares the
K and V bytes."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.services.verifier.engine import (ES_ERR_INVALID_ARG, ES_ERR_UNSUPPORTED, EngineError, Model,
                                               ffi)

PROMPT = [(i * 53 + 7) % 300 for i in range(10)]


def greedy(s, prompt: list[int], n: int) -> list[int]:
    """The first token after ``prompt`` and the n greedy tokens after it, one forward each."""
    s.rollback(0)
    out = [int(s.forward(prompt)[0][-1])]
    for _ in range(n):
        out.append(int(s.forward([out[-1]])[0][0]))
    return out


def loop(s, token: int, drafts: list[int], k: int, max_out: int, stops=()) -> tuple[list, list, list]:
    """The verify loop a run replaces, one forward and rollback per round in Python."""
    out, ks, rs, pending, pos = [], [], [], token, 0
    while True:
        kr = min(k, len(drafts) - pos, max_out - len(out) - 1, s.n_ctx - s.n_past - 1)
        if kr < 1:
            break
        d = drafts[pos:pos + kr]
        n0 = s.n_past
        am = s.forward([pending] + d)[0]
        r = 0
        while r < kr and am[r] == d[r]:
            r += 1
        if r < kr:
            s.rollback(n0 + 1 + r)
        toks = d[:r] + [int(am[r])]
        out += toks
        ks.append(kr)
        rs.append(r)
        if (any(t in stops for t in toks) or r < kr or len(drafts) - (pos + kr + 1) < k
                or am[kr] != drafts[pos + kr]):
            break
        pending, pos = int(am[kr]), pos + kr + 1
    return out, ks, rs


def same_next(a, b, token: int) -> None:
    """Three greedy steps from ``token`` give bitwise the same logits on a and b."""
    for _ in range(3):
        am_a, la = a.forward([token], logits="last")
        am_b, lb = b.forward([token], logits="last")
        assert am_a[0] == am_b[0] and np.array_equal(la.view(np.uint32), lb.view(np.uint32))
        token = int(am_a[0])


def check_run(s, ref, truth: list[int], drafts: list[int], k: int, max_out: int, stops=()) -> None:
    """A run on s against the Python loop on ref, after PROMPT; truth: greedy()'s tokens."""
    for x in (s, ref):
        x.rollback(0)
        x.forward(PROMPT)
    run = s.verify_run(truth[0], drafts, k, max_out, stops)
    out, ks, rs = loop(ref, truth[0], drafts, k, max_out, set(stops))
    assert (run.tokens, run.k, run.r) == (out, ks, rs)
    assert run.tokens == truth[1:1 + len(run.tokens)]
    assert all(ms > 0 for ms in run.ms) and len(run.ms) == len(run.rollback_ms) == len(run.k)
    assert all((rb > 0) == (r < kk) for rb, r, kk in zip(run.rollback_ms, run.r, run.k))
    assert s.n_past == ref.n_past == len(PROMPT) + len(run.tokens)
    same_next(s, ref, run.tokens[-1])


@pytest.fixture(scope="module", params=[("llama", "Q4_1", 64, "f16"), ("qwen3", "Q8_0", 64, "f16"),
                                        ("llama", "F32", 32, "q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}-kv-{p[3]}")
def model(request, tmp_path_factory):
    arch, mt, hd, kv = request.param
    path = tmp_path_factory.mktemp("vrun") / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, matrix_type=mt, seed=11, head_dim=hd)
    m = Model(str(path))
    yield m, kv
    m.close()


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_run_equals_the_verify_loop(model, n_threads):
    m, kv = model
    rng = random.Random(50 + n_threads)
    nv = m.info.n_vocab
    with m.new_session(n_ctx=128, n_threads=n_threads, kv_type=kv) as s, \
            m.new_session(n_ctx=128, n_threads=1, kv_type=kv) as ref:
        truth = greedy(ref, PROMPT, 60)
        exact = truth[1:]
        for k in (1, 4, 7):
            check_run(s, ref, truth, exact, k, 60)            # every draft kept: on to max_out
            check_run(s, ref, truth, exact, k, 13)
            for _ in range(3):                                # one wrong draft anywhere
                d = list(exact)
                i = rng.randrange(len(d))
                d[i] = (d[i] + 1 + rng.randrange(nv - 1)) % nv
                check_run(s, ref, truth, d, k, 60)
            check_run(s, ref, truth, exact, k, 60, stops=(truth[9], nv + 3))   # a stop id


def test_run_on_the_real_model(smollm2_path):
    """SmolLM2 at 2 threads: a run over its greedy output with a wrong draft in the middle."""
    with Model(smollm2_path) as m:
        with m.new_session(n_ctx=256, n_threads=2) as s, m.new_session(n_ctx=256, n_threads=2) as ref:
            truth = greedy(ref, PROMPT, 48)
            d = truth[1:]
            d[30] = (d[30] + 1) % m.info.n_vocab
            check_run(s, ref, truth, d, 8, 48)


def test_run_limits_and_refusals(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=3)
    with Model(str(path)) as m:
        with m.new_session(n_ctx=64, n_threads=1) as s:
            truth = greedy(s, PROMPT, 40)
            # an interrupt already set, and a max_ms already passed: one round
            flag = ffi.new("int32_t *", 1)
            for kw in ({"interrupt": flag}, {"max_ms": 1e-9}):
                s.rollback(0)
                s.forward(PROMPT)
                run = s.verify_run(truth[0], truth[1:], 3, 40, **kw)
                assert run.k == [3] and run.tokens == truth[1:5] and s.n_past == len(PROMPT) + 4
            # bad arguments: refused before any round, the KV cache untouched
            n0 = s.n_past
            for args, words in (((truth[0], [], 3, 40), "n_drafts"), ((truth[0], [1, 2], 0, 40), "k >= 1"),
                                ((truth[0], [1, 2], 2, 1), "max_out"), ((10 ** 6, [1, 2], 2, 9), "token"),
                                ((truth[0], [1, 500], 2, 9), "draft 500 at index 1")):
                with pytest.raises(EngineError) as e:
                    s.verify_run(*args)
                assert e.value.status == ES_ERR_INVALID_ARG and words in e.value.message, e.value.message
                assert s.n_past == n0
        with m.new_session(n_ctx=16, n_threads=1) as s:   # no room for a round of one draft
            s.forward(list(range(15)))
            with pytest.raises(EngineError) as e:
                s.verify_run(truth[0], truth[1:], 3, 40)
            assert e.value.status == ES_ERR_INVALID_ARG and "no room" in e.value.message
        for kwargs, words in (({"kv_sinks": 4, "kv_window": 32}, "eviction"), ({"sparse_topk": 1}, "sparse")):
            with m.new_session(n_ctx=64, n_threads=1, **kwargs) as s:
                s.forward(PROMPT)
                with pytest.raises(EngineError) as e:
                    s.verify_run(truth[0], truth[1:], 3, 40)
                assert e.value.status == ES_ERR_UNSUPPORTED and words in e.value.message
                assert s.n_past == len(PROMPT)


_HUGE_MAX_OUT = '''
import os, resource, sys
from echospec.services.verifier.engine import Model
m = Model(sys.argv[1])
s = m.new_session(n_ctx=64, n_threads=1)
prompt, drafts = [int(t) for t in sys.argv[2].split(",")], [int(t) for t in sys.argv[3].split(",")]
first = int(s.forward(prompt)[0][-1])
vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
run = s.verify_run(first, drafts, 2 ** 30, 2 ** 31 - 1)
print(",".join(map(str, [first] + run.tokens)), s.n_past)
'''


def test_a_huge_max_out_takes_the_memory_of_what_the_run_can_write(tmp_path):
    """max_out = 2**31 - 1 (and k = 2**30): the arrays are as long as the run can yield
    (len(drafts) + 1 here), not max_out of each, so the run works in a process with 1 GiB of
    address space to spare (five max_out-long arrays would take 40 GB)."""
    import subprocess
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=3)
    with Model(str(path)) as m, m.new_session(n_ctx=64, n_threads=1) as s:
        truth = greedy(s, PROMPT, 12)
    drafts = truth[1:12]
    p = subprocess.run([sys.executable, "-c", _HUGE_MAX_OUT, str(path), ",".join(map(str, PROMPT)),
                        ",".join(map(str, drafts))], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    toks, n_past = p.stdout.split()
    assert [int(t) for t in toks.split(",")] == truth[:13]   # the 11 drafts, all kept, and a bonus
    assert int(n_past) == len(PROMPT) + 12


def test_bad_python_arguments_are_clear_errors(tmp_path):
    """Each bad argument: an EngineError (ES_ERR_INVALID_ARG) naming it, or a TypeError for an
    interrupt that is not an int32 cell, before any round, the KV cache untouched; numpy drafts
    and ids run as lists do."""
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=3)
    with Model(str(path)) as m, m.new_session(n_ctx=64, n_threads=1) as s:
        truth = greedy(s, PROMPT, 20)
        s.rollback(0)
        s.forward(PROMPT)
        n0, t, d = s.n_past, truth[0], truth[1:]
        for kw, words in ((dict(k=-3), "k >= 1"), (dict(k=2 ** 31), "k = 2147483648 does not fit"),
                          (dict(max_out=-(2 ** 31) - 1), "max_out"), (dict(token=1.5), "token must be an integer"),
                          (dict(drafts=[1.5, 2.0]), "integers"), (dict(drafts=np.zeros((2, 2), np.int32)), "1-D"),
                          (dict(drafts=[2 ** 40]), "does not fit in int32"), (dict(stop_ids=5), "stop_ids"),
                          (dict(stop_ids=[1, "2"]), "stop id must be an integer"),
                          (dict(max_ms=None), "max_ms"), (dict(max_ms=float("nan")), "max_ms"),
                          (dict(max_ms="5"), "max_ms")):
            args = dict(token=t, drafts=d, k=3, max_out=20)
            args.update(kw)
            with pytest.raises(EngineError) as e:
                s.verify_run(**args)
            assert e.value.status == ES_ERR_INVALID_ARG and words in e.value.message, (kw, e.value.message)
            assert s.n_past == n0
        for bad in (1, True, ffi.new("int64_t *"), ffi.NULL, np.zeros(1, np.int32)):
            with pytest.raises(TypeError, match="interrupt"):
                s.verify_run(t, d, 3, 20, interrupt=bad)
            assert s.n_past == n0
        # numpy ids and an int32 array cell as the interrupt: as lists and ffi.new("int32_t *")
        run = s.verify_run(np.int64(t), np.array(d, dtype=np.int64), np.int32(3), np.int64(20),
                           stop_ids=np.array([999], dtype=np.int64), max_ms=np.float32(0),
                           interrupt=ffi.new("int32_t[]", 1))
        assert run.tokens == truth[1:21] and s.n_past == n0 + 20
    with pytest.raises(EngineError, match="closed"):
        s.verify_run(t, d, 3, 20)


def test_a_round_beyond_the_rings_reach_is_refused():
    """gemma3 (tests/data/models) with a sliding window of 16 and swa_slack 1 (rings of 64 positions) at n_ctx 96: a
    round can verify at most 64 - 16 = 48 drafts (a rejected first draft rolls back over all of
    them); a run that could verify more is refused before any round, not left half done with the
    rejected drafts in the KV cache; at 48 it gives the loop's tokens and KV cache."""
    path = Path(__file__).resolve().parent / "data" / "models" / "gemma3-Q8_0.gguf"
    with Model(str(path)) as m:
        assert m.info.n_swa == 16
        opts = dict(n_ctx=96, n_threads=1, swa_slack=1)
        with m.new_session(**opts) as s, m.new_session(**opts) as ref:
            prompt = [(i * 53 + 7) % 300 for i in range(30)]
            truth = greedy(s, prompt, 64)
            d = truth[1:65]
            d[0] = (d[0] + 1) % m.info.n_vocab     # the first draft wrong: a round keeps none
            for x in (s, ref):
                x.rollback(0)
                x.forward(prompt)
            with pytest.raises(EngineError) as e:
                s.verify_run(truth[0], d, 49, 96)
            assert e.value.status == ES_ERR_INVALID_ARG and "roll back" in e.value.message
            assert s.n_past == len(prompt)
            run = s.verify_run(truth[0], d, 48, 96)
            out, ks, rs = loop(ref, truth[0], d, 48, 96)
            assert (run.tokens, run.k, run.r) == (out, ks, rs) == ([truth[1]], [48], [0])
            assert s.n_past == ref.n_past == len(prompt) + 1
            same_next(s, ref, truth[1])


def test_a_session_runs_again_with_more_drafts_than_max_out_or_than_before(tmp_path):
    """The session keeps its run's arrays between calls: a first run whose drafts are many more
    than its max_out, then longer drafts than any before (the arrays grow), then short ones,
    each as the Python loop gives; an interrupt checked once is still checked as a new one."""
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=5, n_ctx_train=1024)
    with Model(str(path)) as m, m.new_session(n_ctx=512, n_threads=1) as s, \
            m.new_session(n_ctx=512, n_threads=1) as ref:
        truth = greedy(ref, PROMPT, 400)
        exact = truth[1:]
        cell = ffi.new("int32_t *")
        for drafts, k, max_out in ((exact[:150], 4, 6), (exact[:400], 9, 400), (exact[:20], 3, 20),
                                   (exact[:300], 16, 2)):
            for x in (s, ref):
                x.rollback(0)
                x.forward(PROMPT)
            run = s.verify_run(truth[0], drafts, k, max_out, interrupt=cell)
            out, ks, rs = loop(ref, truth[0], drafts, k, max_out)
            assert (run.tokens, run.k, run.r) == (out, ks, rs)
            assert run.tokens == truth[1:1 + len(run.tokens)]
            assert s.n_past == ref.n_past
        for bad in (ffi.new("int64_t *"), ffi.NULL):
            with pytest.raises(TypeError, match="interrupt"):
                s.verify_run(truth[0], exact[:10], 3, 10, interrupt=bad)
