"""The stack with the verifier's scheduler at batch_max 8 and its prefix cache, on a tiny model.

8 concurrent clients get byte-identical outputs to 8 sequential runs; the
coordinator's gating refuses speculation at batch_max >= 2 and says why; a
second chat turn reuses the first turn's KV (cached_prompt_tokens > 0) and
its output is byte-identical to a stack without the prefix cache. A plain
generation that fills a small context ends the same way with the prefix cache
and without it.
"""
from __future__ import annotations

import random
import time
from concurrency import sequential_and_concurrent

import grpc
import pytest

from echospec.v1 import (common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, verifier_pb2 as vpb,
                         verifier_pb2_grpc)
from echospec.stack import start_stack

ON, OFF = common_pb2.SPEC_MODE_ON, common_pb2.SPEC_MODE_OFF
N_VOCAB, N_CTX = 320, 512


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="llama", n_vocab=N_VOCAB, n_ctx_train=512, seed=0)


def _stubs(st):
    ch = grpc.insecure_channel(st.target)
    vch = grpc.insecure_channel(st.verifier_target)
    return ch, vch, coordinator_pb2_grpc.CoordinatorServiceStub(ch), verifier_pb2_grpc.VerifierServiceStub(vch)


@pytest.fixture(scope="module")
def batched(model):
    st = start_stack(model, spec=True, n_ctx=N_CTX, n_threads=1, batch_max=8, prefill_chunk=16)
    ch, vch, stub, vstub = _stubs(st)
    yield st, stub, vstub
    ch.close()
    vch.close()
    st.stop()


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=120).result


def test_verifier_reports_its_batching_and_prefix_cache(batched):
    _, _, vstub = batched
    cfg = vstub.GetConfig(vpb.GetConfigRequest())
    assert cfg.batch_max == 8 and cfg.prefix_cache and cfg.prefill_chunk == 16
    assert cfg.decode_steps == 8   # the default (stack.start_stack, VerifierConfig)
    assert cfg.verify_runs         # the default: on (--no-verify-runs)


def test_gating_refuses_speculation_at_batch_max_8_with_the_reason(batched):
    _, stub, _ = batched
    r = complete(stub, text="the cat sat on the mat. the cat sat on the mat.", max_tokens=16, spec=ON)
    assert not r.spec_enabled
    assert "batch_max 8 >= 2" in r.spec_reason
    assert r.stats.tries == 0 and r.stats.draft_tokens == 0


def test_eight_concurrent_clients_equal_eight_sequential_at_batch_max_8(batched):
    st, stub, _ = batched
    rng = random.Random(11)
    jobs = [dict(token_ids=[rng.randrange(3, N_VOCAB) for _ in range(rng.randrange(2, 60))],
                 max_tokens=40) for _ in range(8)]
    sequential, concurrent, trace = sequential_and_concurrent(
        lambda **j: complete(stub, **j), st.verifier.core.scheduler, jobs)
    for a, b in zip(sequential, concurrent):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.text.encode() == b.text.encode()
        assert a.finish_reason == b.finish_reason
    assert max(len(b) for b in trace) <= 8
    assert max(len(b) for b in trace) >= 2      # some iterations were one forward over several sessions


def test_second_chat_turn_reuses_the_first_turns_kv_and_matches_a_cold_stack(model, batched):
    _, stub, _ = batched
    turn1 = [cpb.ChatMessage(role="user", content="the cat sat on the mat")]
    a1 = complete(stub, messages=turn1, max_tokens=24, spec=OFF)
    turn2 = turn1 + [cpb.ChatMessage(role="assistant", content=a1.text),
                     cpb.ChatMessage(role="user", content="and then?")]
    warm = complete(stub, messages=turn2, max_tokens=24, spec=OFF)
    assert warm.stats.cached_prompt_tokens > 0
    assert warm.stats.cached_prompt_tokens < warm.prompt_tokens
    st = start_stack(model, spec=True, n_ctx=N_CTX, n_threads=1, prefix_cache=False)
    ch, vch, cold_stub, cold_v = _stubs(st)
    try:
        assert not cold_v.GetConfig(vpb.GetConfigRequest()).prefix_cache
        cold = complete(cold_stub, messages=turn2, max_tokens=24, spec=OFF)
        assert cold.stats.cached_prompt_tokens == 0
        assert list(cold.token_ids) == list(warm.token_ids)
        assert cold.text.encode() == warm.text.encode()
        again = complete(cold_stub, messages=turn2, max_tokens=24, spec=OFF)
        assert again.stats.cached_prompt_tokens == 0
    finally:
        ch.close()
        vch.close()
        st.stop()


def test_cancelled_clients_free_their_sessions_at_batch_max_8(batched):
    _, stub, vstub = batched
    for i in range(20):
        it = stub.Generate(cpb.GenerateRequest(text="the cat sat", max_tokens=300), timeout=30)
        next(it)
        it.cancel()
    deadline = time.monotonic() + 10
    while vstub.GetConfig(vpb.GetConfigRequest()).active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    cfg = vstub.GetConfig(vpb.GetConfigRequest())
    assert cfg.active_sessions == 0 and cfg.cached_sessions <= 4


def test_batched_iterations_run_on_batch_threads_with_identical_outputs(model, monkeypatch):
    """n_threads 1, batch_threads 2: sessions get a pool of 2; an iteration over one session
    runs on 1 thread (an in-engine decode run of one session too), one over several (their
    decode runs too) or a prefill chunk of MANY_TOKENS or more on 2 (the engine's count per
    call), and 8 concurrent clients still get exactly the sequential outputs. GetConfig reports
    both counts."""
    from echospec.services.verifier import scheduler as sched_mod
    from echospec.services.verifier.scheduler import MANY_TOKENS
    st = start_stack(model, spec=False, n_ctx=N_CTX, n_threads=1, batch_threads=2, batch_max=8,
                     prefill_chunk=16, prefix_cache=False)
    ch, vch, stub, vstub = _stubs(st)
    try:
        cfg = vstub.GetConfig(vpb.GetConfigRequest())
        assert (cfg.n_threads, cfg.batch_threads) == (1, 2)
        core = st.verifier.core
        es = core.new_engine_session()
        assert (es.pool_threads, es.threads) == (2, 1)
        es.close()
        rng = random.Random(5)
        jobs = [dict(token_ids=[rng.randrange(3, N_VOCAB) for _ in range(rng.randrange(2, 40))],
                     max_tokens=24) for _ in range(8)]
        calls = []   # (sessions, tokens, engine threads) of every iteration
        run_batch = core.scheduler._run_batch

        def recording(items):
            calls.append((len(items), sum(len(it[1]) for it in items), items[0][0].threads))
            return run_batch(items)
        core.scheduler._run_batch = recording
        runs = []   # (sessions, engine threads) of every in-engine decode run
        decode = sched_mod.decode_batch

        def recording_decode(items, interrupt=None):
            runs.append((len(items), items[0][0].threads))
            return decode(items, interrupt)
        monkeypatch.setattr(sched_mod, "decode_batch", recording_decode)
        sequential, concurrent, trace = sequential_and_concurrent(
            lambda **j: complete(stub, **j), core.scheduler, jobs)
        for a, b in zip(sequential, concurrent):
            assert list(a.token_ids) == list(b.token_ids)
        for n_sessions, n_tokens, threads in calls:
            assert threads == (2 if n_sessions >= 2 or n_tokens >= MANY_TOKENS else 1), calls
        kinds = {(n >= 2, t >= MANY_TOKENS) for n, t, _ in calls}
        assert {(False, False), (False, True)} <= kinds   # a short chunk, a long one
        for n_sessions, threads in runs:
            assert threads == (2 if n_sessions >= 2 else 1), runs
        # lone decode runs (the sequential clients), and batches: of forwards or of decode runs
        assert any(n == 1 for n, _ in runs), runs
        assert any(n >= 2 for n, _, _ in calls) or any(n >= 2 for n, _ in runs), (calls, runs)
    finally:
        ch.close()
        vch.close()
        st.stop()


def test_batch_threads_out_of_range_is_refused(model):
    from echospec.services.common.config import VerifierConfig
    from echospec.services.verifier.sessions import InvalidArgument, VerifierCore
    with pytest.raises(InvalidArgument, match="batch_threads"):
        VerifierCore(VerifierConfig(model=model, batch_threads=-1))


@pytest.mark.parametrize("prompt_len", [3, 62, 63])
def test_plain_generation_filling_the_context_without_prefix_cache(tiny_model, prompt_len):
    # was: with --no-prefix-cache the last event read n_past from the session it had just given
    # back (closed): UNAVAILABLE "generation: session is closed" after the streamed text, and the
    # gateway answered 503 with the whole answer lost
    from echospec.stack import start_stack
    from echospec_client import Client

    results = {}
    for cache in (False, True):
        st = start_stack(tiny_model(), n_ctx=64, n_threads=1, prefix_cache=cache)
        try:
            with Client(st.target, connect_timeout=10) as c:
                results[cache] = c.complete(token_ids=[5] * prompt_len, max_tokens=200, spec=False)
        finally:
            st.stop(0)
    off, on = results[False], results[True]
    assert off.finish_reason == "context", off
    # every position holds a token, and the last one produced needs none
    assert off.completion_tokens == 64 - prompt_len + 1 and off.token_ids == on.token_ids
    assert (off.finish_reason, off.text) == (on.finish_reason, on.text)
