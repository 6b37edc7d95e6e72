"""The verifier's generation loop, scheduler and prefix cache, below gRPC.

Pure parts (the scheduler's selection policy, the prefix cache's bookkeeping,
the controller's in-flight proposal rule) get literal cases; the rest runs a
VerifierCore on a tiny random GGUF model (tests/ggufgen.py). No timings are
asserted: orderings are read from the scheduler's trace. README's paragraph on
--decode-steps says what the scheduler does. An engine failure inside a verify run is
checked through the servicer over gRPC, where its status is what the client gets.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from echospec.services.common.config import VerifierConfig
from echospec.services.verifier.engine import Model
from echospec.services.verifier.controller import SpecController
from echospec.services.verifier.generation_loop import (FINISH_CONTEXT, GenerationRequest, RoundEvent, check,
                                                      run_generation)
from echospec.services.verifier.prefix_cache import PrefixCache, common_prefix_len
from echospec.services.verifier.scheduler import Cancelled, Scheduler, Step, select
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore

N_CTX = 256


# -- the scheduler's policy ---------------------------------------------------------------------

def steps(*sizes: int) -> list[Step]:
    return [Step(session=None, tokens=[1] * n) for n in sizes]


SELECT = [
    ("one per iteration at batch_max 1", (1, 1, 1), 1, 512, [0]),
    ("batch_max caps the sessions", (1, 1, 1, 1), 3, 512, [0, 1, 2]),
    ("the token budget caps the tokens", (1, 200, 1), 8, 100, [0]),
    ("a first step larger than the budget still runs", (300, 1), 8, 100, [0]),
    ("no later step overtakes one that does not fit", (50, 60, 1), 8, 100, [0]),
    ("decode steps and a chunk that fit together", (1, 64, 1, 1), 4, 100, [0, 1, 2, 3]),
    ("an empty queue picks nothing", (), 4, 100, []),
]


@pytest.mark.parametrize("name,sizes,batch_max,budget,want", SELECT, ids=[c[0] for c in SELECT])
def test_select(name, sizes, batch_max, budget, want):
    assert select(steps(*sizes), batch_max, budget) == want


def test_scheduler_refuses_nonpositive_limits():
    for kw in (dict(batch_max=0), dict(batch_tokens=0), dict(prefill_chunk=0)):
        with pytest.raises(ValueError):
            Scheduler(threading.Lock(), **kw)


class _FakeSession:
    """Records forwards; the first one blocks until ``release`` is set."""

    def __init__(self, log: list, name: str, release: threading.Event | None = None):
        self.log, self.name, self.release = log, name, release

    def forward(self, tokens, logits="none"):
        if self.release is not None:
            self.release.wait(10)
            self.release = None
        self.log.append(self.name)
        return np.zeros(len(tokens), dtype=np.int32), None


def _fake_batch(items):
    """forward_batch over _FakeSession steps: each session's forward in turn."""
    return [s.forward(tokens, logits) for s, tokens, head, logits in items]


def test_a_cancelled_waiting_step_never_runs():
    sched = Scheduler(threading.Lock(), run_batch=_fake_batch)
    log: list = []
    release = threading.Event()
    a = threading.Thread(target=lambda: sched.run(Step(_FakeSession(log, "a", release), [1])))
    a.start()
    while not sched._busy:
        time.sleep(0.001)
    cancel = threading.Event()
    got: list = []

    def b():
        try:
            sched.run(Step(_FakeSession(log, "b"), [1]), cancel)
        except Cancelled:
            got.append("cancelled")

    tb = threading.Thread(target=b)
    tb.start()
    while sched.waiting < 1:
        time.sleep(0.001)
    cancel.set()
    sched.wake()
    tb.join(10)
    release.set()
    a.join(10)
    assert got == ["cancelled"] and log == ["a"] and sched.waiting == 0


def test_steps_of_several_sessions_share_iterations_up_to_batch_max():
    sched = Scheduler(threading.Lock(), batch_max=3, run_batch=_fake_batch)
    sched.trace = []
    log: list = []
    release = threading.Event()
    blocker = threading.Thread(target=lambda: sched.run(Step(_FakeSession(log, "x", release), [1])))
    blocker.start()
    while not sched._busy:
        time.sleep(0.001)
    threads = [threading.Thread(target=lambda i=i: sched.run(Step(_FakeSession(log, f"s{i}"), [1])))
               for i in range(5)]
    for t in threads:
        t.start()
    while sched.waiting < 5:
        time.sleep(0.001)
    release.set()
    for t in threads + [blocker]:
        t.join(10)
    assert [len(b) for b in sched.trace] == [1, 3, 2]
    assert sorted(log) == ["s0", "s1", "s2", "s3", "s4", "x"]


class _ThreadedFake(_FakeSession):
    """A _FakeSession with an engine thread count the scheduler sets before each call."""

    threads = 0


@pytest.mark.parametrize("head,n_tokens,want", [
    ("all", 1, 1), ("all", 3, 1), ("all", 4, 2), ("all", 17, 2),     # decode, verifies of 2, 3, 16 drafts
    ("last", 4, 1), ("last", 15, 1), ("last", 16, 2),                 # prefill chunks
])
def test_a_verify_of_several_drafts_runs_on_the_many_threads_as_a_long_prefill_chunk(head, n_tokens, want):
    """threads (one 1, many 2): a lone session's verify of MANY_VERIFY tokens or more (the pending
    token and 3 drafts) is bound by arithmetic like a prefill chunk of MANY_TOKENS and runs on
    many; a decode step, a short verify and a short chunk keep to one."""
    from echospec.services.verifier.scheduler import MANY_TOKENS, MANY_VERIFY
    assert (MANY_VERIFY, MANY_TOKENS) == (4, 16)
    sched = Scheduler(threading.Lock(), run_batch=_fake_batch, threads=(1, 2))
    fake = _ThreadedFake([], "a")
    seen = []
    fake.forward = lambda tokens, logits="none": (seen.append(fake.threads),
                                                 np.zeros(len(tokens), dtype=np.int32), None)[1:]
    sched.run(Step(fake, list(range(n_tokens)), head=head))
    assert seen == [want] and sched.threads_used == {want: 1}


# -- the prefix cache's bookkeeping ----------------------------------------------------------------

def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_prefix_cache_takes_the_longest_match_and_keeps_the_last_prompt_token():
    c = PrefixCache(4)
    assert c.put("a", [1, 2, 3]) == []
    assert c.put("b", [1, 2, 3, 4, 5]) == []
    assert c.take([9, 9]) == (None, 0)
    assert c.take([1, 2, 3, 4, 5]) == ("b", 4)      # the last prompt token is always prefilled
    assert c.take([1, 2, 7]) == ("a", 2)
    assert len(c) == 0


def test_prefix_cache_reuses_an_entry_only_down_to_its_min_past():
    c = PrefixCache(4)
    c.put("ring", [1, 2, 3, 4, 5, 6], min_past=4)    # can roll back to n_past >= 4, or to 0
    c.put("short", [1, 2, 9])
    assert c.take([1, 2, 3, 7]) == ("short", 2)      # 3 shared with "ring": out of its reach
    c.put("short", [1, 2, 9])
    assert c.take([1, 2, 3, 4, 8]) == ("ring", 4)    # 4 shared: exactly its reach
    c.put("ring", [1, 2, 3, 4, 5, 6], min_past=4)
    assert c.take([1, 2, 3]) == ("short", 2)         # capped at len - 1 = 2 < 4: "ring" shares nothing
    assert c.take([1, 2, 3]) == (None, 0)
    assert len(c) == 1 and c.cached_tokens() == 6


def test_prefix_cache_leaves_an_entry_to_its_conversation_unless_reuse_outweighs_the_loss():
    c = PrefixCache(4)
    chat1 = [1, 2, 3, 10, 11, 12, 13, 14]             # prompt: system [1, 2, 3] + [10, 11]
    c.put("chat1", chat1, prompt_len=5)
    assert c.take([1, 2, 3, 20, 21]) == (None, 0)     # another chat: 3 reused < 5 lost: left
    assert c.take(chat1[:7] + [15]) == ("chat1", 7)   # chat 1's next turn
    c.put("chat1", chat1, prompt_len=5)
    assert c.take([1, 2, 3, 10, 20]) == ("chat1", 4)  # another chat, 4 reused >= 4 lost: taken
    c.put("chat1", chat1, prompt_len=5)
    assert c.take([1, 2, 3, 10, 11]) == ("chat1", 4)  # the same prompt again continues it
    c.put("chat1", chat1)                             # prompt length not said: any prompt takes it
    assert c.take([1, 2, 3, 20, 21]) == ("chat1", 3)


def test_prefix_cache_evicts_the_least_recently_used():
    c = PrefixCache(2)
    c.put("a", [1])
    c.put("b", [2])
    assert c.put("c", [3]) == ["a"]
    assert c.evict_lru() == "b"
    assert PrefixCache(0).put("d", [1]) == ["d"]     # capacity 0: off
    assert PrefixCache(2).put("e", []) == ["e"]      # nothing held: nothing to reuse


# -- the controller's in-flight proposal --------------------------------------------------------

def test_in_flight_proposal_is_asked_when_the_cache_runs_short():
    c = SpecController(k=2)
    assert c.prefetch_size(0) == 8                  # empty cache: ask for fetch_factor * k
    c.cache = [1, 2, 3, 4, 5, 6]
    assert c.prefetch_size(2) == 0                  # 6 - 2 - 1 = 3 >= k left after the round
    assert c.prefetch_size(4) == 8
    c.cache, c.skip = [], 2
    assert c.prefetch_size(0) == 0                  # the back-off is skipping proposals


def test_in_flight_proposal_is_kept_only_when_it_continues_the_round():
    c = SpecController(k=2)
    c.on_prefetch([5, 6, 7, 8], tokens=[5])         # the round produced 5: 6 7 8 follow
    assert c.cache == [6, 7, 8]
    c.on_prefetch([1, 2, 3], tokens=[9])            # disagrees: dropped, the cache stays (no miss)
    assert c.cache == [6, 7, 8]
    c.cache = []
    c.on_prefetch([], tokens=[9])                   # nothing proposed: a miss
    assert c.misses == 1 and c.skip == 1


# -- the loop on the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(arch="llama", n_vocab=320, n_ctx_train=512, seed=0)


def make_core(path: str, **kw) -> VerifierCore:
    cfg = VerifierConfig(model=path, n_ctx=N_CTX, n_threads=1, **kw)
    return VerifierCore(cfg)


def generate(core, prompt, max_tokens=16, cancel=None, eos=(), sampling=Sampling()) -> list:
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, eos_ids=frozenset(eos),
                            sampling=sampling)
    check(core, req)
    return list(run_generation(core, req, cancel or threading.Event()))


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_a_steps_forward_ms_is_the_engine_call_alone(model_path):
    """Step.forward_ms (a round's V, the cost model's sample) times the engine's C call, not the
    Python that prepares it and reads its results: that is the round's own overhead."""
    from echospec.services.verifier import engine

    def slow_python_around(items):
        time.sleep(0.02)                   # 20 ms of "Python" before the C call
        out = engine.forward_batch(items)
        time.sleep(0.02)                   # and after it
        return out

    m = Model(model_path)
    s = m.new_session(n_ctx=64, n_threads=1)
    try:
        sched = Scheduler(threading.Lock(), run_batch=slow_python_around)
        t0 = time.perf_counter()
        st = sched.run(Step(s, [5, 6, 7], "all", "none"))
        wall_ms = (time.perf_counter() - t0) * 1e3
        assert wall_ms >= 40 and 0 < st.forward_ms < 20, (wall_ms, st.forward_ms)
        assert st.forward_ms == engine.last_call_ms()
        # a run_batch that is no engine call (the tests' fakes) is timed whole
        def fake(items):
            time.sleep(0.02)
            return [(np.zeros(3, np.int32), None)]

        sched = Scheduler(threading.Lock(), run_batch=fake)
        assert sched.run(Step(s, [5, 6, 7], "all", "none")).forward_ms >= 20
    finally:
        s.close()
        m.close()


def test_chunked_prefill_equals_one_prefill(model_path):
    prompt = [(i * 37) % 300 + 3 for i in range(150)]
    whole = make_core(model_path, prefill_chunk=512, prefix_cache=False)
    chunked = make_core(model_path, prefill_chunk=7, prefix_cache=False)
    try:
        assert tokens_of(generate(whole, prompt, 24)) == tokens_of(generate(chunked, prompt, 24))
    finally:
        whole.close()
        chunked.close()


def test_rollback_then_prefill_is_bitwise_a_cold_prefill(model_path):
    # the prefix cache's premise: KV kept, rolled back to a prefix, the rest prefilled
    prompt = [(i * 11) % 300 + 3 for i in range(90)]
    m = Model(model_path)
    try:
        cold = m.new_session(n_ctx=N_CTX, n_threads=1)
        _, want = cold.prefill(prompt, logits=True)
        warm = m.new_session(n_ctx=N_CTX, n_threads=1)
        warm.prefill(prompt[:70] + [5, 6, 7, 8], logits=False)   # an earlier, diverging sequence
        warm.rollback(70)
        _, got = warm.prefill(prompt[70:], logits=True)
        assert np.array_equal(want, got)
    finally:
        m.close()


def test_a_short_request_gets_its_first_token_before_a_long_prefill_ends(model_path):
    core = make_core(model_path, prefill_chunk=16, prefix_cache=False)
    sched = core.scheduler
    sched.trace = []
    orig = sched._execute
    first_chunk = threading.Event()

    def execute(batch, *rest):
        if not first_chunk.is_set():
            first_chunk.set()
            t_end = time.monotonic() + 10
            while sched.waiting < 1 and time.monotonic() < t_end:   # hold A's first chunk until B queues
                time.sleep(0.001)
        orig(batch, *rest)

    sched._execute = execute
    done: dict = {}
    long_prompt = [(i * 7) % 300 + 3 for i in range(200)]

    def run(name, prompt):
        done[name] = generate(core, prompt, max_tokens=1)

    try:
        a = threading.Thread(target=run, args=("a", long_prompt))
        a.start()
        assert first_chunk.wait(10)
        b = threading.Thread(target=run, args=("b", [5, 6, 7]))
        b.start()
        a.join(30)
        b.join(30)
        a_steps = [s for batch in sched.trace for s in batch]
        assert len(a_steps) == 200 // 16 + 1 + 1              # A's 13 chunks and B's one prefill
        sessions = list(dict.fromkeys(a_steps))               # A's session first, then B's
        b_at = a_steps.index(sessions[1])
        assert b_at == 1, f"B's prefill ran at iteration {b_at}, after {b_at} of A's chunks"
        assert a_steps.index(sessions[1]) < len(a_steps) - 1   # before A's last chunk (its first token)
        assert tokens_of(done["b"]) == tokens_of(generate(core, [5, 6, 7], 1))
    finally:
        core.close()


def test_prefix_reuse_on_a_second_turn_is_identical_to_a_cold_run(model_path):
    warm = make_core(model_path)
    cold = make_core(model_path, prefix_cache=False)
    try:
        turn1 = [(i * 13) % 300 + 3 for i in range(40)]
        out1 = tokens_of(generate(warm, turn1, 20))
        turn2 = turn1 + out1 + [9, 10, 11, 12]
        evs = generate(warm, turn2, 20)
        assert evs[0].cached_prompt_tokens == len(turn1) + len(out1) - 1   # the last output token was pending
        ref = generate(cold, turn2, 20)
        assert ref[0].cached_prompt_tokens == 0
        assert tokens_of(evs) == tokens_of(ref)
        assert warm.cached_sessions == 1 and cold.cached_sessions == 0
        # the same prompt again: everything but its last token is reused
        again = generate(warm, turn2, 20)
        assert again[0].cached_prompt_tokens == len(turn2) - 1
        assert tokens_of(again) == tokens_of(ref)
    finally:
        warm.close()
        cold.close()


def test_prefix_cache_stays_within_its_sessions_and_max_sessions(model_path):
    core = make_core(model_path, prefix_cache_sessions=2, max_sessions=3)
    try:
        for i in range(6):
            generate(core, [20 + i, 21, 22], 4)
            assert core.cached_sessions <= 2 and core.active_sessions == 0
        held = [core.acquire([50 + i, 1])[0] for i in range(3)]   # evicts cached sessions to open
        assert core.cached_sessions == 0 and core.active_sessions == 3
        with pytest.raises(Exception, match="max_sessions"):
            core.acquire([60, 1])
        for s in held:
            core.release(s, None)
        assert core.active_sessions == 0
    finally:
        core.close()


def test_a_miss_on_a_full_prefix_cache_reuses_its_oldest_session_blank(model_path):
    # the entry the returning session would evict anyway lends its engine session (KV pages
    # already in memory) instead of a new allocation; the output is a cold run's
    core = make_core(model_path, prefix_cache_sessions=2)
    cold = make_core(model_path, prefix_cache=False)
    try:
        generate(core, [20, 21, 22], 4)
        s1, n1 = core.acquire([30, 31, 32])       # a miss, the cache not full: a new session
        core.release(s1, [30, 31])
        assert n1 == 0 and core.cached_sessions == 2
        lru = core.prefix_cache._entries[next(iter(core.prefix_cache._entries))][0]
        s2, n2 = core.acquire([40, 41, 42])       # a miss on a full cache: its oldest, rolled back
        assert s2 is lru and n2 == 0 and s2.n_past == 0 and core.cached_sessions == 1
        core.release(s2, None)
        got = generate(core, [50, 51, 52, 53], 12)
        assert got[0].cached_prompt_tokens == 0
        assert tokens_of(got) == tokens_of(generate(cold, [50, 51, 52, 53], 12))
        assert core.cached_sessions == 2 and core.active_sessions == 0
    finally:
        core.close()
        cold.close()


def test_cancel_ends_the_generation_and_keeps_a_consistent_kv(model_path):
    core = make_core(model_path)
    try:
        cancel = threading.Event()
        req = GenerationRequest(prompt=[3, 4, 5], max_tokens=200, eos_ids=frozenset(),
                                sampling=Sampling())
        got = []
        for ev in run_generation(core, req, cancel):
            got.extend(ev.tokens)
            if len(got) >= 5:
                cancel.set()
        assert 5 <= len(got) < 200 and core.active_sessions == 0
        full = tokens_of(generate(core, [3, 4, 5] + got[:4], 10))   # reuses the cancelled run's KV
        fresh = make_core(model_path, prefix_cache=False)
        try:
            assert full == tokens_of(generate(fresh, [3, 4, 5] + got[:4], 10))
        finally:
            fresh.close()
    finally:
        core.close()


def test_a_full_context_ends_with_finish_context(model_path):
    core = make_core(model_path)
    try:
        evs = generate(core, [3] * (N_CTX - 4), max_tokens=100)
        assert evs[-1].finish == FINISH_CONTEXT and evs[-1].tokens == []
        # the prefill's token, then one per step until the KV holds N_CTX positions
        assert len(tokens_of(evs)) == 1 + 4
    finally:
        core.close()


def test_check_refuses_bad_requests(model_path):
    core = make_core(model_path)
    try:
        for kw, frag in ((dict(prompt=[]), "empty"), (dict(prompt=[3] * N_CTX), "does not fit"),
                         (dict(prompt=[400]), "vocabulary"), (dict(max_tokens=0), "max_tokens"),
                         (dict(spec=True, k=0), "k must be"),
                         (dict(prediction=(3, 320)), r"prediction\[1\] = 320"),
                         (dict(digit_tokens=(1, 2)), "0 or 10 ids")):
            args = dict(prompt=[3], max_tokens=4, eos_ids=frozenset(), sampling=Sampling())
            args.update(kw)
            with pytest.raises(InvalidArgument, match=frag):
                check(core, GenerationRequest(**args))
    finally:
        core.close()


class _OracleDraft:
    """A draft link that proposes the true continuation (from a plain run) and can fail.

    Args:
        truth: prompt + the plain run's output. fail_after: raise DraftUnavailable on that
            proposal (None: never). wrong_every: every n-th proposal starts with a wrong token.
    """

    def __init__(self, truth: list[int], fail_after: int | None = None, wrong_every: int = 0):
        self.truth, self.fail_after, self.wrong_every = truth, fail_after, wrong_every
        self.history: list[int] = []
        self.asked: list[int] = []
        self.closed = False

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked.append(n)

    def recv_proposal(self):
        from echospec.services.verifier.generation_loop import DraftUnavailable
        if self.fail_after is not None and len(self.asked) >= self.fail_after:
            raise DraftUnavailable("draft service unreachable (UNAVAILABLE: test)")
        assert self.truth[:len(self.history)] == self.history, "the draft history is not the real one"
        p = self.truth[len(self.history):len(self.history) + self.asked[-1]]
        if self.wrong_every and len(self.asked) % self.wrong_every == 0 and p:
            p = [(p[0] + 1) % 320] + p[1:]
        return p

    def close(self):
        self.closed = True

    def cancel(self):
        self.closed = True


@pytest.mark.parametrize("verify_runs", [True, False])
@pytest.mark.parametrize("fixed_k", [True, False])
@pytest.mark.parametrize("fail_after,wrong_every", [(None, 0), (None, 3), (2, 0)])
def test_speculative_loop_gives_the_plain_output_with_in_flight_proposals(model_path, fixed_k, fail_after,
                                                                        wrong_every, verify_runs):
    core = make_core(model_path, prefix_cache=False, verify_runs=verify_runs)
    try:
        prompt = [(i * 5) % 300 + 3 for i in range(12)]
        plain = tokens_of(generate(core, prompt, 60))
        link = _OracleDraft(prompt + plain, fail_after, wrong_every)
        req = GenerationRequest(prompt=prompt, max_tokens=60, eos_ids=frozenset(), sampling=Sampling(),
                                spec=True, k=4, fixed_k=fixed_k)
        check(core, req)
        evs = list(run_generation(core, req, threading.Event(), lambda: link))
        out = tokens_of(evs)
        assert out[:60] == plain[:60] and len(out) <= 61
        hits = sum(e.accepted for e in evs)
        drafts = sum(e.k for e in evs)
        assert hits + sum(e.k - e.accepted for e in evs) == drafts
        assert sum(e.proposals for e in evs) == len(link.asked) - (1 if fail_after else 0)
        reasons = [e.spec_reason for e in evs if e.spec_reason]
        if fail_after is None:
            assert reasons == [] and hits > 0
            assert all(e.k <= 4 for e in evs)
        else:
            assert len(reasons) == 1 and "draft service unreachable" in reasons[0]
        assert link.closed
    finally:
        core.close()


@pytest.mark.parametrize("verify_runs", [True, False])
def test_marks_hand_the_events_over_right_before_each_forward(model_path, verify_runs):
    """run_generation(marks=True) of a speculative generation: FLUSH after the prefill's event
    and right before every engine call after it (a reader woken then runs beside the forward),
    and no event is held while the loop waits for a proposal; the same events as without marks.
    servicer._drive hands each FLUSH's events over as one list, the rest and then the error when
    the generation fails."""
    import queue

    from echospec.services.verifier.generation_loop import FLUSH
    from echospec.services.verifier.servicer import _END, _drive

    core = make_core(model_path, prefix_cache=False, verify_runs=verify_runs)
    try:
        prompt = [(i * 5) % 300 + 3 for i in range(12)]
        plain = tokens_of(generate(core, prompt, 60))
        req = GenerationRequest(prompt=prompt, max_tokens=60, eos_ids=frozenset(), sampling=Sampling(),
                                spec=True, k=4, fixed_k=True)
        check(core, req)
        seen: list = []
        real_run = core.scheduler.run

        def run(step, cancel=None):
            seen.append("forward")
            return real_run(step, cancel)

        class Link(_OracleDraft):   # wrong drafts now and then: proposals waited for again
            def send_propose(self, append, n):
                seen.append("send")
                super().send_propose(append, n)

            def recv_proposal(self):
                seen.append("wait" if seen[-1] == "send" else "collect")
                return super().recv_proposal()

        core.scheduler.run = run
        for item in run_generation(core, req, threading.Event(), lambda: Link(prompt + plain, wrong_every=2),
                                   marks=True):
            seen.append(item)
        core.scheduler.run = real_run
        first = next(i for i, x in enumerate(seen) if isinstance(x, RoundEvent))
        assert seen[first + 1] is FLUSH
        calls = [i for i, x in enumerate(seen) if x == "forward" and i > first]
        assert len(calls) >= 3
        assert all(seen[i - 1] is FLUSH for i in calls)
        held, waits = 0, 0
        for x in seen[first:]:
            if isinstance(x, RoundEvent):
                held += 1
            elif x is FLUSH:
                held = 0
            elif x == "wait":
                waits += 1
                assert held == 0, "an event was held while the loop waited for a proposal"
        assert waits >= (1 if verify_runs else 2)
        evs = [x for x in seen if isinstance(x, RoundEvent)]
        assert tokens_of(evs)[:60] == plain[:60] and sum(e.accepted for e in evs) > 0
    finally:
        core.close()
    a, b, c = (RoundEvent([t]) for t in (1, 2, 3))

    def failing():
        yield a
        yield FLUSH
        yield b
        yield FLUSH
        yield FLUSH
        yield c
        raise ValueError("boom")

    for events, want in (([a, FLUSH, b, c], [[a], [b, c], _END]), ([FLUSH, a, FLUSH], [[a], _END])):
        out = queue.SimpleQueue()
        _drive(iter(events), out)
        assert [out.get_nowait() for _ in range(out.qsize())] == want
    out = queue.SimpleQueue()
    _drive(failing(), out)
    got = [out.get_nowait() for _ in range(out.qsize())]
    assert got[:3] == [[a], [b], [c]] and isinstance(got[3], ValueError) and len(got) == 4


class _LateOracle(_OracleDraft):
    """An oracle whose in-flight proposals come ``lag`` rounds late (a draft service slower than
    the forward): ``ready`` says no until then, and a recv before it is a test failure."""

    def __init__(self, truth, lag: int):
        super().__init__(truth)
        self.lag, self.checks, self.waited = lag, 0, 0

    def send_propose(self, append, n):
        super().send_propose(append, n)
        self.checks = 0

    def ready(self, wait=0.0):
        self.checks += 1
        return self.checks > self.lag

    def recv_proposal(self):
        if self.checks <= self.lag:
            self.waited += 1
        return super().recv_proposal()


@pytest.mark.parametrize("lag", [1, 3])
def test_a_late_in_flight_proposal_is_collected_when_it_comes_never_waited_for(model_path, lag):
    """A proposal asked in flight that has not come when the forward ends stays in flight: the
    round goes on without it, no new proposal is asked meanwhile, and when it comes it is checked
    against every token produced since it was asked. Same output as plain decoding."""
    core = make_core(model_path, prefix_cache=False)
    try:
        prompt = [(i * 5) % 300 + 3 for i in range(12)]
        plain = tokens_of(generate(core, prompt, 60))
        link = _LateOracle(prompt + plain, lag)
        req = GenerationRequest(prompt=prompt, max_tokens=60, eos_ids=frozenset(), sampling=Sampling(),
                                spec=True, k=4, eager=True)
        check(core, req)
        evs = list(run_generation(core, req, threading.Event(), lambda: link))
        assert tokens_of(evs)[:60] == plain[:60]
        assert link.waited <= 1   # the first proposal may be waited for; no in-flight one is
        assert sum(e.proposals for e in evs) >= len(link.asked) - 1
        assert sum(e.accepted for e in evs) > 0
    finally:
        core.close()


def test_a_proposal_waited_for_that_costs_more_than_a_plain_step_goes_in_flight():
    from echospec.services.verifier.controller import CostModel
    c = CostModel()
    c.observe(0, 3.0, 3.1, 3.0)
    ctl = SpecController(k=4, cost=c)
    assert ctl.plan(4) == ("propose", 16)
    c.hop_ms = 30.0                                 # a draft service 30 ms away
    assert ctl.plan(4) == ("none", 0) and ctl.prefetch_size(0) == 16


def test_backing_off_proposals_go_in_flight_never_blocking():
    c = SpecController(k=2)
    assert c.plan(2) == ("propose", 8)              # no miss yet: the first proposal blocks
    c.on_proposal([], 2)                            # empty: a miss, skip 1
    c.skip = 3
    assert c.plan(2) == ("none", 0) and c.prefetch_size(0) == 0   # skipping: nothing asked
    c.skip = 1
    assert c.plan(2) == ("none", 0)                 # the last skipped round ...
    assert c.prefetch_size(0) == 8                  # ... asks in flight
    assert c.plan(2) == ("none", 0)                 # still backing off: never a blocking proposal
    c.on_prefetch([4, 5, 6], tokens=[7])            # wrong, no cache: another miss
    assert c.misses == 2 and c.skip == 2
    c.skip = 0
    c.on_prefetch([4, 5, 6], tokens=[4])            # right: its tail is the next round's draft
    assert c.plan(2) == ("cached", [5, 6])


def test_an_in_flight_proposal_lost_to_the_bonus_token_is_no_miss():
    """A round that accepted drafts and whose in-flight proposal missed only the bonus token
    asks the source again (a blocking proposal), never a back-off's plain step."""
    c = SpecController(k=4)
    c.on_proposal([1, 2, 3, 4], k_cap=4)
    assert c.plan(4) == ("cached", [1, 2, 3, 4]) and c.prefetch_size(4) == 16
    c.on_result([1, 2, 3, 4], [1, 2, 9])            # R = 2, bonus 9
    c.on_prefetch([1, 2, 3, 4, 5], tokens=[1, 2, 9])  # made before the round: 3 where 9 came
    assert (c.misses, c.skip) == (0, 0)
    assert c.plan(4) == ("propose", 16)


def test_a_rejected_draft_and_its_lost_in_flight_proposal_are_one_miss():
    c = SpecController(k=4)
    c.on_proposal([1, 2, 3, 4], k_cap=4)
    c.on_result([1, 2, 3, 4], [7])                  # R = 0: a miss
    c.on_prefetch([1, 2, 3, 4, 5], tokens=[7])      # the same guess again: not a second miss
    assert (c.misses, c.skip) == (1, 1)
    c.skip = 0
    c.on_result([], [8])                            # a plain step beside an in-flight proposal ...
    c.on_prefetch([3], tokens=[8])                  # ... that misses: the next miss
    assert (c.misses, c.skip) == (2, 2)


def _slow_batch(ms: float):
    def run(items):
        time.sleep(ms / 1e3)
        return [(np.zeros(len(tokens), dtype=np.int32), None) for _, tokens, _, _ in items]
    return run


def _loops(sched, sessions, rounds):
    def loop(s):
        for _ in range(rounds):
            sched.run(Step(s, [1]))
        sched.leave(s)
    threads = [threading.Thread(target=loop, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_an_iteration_waits_for_the_last_iterations_sessions():
    # without the wait, the first session back would start the next iteration alone
    sched = Scheduler(threading.Lock(), batch_max=3, run_batch=_slow_batch(20), gather=0.5)
    sched.trace = []
    _loops(sched, [object() for _ in range(3)], 10)
    sizes = [len(b) for b in sched.trace]
    assert sum(sizes) == 30
    assert sum(sizes) / len(sizes) >= 2.5, sizes


def test_a_session_that_left_is_not_waited_for():
    sched = Scheduler(threading.Lock(), batch_max=2, run_batch=_slow_batch(20), gather=100.0)
    a, b = object(), object()
    t0 = time.perf_counter()
    _loops(sched, [a, b], 1)          # one iteration of both; then both leave
    sched.run(Step(a, [1]))           # would wait 100 x 20 ms for b had b not left
    assert time.perf_counter() - t0 < 1.5


def test_back_off_doubles_to_64_rounds_and_probes_free_text_rarely():
    c = SpecController(k=4)
    skips = []
    for _ in range(9):
        c.on_proposal([], 4)                        # an empty proposal: a miss
        skips.append(c.skip)
    assert skips == [1, 2, 4, 8, 16, 32, 64, 64, 64]
    # free text: every probe misses; count the proposals over 256 plain rounds
    c = SpecController(k=4)
    probes = 0
    for _ in range(256):
        kind, _ = c.plan(4)
        if kind == "propose":
            probes += 1
            c.on_proposal([], 4)
        elif c.prefetch_size(0):
            probes += 1
            c.on_prefetch([], tokens=[1])
        c.on_result([], [1])
    assert probes <= 10, probes


class _CountingStream:
    """A stream of ``n`` steps (Scheduler.start); records how it ended."""

    def __init__(self, n: int):
        self.left, self.steps, self.ended, self.error = n, 0, False, None
        self.stopped = False

    def advance(self, step):
        if step.error is not None:
            self.fail(step.error)
            return None
        self.steps += 1
        self.left -= 1
        if self.left == 0:
            self.ended = True
            return None
        return [1]

    def fail(self, exc):
        self.error, self.ended = exc, True


def _until(sched, ready, timeout: float = 10.0) -> None:
    t_end = time.monotonic() + timeout
    while not ready() and time.monotonic() < t_end:
        sched.wait_for(ready, 0.5)


def test_streams_run_back_to_back_without_their_readers():
    # nobody waits on these steps: the scheduler's own thread steps them, every batch whole
    gate = threading.Event()
    slow = _slow_batch(2)

    def run_batch(items):      # the first forward waits until every stream is queued
        gate.wait(10)
        return slow(items)
    sched = Scheduler(threading.Lock(), batch_max=3, run_batch=run_batch)
    sched.trace = []
    first = _CountingStream(1)
    sched.start(Step(object(), [1], stream=first))
    streams = [_CountingStream(5) for _ in range(3)]
    for s in streams:
        sched.start(Step(object(), [1], stream=s))
    gate.set()
    _until(sched, lambda: all(s.ended for s in streams))
    assert [s.steps for s in streams] == [5, 5, 5] and all(s.error is None for s in streams)
    sizes = [len(b) for b in sched.trace]
    assert sum(sizes) == 16 and len(sizes) == 6, sizes     # 16 steps in ceil(16 / 3) iterations


def test_a_cancelled_stream_stops_and_stop_waits_for_its_forward():
    sched = Scheduler(threading.Lock(), batch_max=2, run_batch=_slow_batch(5))
    cancel = threading.Event()
    a, b = _CountingStream(10_000), _CountingStream(10_000)
    sched.start(Step(object(), [1], stream=a, cancel=cancel))
    sched.start(Step(object(), [1], stream=b))
    _until(sched, lambda: a.steps >= 2)
    cancel.set()
    sched.wake()
    _until(sched, lambda: a.ended)
    assert a.ended and isinstance(a.error, Cancelled)
    n = a.steps
    sched.stop(b)                  # returns once b's forward (if one runs) is over
    m = b.steps
    time.sleep(0.05)
    assert a.steps == n and b.steps == m and sched.waiting == 0


# -- in-engine decoding (decode_steps) -----------------------------------------------------------

def _events(core, prompt, max_tokens, eos=()):
    return [(e.tokens, e.n_past) for e in generate(core, prompt, max_tokens, eos=eos)]


def test_a_lone_greedy_generation_decodes_several_steps_per_engine_call(model_path):
    one, many = make_core(model_path, decode_steps=1), make_core(model_path, decode_steps=8)
    try:
        prompt = [5, 9, 13, 17, 21]
        for core in (one, many):
            core.scheduler.iterations = 0
        want = _events(one, prompt, 40)
        calls_one = one.scheduler.iterations
        assert _events(many, prompt, 40) == want     # the same tokens, one event per token
        assert len(want) == 40 and calls_one == 40
        assert many.scheduler.iterations <= 1 + 1 + 39 // 8 + 1   # prefill, then runs of <= 8 steps
        toks = [t for ev, _ in want for t in ev]
        # max_tokens inside a run, and an EOS id inside one (its first occurrence past the first
        # run), end the generation on the same token as one step per call
        assert _events(many, prompt, 13) == want[:13]
        j = next(i for i in range(12, 30) if toks[i] not in toks[:i])
        assert _events(many, prompt, 40, eos=[toks[j]]) == _events(one, prompt, 40, eos=[toks[j]]) == want[:j + 1]
        # a full KV cache inside a run: the same tokens and the same FINISH_CONTEXT end
        long = [3] * (N_CTX - 12)
        ends = [[(e.tokens, e.n_past, e.finish) for e in generate(c, long, 100)] for c in (one, many)]
        assert ends[0] == ends[1] and ends[1][-1][2] == FINISH_CONTEXT
    finally:
        one.close()
        many.close()


def test_an_in_engine_run_lasts_about_decode_run_ms_at_the_current_t(model_path):
    """On a slow model (T = 25 ms here) a run takes DECODE_RUN_MS / T = 2 steps, not decode_steps,
    so the client still gets tokens every ~50 ms; the tokens are the same."""
    core = make_core(model_path, decode_steps=8)
    try:
        want = tokens_of(generate(core, [5, 9, 13], 40))
        core.observe_decode = lambda ms: None
        core.t_ms = 25.0
        core.scheduler.iterations = 0
        assert tokens_of(generate(core, [5, 9, 13], 40)) == want
        assert core.scheduler.iterations == 1 + 39 // 2 + 1   # the prefill, then runs of 2 steps
    finally:
        core.close()


def test_in_engine_decoding_gives_way_to_a_second_generation(model_path):
    """A generation that arrives while another's in-engine run goes on ends that run after its
    current step (at batch_max 1 the two then alternate), and each output is its solo output."""
    core = VerifierCore(VerifierConfig(model=model_path, n_ctx=2048, n_threads=1, decode_steps=1024))
    try:
        a_prompt, b_prompt = [7, 8, 9], [40, 41, 42, 43]
        solo_a, solo_b = (tokens_of(generate(core, p, n)) for p, n in ((a_prompt, 1500), (b_prompt, 32)))
        core.scheduler.trace = []
        out: dict = {}

        def run_b():
            out["b"] = tokens_of(generate(core, b_prompt, 32))

        b = threading.Thread(target=run_b)
        orig = core.scheduler._execute

        def execute(batch, run_decode=False, *rest):
            if run_decode and not b.is_alive() and "b" not in out:
                b.start()   # B arrives while A's first run (up to 1024 steps) goes on
            orig(batch, run_decode, *rest)

        core.scheduler._execute = execute
        req = GenerationRequest(prompt=a_prompt, max_tokens=1500, eos_ids=frozenset(), sampling=Sampling())
        got_a = tokens_of(run_generation(core, req, threading.Event()))
        b.join(60)
        assert got_a == solo_a and out["b"] == solo_b
        # one trace entry per engine step: B's steps came before A's run could end
        ids = [e[0] for e in core.scheduler.trace]
        a_id = ids[0]
        first_b = next(i for i, x in enumerate(ids) if x != a_id)
        assert first_b < 1 + 1024 and ids[first_b:].count(a_id) > 0, first_b
    finally:
        core.close()


def _record_decode_runs(monkeypatch, core=None, waits_for: Callable[[list], bool] | None = None) -> list:
    """Per scheduler decode_batch call from now on: [(id(session), tokens it got)] per item.
    waits_for: each decode run of core's scheduler first waits (up to 10 s, before it takes the
    engine lock) until it is true of the run's steps."""
    from echospec.services.verifier import scheduler as sched_mod
    runs: list = []
    real = sched_mod.decode_batch
    if waits_for is not None:
        execute = core.scheduler._execute

        def held(batch, run_decode=False, *rest):
            t_end = time.monotonic() + 10
            while run_decode and not waits_for(batch) and time.monotonic() < t_end:
                time.sleep(0.001)
            execute(batch, run_decode, *rest)
        core.scheduler._execute = held

    def recording(items, interrupt=None):
        res = real(items, interrupt)
        runs.append([(id(it[0]), len(r[0])) for it, r in zip(items, res)])
        return res
    monkeypatch.setattr(sched_mod, "decode_batch", recording)
    return runs


def _at_once(core, jobs, finished: list | None = None) -> list:
    """Greedy generations of (prompt, max_tokens, eos ids) started together; their tokens.
    finished: each generation's index is appended to it as it ends."""
    out: dict = {}
    start = threading.Barrier(len(jobs))

    def run(i):
        start.wait()
        p, n, e = jobs[i]
        out[i] = tokens_of(generate(core, p, n, eos=e))
        if finished is not None:
            finished.append(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out.get(i) for i in range(len(jobs))]


def test_greedy_generations_batched_together_decode_several_steps_per_call(model_path, monkeypatch):
    """batch_max 4, three greedy generations at once: their iterations become decode runs over
    several sessions (several engine steps of each per call), each output is its solo output,
    and a generation that ends (max_tokens, EOS) leaves the run alone."""
    core = VerifierCore(VerifierConfig(model=model_path, n_ctx=N_CTX, n_threads=1, batch_max=4,
                                       decode_steps=8, prefix_cache=False))
    try:
        jobs = [([7, 8, 9], 80, ()), ([40, 41, 42, 43], 50, ()), ([90, 3], 80, None)]
        solo = [tokens_of(generate(core, p, n)) for p, n, _ in jobs]
        eos = solo[2][60]   # the third stops at an EOS id part way (its first occurrence or earlier)
        jobs[2] = (jobs[2][0], 80, (eos,))
        solo[2] = solo[2][:solo[2].index(eos) + 1]
        # a run waits until it holds several sessions or another step waits (so the sessions meet
        # in runs whatever the threads' timing), or the others have ended
        finished: list = []
        runs = _record_decode_runs(
            monkeypatch, core,
            lambda batch: len(batch) >= 2 or core.scheduler.waiting >= 1 or len(finished) + len(batch) >= 3)
        assert _at_once(core, jobs, finished) == solo
        steps = [[n for _, n in r] for r in runs]
        assert any(len(r) >= 2 and max(r) >= 2 for r in steps), runs   # several sessions, several steps
        assert sum(max(r) for r in steps) < sum(len(x) for x in solo)  # fewer engine calls than tokens
    finally:
        core.close()


def test_streams_at_batch_max_1_take_decode_runs_in_turn(model_path, monkeypatch):
    """batch_max 1, two greedy generations at once: each iteration is a decode run of one of
    them (several steps) while the other's step waits, and the runs alternate between them."""
    core = VerifierCore(VerifierConfig(model=model_path, n_ctx=N_CTX, n_threads=1, batch_max=1,
                                       decode_steps=4, prefix_cache=False))
    try:
        prompts = [[7, 8, 9], [40, 41, 42, 43]]
        solo = [tokens_of(generate(core, p, 60)) for p in prompts]
        # a run waits until the other generation's step waits too (a step queued meanwhile ends
        # the run after one step), or the other has ended: the two meet whatever the timing
        finished: list = []
        runs = _record_decode_runs(monkeypatch, core, lambda batch: core.scheduler.waiting >= 1 or bool(finished))
        assert _at_once(core, [(p, 60, ()) for p in prompts], finished) == solo
        assert all(len(r) == 1 for r in runs), runs   # one session per call at batch_max 1
        assert sum(r[0][1] for r in runs) > len(runs)   # runs of several steps
        owners = [r[0][0] for r in runs]
        both = [i for i in range(1, len(owners)) if owners[i] != owners[i - 1]]
        assert len(set(owners)) == 2 and len(both) >= 4, runs   # the two take turns
    finally:
        core.close()


def test_t_comes_from_one_sessions_steps_single_or_in_a_run(model_path):
    """T (the speculation cost model's plain-round time, and a run's pacing) is fed by one
    session's steps on the one-session threads: single steps and the steps of a lone run, so
    generations that decode in runs keep it current (a stale T from deep contexts once stayed for
    every later short generation); the steps of a run over several sessions are left out."""
    from echospec.services.verifier.generation_loop import _PlainStream
    for steps in (1, 8):
        core = make_core(model_path, decode_steps=steps)
        try:
            core.t_ms = 1.0   # far off (runs of up to 50 steps at this T)
            core.scheduler.iterations = 0
            generate(core, [5, 9, 13], 20)
            assert core.t_ms != 1.0, steps
            assert steps == 1 or core.scheduler.iterations <= 4   # the prefill, then runs
        finally:
            core.close()

    class _Core:
        t_ms = 5.0
        fed: list = []

        def observe_decode(self, ms):
            self.fed.append(ms)

    class _RunStub:
        core, n_ctx, kv_tokens = _Core(), 256, []
        req = GenerationRequest(prompt=[1], max_tokens=50, eos_ids=frozenset(), sampling=Sampling())

        class session:
            n_past = 10

    for shared, fed in ((True, []), (False, [1.5, 2.5])):
        _Core.fed = []
        stream = _PlainStream(_RunStub(), 1, time.perf_counter())
        stream.advance(Step(None, [7], "all", "none", argmax=[8, 9], step_ms=[1.5, 2.5], shared=shared))
        assert _Core.fed == fed, shared


def test_decode_steps_must_be_positive():
    with pytest.raises(ValueError):
        Scheduler(threading.Lock(), decode_steps=0)


class _NoDrafts:
    """A draft link that finds nothing (free text): every proposal comes back empty. Records the
    history length and size of each proposal it is asked for."""

    def __init__(self):
        self.history: list[int] = []
        self.asked: list[tuple[int, int]] = []
        self.closed = False

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked.append((len(self.history), n))

    def recv_proposal(self):
        return []

    def close(self):
        self.closed = True

    def cancel(self):
        self.closed = True


@pytest.mark.parametrize("max_tokens,eos_after", [(200, None), (37, None), (200, 40)])
def test_the_back_off_plain_rounds_of_a_speculative_generation_run_in_the_engine(model_path, monkeypatch,
                                                                                max_tokens, eos_after):
    """Free text: proposals come back empty, the controller backs off for 1, 2, 4, ... rounds, and
    those rounds (no draft traffic) run as in-engine decode runs. The output, the events (one per
    token) and the proposals (asked at the same points of the history) are those of one engine
    call per round (decode_steps 1); max_tokens and an EOS id inside a run end it the same way."""
    prompt = [(i * 7) % 300 + 3 for i in range(10)]
    results = []
    for steps in (1, 8):
        core = make_core(model_path, decode_steps=steps, prefix_cache=False)
        try:
            plain = tokens_of(generate(core, prompt, max_tokens))
            eos_at = None   # an EOS id: the first token new to the output after eos_after tokens
            if eos_after is not None:
                eos_at = next(i for i in range(eos_after, len(plain)) if plain[i] not in plain[:i])
            eos = frozenset([plain[eos_at]]) if eos_at is not None else frozenset()
            runs = _record_decode_runs(monkeypatch)
            link = _NoDrafts()
            req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, eos_ids=eos, sampling=Sampling(),
                                    spec=True, k=4)
            check(core, req)
            evs = list(run_generation(core, req, threading.Event(), lambda: link))
            want = plain[:eos_at + 1] if eos_at is not None else plain
            assert tokens_of(evs) == want and all(len(e.tokens) == 1 and e.k == 0 for e in evs)
            assert [e.n_past for e in evs[1:]] == list(range(len(prompt) + 1, len(prompt) + len(want)))
            results.append((link.asked, [len(r[0][1:]) and r[0][1] for r in runs]))
            assert link.closed
        finally:
            core.close()
    (asked1, runs1), (asked8, runs8) = results
    assert asked1 == asked8 and len(asked1) >= 3
    assert runs1 == [] and max(runs8) > 1 and sum(runs8) >= len(want) // 2, runs8


@pytest.mark.parametrize("eager", [False, True])
def test_an_eager_back_off_asks_in_flight_beside_every_plain_round(model_path, eager):
    """Free text, nothing to draft: an eager generation (a spare CPU, or a prediction) keeps asking
    in flight beside each plain step, the back-off only stops blocking proposals; a generation
    that is not eager skips 1, 2, 4, ... rounds between probes. Same output either way."""
    prompt = [(i * 7) % 300 + 3 for i in range(10)]
    core = make_core(model_path, prefix_cache=False)
    try:
        plain = tokens_of(generate(core, prompt, 80))
        link = _NoDrafts()
        req = GenerationRequest(prompt=prompt, max_tokens=80, eos_ids=frozenset(), sampling=Sampling(),
                                spec=True, k=4, eager=eager)
        check(core, req)
        evs = list(run_generation(core, req, threading.Event(), lambda: link))
        assert tokens_of(evs) == plain
        blocking = sum(1 for e in evs if e.proposals and not e.k)
        assert blocking >= 1 and link.closed
        if eager:   # one probe per plain round after the first miss
            assert len(link.asked) >= len(plain) - 3, link.asked
        else:
            assert len(link.asked) <= 12, link.asked
    finally:
        core.close()


@pytest.mark.parametrize("spare", [False, True])
def test_the_verifier_is_eager_when_its_engine_leaves_a_cpu_free(model_path, spare):
    from echospec.services.common.config import usable_cpus
    n = usable_cpus()
    if spare and n == 1:
        n_threads = 1   # a one-CPU host has no CPU to spare at any thread count
    else:
        n_threads = n - 1 if spare else n
    core = VerifierCore(VerifierConfig(model=model_path, n_ctx=N_CTX, n_threads=n_threads))
    try:
        assert core.spare_cpu == (n_threads < usable_cpus())
        assert core.spare_cpu == (spare and usable_cpus() > 1)
    finally:
        core.close()


def test_readme_decode_steps_paragraph_matches_the_scheduler():
    # was: README said a stop string ends an in-engine decode run after its current step, but
    # stop strings are matched by the coordinator on the tokens a run returns (the verifier never
    # sees them): with --decode-steps 1024 a stop string hit at token 3 took the whole 1024-step
    # run (6.8 s). The range of --decode-steps was not given either.
    import pathlib
    import re
    from echospec.services.common import config
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    para = " ".join(text.split("Greedy decoding goes further", 1)[1]
                    .split("`--decode-steps 1` goes back", 1)[0].split())
    lo, hi, _ = config._INT_RANGES["decode_steps"]
    assert f"in [{lo}, {hi}]" in para, para
    enders = re.search(r"anything else needs the engine \(([^)]*)\)", para).group(1)
    assert "stop string" not in enders, enders
    assert "Stop strings are matched by the coordinator" in para


def _silent_draft_service():
    """A draft service that takes every ProposeStream message and never answers (stuck)."""
    from echospec.v1 import draft_pb2_grpc

    class Silent(draft_pb2_grpc.DraftServiceServicer):
        def __init__(self):
            self.ended = threading.Event()

        def ProposeStream(self, request_iterator, context):
            try:
                for _ in request_iterator:
                    pass
                return
                yield   # a generator: the stream's responses (none)
            finally:
                self.ended.set()

    return Silent()


@contextlib.contextmanager
def _draft_server(servicer):
    """A gRPC server of ``servicer`` (a draft service) on loopback; yields a channel to it."""
    import grpc

    from echospec.services.rpc import grpc_util
    from echospec.v1 import draft_pb2_grpc

    h = grpc_util.build_server("127.0.0.1", 0, 4, 1 << 20, ["echospec.v1.DraftService"])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, h.server)
    h.server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    try:
        yield ch
    finally:
        ch.close()
        h.server.stop(0).wait()


def test_a_draft_service_that_stops_answering_ends_speculation_not_the_generation(model_path):
    """A proposal that does not come within the link's reply timeout is a lost draft service:
    the generation decodes on plainly (same output) and says why, and the stuck stream is cancelled."""
    from echospec.services.verifier.draft_link import DraftLink
    from echospec.v1 import draft_pb2_grpc

    silent = _silent_draft_service()
    core = make_core(model_path, prefix_cache=False)
    with _draft_server(silent) as ch:
        try:
            prompt = [(i * 5) % 300 + 3 for i in range(12)]
            plain = tokens_of(generate(core, prompt, 30))
            link = DraftLink(draft_pb2_grpc.DraftServiceStub(ch), timeout=60, reply_timeout=0.3)
            req = GenerationRequest(prompt=prompt, max_tokens=30, eos_ids=frozenset(), sampling=Sampling(),
                                    spec=True, k=4)
            check(core, req)
            t0 = time.monotonic()
            evs = list(run_generation(core, req, threading.Event(), lambda: link))
            assert tokens_of(evs) == plain
            reasons = [e.spec_reason for e in evs if e.spec_reason]
            assert reasons == ["draft service did not answer within 0.3 s; decoded plainly from here on"]
            assert time.monotonic() - t0 < 20
            assert silent.ended.wait(10)   # the stream was cancelled: the service's handler ended
        finally:
            core.close()


def test_after_a_draft_service_missed_a_reply_the_next_generations_wait_less(model_path):
    """The links to one draft service share its reply timeout: once a proposal did not come, each
    later generation waits the short stalled timeout, not the full one (a stuck service costs every
    request that much), until a proposal comes again."""
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft.servicer import DraftServicer
    from echospec.services.verifier.draft_link import DraftLink, ReplyTimeout
    from echospec.v1 import draft_pb2_grpc

    core = make_core(model_path, prefix_cache=False)
    with _draft_server(_silent_draft_service()) as chs, _draft_server(DraftServicer(DraftConfig())) as chd:
        try:
            prompt = [(i * 5) % 300 + 3 for i in range(12)]
            plain = tokens_of(generate(core, prompt, 30))
            reply = ReplyTimeout(normal=1.5, stalled=0.1)

            def run(ch) -> tuple[list[str], float]:
                link = DraftLink(draft_pb2_grpc.DraftServiceStub(ch), timeout=60, reply_timeout=reply)
                req = GenerationRequest(prompt=prompt, max_tokens=30, eos_ids=frozenset(),
                                        sampling=Sampling(), spec=True, k=4)
                check(core, req)
                t0 = time.monotonic()
                evs = list(run_generation(core, req, threading.Event(), lambda: link))
                assert tokens_of(evs) == plain
                return [e.spec_reason for e in evs if e.spec_reason], time.monotonic() - t0

            reasons, _ = run(chs)
            assert reasons == ["draft service did not answer within 1.5 s; decoded plainly from here on"]
            reasons, took = run(chs)
            assert reasons == ["draft service did not answer within 0.1 s; decoded plainly from here on"]
            assert took < 1.5
            # a draft service that answers: full timeout again
            reasons, _ = run(chd)
            assert reasons == [] and reply.seconds == 1.5
        finally:
            core.close()


def test_the_draft_session_gets_the_whole_output_for_its_namespace_memory(model_path):
    """The output after a generation's last proposal goes to the draft session before the link
    closes, so its draft namespace's shared memory keeps the whole prompt and output."""
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft.servicer import DraftServicer
    from echospec.services.verifier.draft_link import DraftLink
    from echospec.v1 import draft_pb2_grpc

    servicer = DraftServicer(DraftConfig())
    core = make_core(model_path, prefix_cache=False)
    with _draft_server(servicer) as ch:
        try:
            for i, max_tokens in enumerate((1, 2, 30, 61)):
                ns = f"ns{i}"
                prompt = [(j * 7 + i) % 300 + 3 for j in range(12)]
                link = DraftLink(draft_pb2_grpc.DraftServiceStub(ch), timeout=60, draft_namespace=ns)
                req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, eos_ids=frozenset(),
                                        sampling=Sampling(), spec=True, k=4)
                check(core, req)
                out = tokens_of(list(run_generation(core, req, threading.Event(), lambda: link)))
                assert len(out) == max_tokens
                t_end = time.monotonic() + 10
                while servicer.memory.n_tokens(ns) == 0 and time.monotonic() < t_end:
                    time.sleep(0.01)
                assert servicer.memory.n_tokens(ns) == len(prompt) + max_tokens, max_tokens
            # an EOS inside an accepted run of drafts (the prediction is the output plain decoding
            # gives without the EOS): the namespace keeps the output up to the EOS, not the drafts
            # the round accepted after it
            prompt = [(j * 14) % 300 + 3 for j in range(12)]   # gives 10 x 157, then 313 ...
            plain = tokens_of(generate(core, prompt, max_tokens=40))
            at = max(plain.index(t) for t in plain)   # an EOS there ends the output there
            assert at >= 4
            link = DraftLink(draft_pb2_grpc.DraftServiceStub(ch), timeout=60, draft_namespace="eos",
                             prediction=plain)
            req = GenerationRequest(prompt=prompt, max_tokens=40, eos_ids=frozenset([plain[at]]),
                                    sampling=Sampling(), spec=True, k=8, fixed_k=True, prediction=tuple(plain))
            check(core, req)
            evs = list(run_generation(core, req, threading.Event(), lambda: link))
            assert tokens_of(evs)[:at + 1] == plain[:at + 1]
            assert len(tokens_of(evs)) > at + 1   # the EOS's round accepted drafts after it
            t_end = time.monotonic() + 10
            while servicer.memory.n_tokens("eos") == 0 and time.monotonic() < t_end:
                time.sleep(0.01)
            assert servicer.memory.n_tokens("eos") == len(prompt) + at + 1
        finally:
            core.close()


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_verify_runs_give_the_plain_output_and_keep_the_kv_in_step(smollm2_path, monkeypatch, wrong_every):
    """Chain rounds over a longer proposal run in the engine (several rounds per call), each round
    its own event with the counters and n_past of a round of its own; the output is plain
    decoding's, and the KV the generation leaves (the prefix cache) serves the next request
    exactly. A run leaves the cache's last round to the loop, which asks the next proposal beside
    it, so every round drafts k. --no-verify-runs: no run, the same output. (The real model: its
    output varies, so a KV cache a token out of step would show.)"""
    runs = _record_run_spans(monkeypatch)
    model_path = smollm2_path
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 30, 2]
    outs = {}
    for verify_runs in (True, False):
        core = make_core(model_path, verify_runs=verify_runs)
        try:
            plain = tokens_of(generate(core, prompt, 60))
            link = _OracleDraft(prompt + plain, None, wrong_every)
            req = GenerationRequest(prompt=prompt, max_tokens=60, eos_ids=frozenset(), sampling=Sampling(),
                                    spec=True, k=4, fixed_k=True)
            check(core, req)
            del runs[:]
            evs = list(run_generation(core, req, threading.Event(), lambda: link))
            out = tokens_of(evs)
            assert out == plain
            produced = 0
            for e in evs:
                if e.k and not wrong_every and produced + 5 < 60:
                    assert e.k == 4   # full rounds: a run leaves the cache's last round to the loop,
                                      # which asks the next proposal beside it
                produced += len(e.tokens)
                assert e.n_past == len(prompt) + produced - 1   # the last token is not in the KV yet
                assert 0 <= e.accepted <= e.k <= 4 and len(e.tokens) == e.accepted + 1
            if verify_runs:
                assert runs and max(len(r[2]) for r in runs) >= 3, runs
                rounds = [kr for run in runs for kr in run[2]]
                assert sum(k for k, _ in rounds) <= sum(e.k for e in evs)
            else:
                assert runs == []
            outs[verify_runs] = [(e.k, e.accepted) for e in evs]
            # the KV the generation left behind: a longer prompt over it decodes as from scratch
            turn2 = prompt + out + [7, 8, 9]
            again = generate(core, turn2, 12)
            assert again[0].cached_prompt_tokens == len(prompt) + len(out) - 1   # all but the pending token
        finally:
            core.close()
        fresh = make_core(model_path, prefix_cache=False)
        try:
            assert tokens_of(again) == tokens_of(generate(fresh, turn2, 12))
        finally:
            fresh.close()


def test_a_verify_run_gives_way_to_other_work(model_path):
    """A verify-run step alone runs its rounds in one engine call; with another step waiting it is
    one verify like any other, and it never shares an iteration."""
    from echospec.services.verifier.scheduler import Scheduler, Step
    core = make_core(model_path, prefix_cache=False)
    try:
        prompt = [(i * 5) % 300 + 3 for i in range(12)]
        plain = tokens_of(generate(core, prompt, 60))
        sched = Scheduler(threading.Lock(), batch_max=4)
        a, b = core.model.new_session(n_ctx=256, n_threads=1), core.model.new_session(n_ctx=256, n_threads=1)

        def run_step() -> Step:   # pending: the prompt's last token; the drafts: plain's output
            a.rollback(len(prompt) - 1)
            return Step(a, [prompt[-1]] + plain[:3], verify_run=(plain, 3, 40, (), 0.0))
        try:
            for s in (a, b):
                s.forward(prompt[:-1])
            st = sched.run(run_step())                                       # alone: a run
            assert st.run is not None and len(st.run.k) >= 3
            assert st.run.tokens == plain[:len(st.run.tokens)] and a.n_past == len(prompt) + len(st.run.tokens) - 1
            other, second = Step(b, [prompt[-1]]), run_step()
            with sched._cv:
                sched._queue += [other, second]
                sched._iterate_locked()             # `other` alone: a run step never shares an iteration
                assert other.done and not second.done
                sched._iterate_locked()             # nothing else waits: a run
            assert second.run is not None and second.run.tokens == st.run.tokens
            third = run_step()
            with sched._cv:
                sched._queue += [third, Step(b, [plain[0]])]
                sched._iterate_locked()             # another step waits: one verify
            assert third.run is None and list(third.argmax) == plain[:4] and a.n_past == len(prompt) + 3
        finally:
            a.close()
            b.close()
    finally:
        core.close()


def _oracle_generation(core, prompt: list[int], plain: list[int], max_tokens: int = 60, eos=frozenset(),
                       cancel: threading.Event | None = None) -> list:
    """A greedy speculative generation (k 4, fixed) whose draft link proposes ``plain`` (the plain
    output after ``prompt``): its events."""
    link = _OracleDraft(prompt + plain, None, 0)
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, eos_ids=frozenset(eos), sampling=Sampling(),
                            spec=True, k=4, fixed_k=True)
    check(core, req)
    return list(run_generation(core, req, cancel or threading.Event(), lambda: link))


def _record_run_spans(monkeypatch) -> list:
    """Per Session.verify_run call from now on: (n_past before it, its tokens, its rounds' (k, r))."""
    from echospec.services.verifier import engine as engine_mod
    runs: list = []
    real = engine_mod.Session.verify_run

    def recording(self, *a, **kw):
        n0 = self.n_past
        res = real(self, *a, **kw)
        runs.append((n0, list(res.tokens), list(zip(res.k, res.r))))
        return res
    monkeypatch.setattr(engine_mod.Session, "verify_run", recording)
    return runs


def _inner_run_positions(runs: list, n_prompt: int) -> list[int]:
    """Output indices of tokens a run yielded as kept drafts (not a bonus, not the run's last
    token) in a round after its first: where an end inside a run can fall."""
    at = []
    for n0, toks, rounds in runs:
        i = n0 - n_prompt + 1           # the run's first token's output index (its pending: i - 1)
        for j, (_, r) in enumerate(rounds):
            if j:
                at += [i + x for x in range(r) if i + x < n0 - n_prompt + len(toks)]
            i += r + 1
    return at


def _kv_serves_the_next_turn(core, model_path, prompt: list[int], out: list[int]) -> None:
    """The KV the generation left (the prefix cache): a longer prompt over it decodes as from scratch."""
    turn2 = prompt + out + [7, 8, 9]
    again = generate(core, turn2, 12)
    assert again[0].cached_prompt_tokens >= len(prompt) + len(out) - 1
    fresh = make_core(model_path, prefix_cache=False)
    try:
        assert tokens_of(again) == tokens_of(generate(fresh, turn2, 12))
    finally:
        fresh.close()


SMOL_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 30, 2]


def test_an_eos_inside_a_verify_run_ends_the_output_as_plain_decoding(smollm2_path, monkeypatch):
    """An EOS id that a run keeps as a draft in one of its later rounds: the run ends with that
    round, the output is plain decoding's up to the EOS, the event holding it is the last, and
    the KV the generation leaves (the round's tokens past the EOS included) serves the next
    request exactly."""
    runs = _record_run_spans(monkeypatch)
    core = make_core(smollm2_path)
    try:
        prompt = SMOL_PROMPT
        plain = tokens_of(generate(core, prompt, 60))

        def spec(eos=frozenset()):
            del runs[:]
            return _oracle_generation(core, prompt, plain, eos=eos)

        spec()
        inner = [p for p in _inner_run_positions(runs, len(prompt)) if plain[p] not in plain[:p]]
        assert inner, runs
        tried = 0
        for p in inner[:3]:
            eos = {plain[p]}
            want = tokens_of(generate(core, prompt, 60, eos=eos))
            assert want == plain[:p + 1]                      # plain decoding ends at the EOS
            evs = spec(eos)
            out = tokens_of(evs)
            assert out[:p + 1] == want and eos.isdisjoint(out[:p])
            assert plain[p] in evs[-1].tokens                  # the event holding it is the last
            assert any(n0 - len(prompt) + 1 <= p < n0 - len(prompt) + 1 + len(toks) and len(rounds) > 1
                       for n0, toks, rounds in runs), (p, runs)   # it came from a run's later round
            _kv_serves_the_next_turn(core, smollm2_path, prompt, want)
            tried += 1
        assert tried
    finally:
        core.close()


def test_max_tokens_inside_a_verify_run_ends_the_output_as_plain_decoding(smollm2_path, monkeypatch):
    """max_tokens ending where a run is going on: the run's last round shrinks to the output's
    end (es_verify_run's max_out), the output is plain decoding's first max_tokens tokens
    exactly, the event giving the last one ends the generation, and the KV left behind serves
    the next request exactly."""
    runs = _record_run_spans(monkeypatch)
    core = make_core(smollm2_path)
    try:
        prompt = SMOL_PROMPT
        plain = tokens_of(generate(core, prompt, 60))
        _oracle_generation(core, prompt, plain)
        inner = _inner_run_positions(runs, len(prompt))
        assert inner, runs
        ended_in_a_run = 0
        for p in inner[:: max(1, len(inner) // 4)][:4]:
            m = p + 1                                          # the output ends at index p
            del runs[:]
            evs = _oracle_generation(core, prompt, plain, max_tokens=m)
            out = tokens_of(evs)
            assert out == plain[:m], (m, out)
            assert evs[-1].tokens and evs[-1].tokens[-1] == plain[m - 1]
            # runs of several rounds went on up to where the loop's last rounds take over (a run
            # leaves the proposal's last k + 1 tokens, so max_out never cuts one short here)
            ends = [n0 - len(prompt) + len(toks) for n0, toks, rounds in runs if len(rounds) > 1]
            ended_in_a_run += bool(ends) and max(ends) >= m - 2 * 5
            _kv_serves_the_next_turn(core, smollm2_path, prompt, out)
        assert ended_in_a_run, "no case ran a run of several rounds up to its last rounds"
    finally:
        core.close()


def test_a_cancel_during_a_verify_run_ends_it_after_its_round(smollm2_path, monkeypatch):
    """A cancel that comes while a run goes on (the scheduler's wake sets the run's interrupt):
    the engine returns after the round it is in, the generation gives that round's event and
    none after it, its output is plain decoding's so far, and the KV it leaves to the prefix
    cache serves the next request exactly."""
    from echospec.services.verifier import engine as engine_mod
    real = engine_mod.Session.verify_run
    cancel = threading.Event()
    seen: list = []

    def cancelled_meanwhile(self, *a, **kw):
        if not seen:   # the first run: the cancel and the wake arrive as its first round starts
            cancel.set()
            core.scheduler.wake()
        res = real(self, *a, **kw)
        seen.append(list(zip(res.k, res.r)))
        return res
    monkeypatch.setattr(engine_mod.Session, "verify_run", cancelled_meanwhile)
    core = make_core(smollm2_path)
    try:
        prompt = SMOL_PROMPT
        plain = tokens_of(generate(core, prompt, 60))
        evs = _oracle_generation(core, prompt, plain, cancel=cancel)
        out = tokens_of(evs)
        assert seen and seen[0] == [(4, 4)] and len(seen) == 1     # one round, then no more
        assert out == plain[:len(out)] and len(out) < 60
        assert (evs[-1].k, evs[-1].accepted) == (4, 4)              # the run's round, the last event
        _kv_serves_the_next_turn(core, smollm2_path, prompt, out)
    finally:
        core.close()


def test_the_draft_service_failing_after_a_verify_run_gives_the_plain_output(smollm2_path, monkeypatch):
    """The draft service fails on the proposal collected right after a run (its last round's
    in-flight ask): the generation decodes plainly from there, with plain decoding's output, one
    spec_reason, and a KV cache that serves the next request exactly."""
    from echospec.services.verifier import engine as engine_mod
    log: list = []
    real = engine_mod.Session.verify_run

    def logged(self, *a, **kw):
        log.append("run")
        return real(self, *a, **kw)
    monkeypatch.setattr(engine_mod.Session, "verify_run", logged)

    class _Logged(_OracleDraft):
        def recv_proposal(self):
            try:
                p = super().recv_proposal()
            except Exception:
                log.append("fail")
                raise
            log.append("recv")
            return p
    core = make_core(smollm2_path)
    try:
        prompt = SMOL_PROMPT
        plain = tokens_of(generate(core, prompt, 60))
        after_a_run = 0
        req = GenerationRequest(prompt=prompt, max_tokens=60, eos_ids=frozenset(), sampling=Sampling(),
                                spec=True, k=2, fixed_k=True)
        check(core, req)
        counting = _OracleDraft(prompt + plain)
        list(run_generation(core, req, threading.Event(), lambda: counting))
        assert len(counting.asked) >= 3, counting.asked
        for fail_after in range(2, len(counting.asked) + 1):   # each proposal after the first fails once
            del log[:]
            link = _Logged(prompt + plain, fail_after, 0)
            evs = list(run_generation(core, req, threading.Event(), lambda: link))
            out = tokens_of(evs)
            assert out[:60] == plain and len(out) <= 61
            reasons = [e.spec_reason for e in evs if e.spec_reason]
            assert len(reasons) == 1 and "draft service unreachable" in reasons[0]
            assert log.count("fail") == 1
            after_a_run += log[log.index("fail") - 1] == "run"
            _kv_serves_the_next_turn(core, smollm2_path, prompt, plain)
        assert after_a_run, "no failure came right after a run"
    finally:
        core.close()


class _FailingRun:
    """The engine's ``lib`` with, once ``armed``, one es_verify_run that fails in a round after
    its first: the rounds before it done, the KV cache as after them and ``message`` on the
    session, as a round's own error ends a run (echospec_engine.h, es_verify_run: a forward's
    ES_ERR_NOMEM or ES_ERR_BAD_WEIGHTS). Every other call is the engine's."""

    def __init__(self, real: Any, status: int, message: str):
        from echospec.services.verifier.engine import ffi
        self._real, self.status = real, status
        self._message = ffi.new("char[]", message.encode())
        self._failed_on: Any = None       # the session whose next last_error is the message
        self.armed = False
        self.failed: list[int] = []       # the rounds done before the failing one
        self.runs = 0                     # es_verify_run calls that ran as the engine's

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def es_verify_run(self, session: Any, args: Any) -> int:
        st = self._real.es_verify_run(session, args)
        if st == 0 and self.armed and args.n_rounds >= 2:
            self.armed = False
            self.failed.append(args.n_rounds)
            self._failed_on = session
            return self.status
        self.runs += 1
        return st

    def es_session_last_error(self, session: Any) -> Any:
        if self._failed_on is not None and session == self._failed_on:
            self._failed_on = None
            return self._message
        return self._real.es_session_last_error(session)


@pytest.mark.parametrize("status,code", [("ES_ERR_CAPACITY", "RESOURCE_EXHAUSTED"),
                                         ("ES_ERR_NOMEM", "RESOURCE_EXHAUSTED"),
                                         ("ES_ERR_BAD_WEIGHTS", "INTERNAL"),
                                         ("ES_ERR_INTERNAL", "INTERNAL")])
def test_a_forward_error_inside_a_verify_run_ends_that_generation_alone(smollm2_path, monkeypatch, status, code):
    """The engine fails in a verify run's third round or later (es_verify_run's status, the
    message on the session), over gRPC: that generation ends with the status of its kind and
    "generation: " + the engine's words (its name too where the status does not say it), after
    the tokens of its rounds before the run, which are plain decoding's; its session goes back
    with the KV cache rolled back to before the run, which then serves the next turn exactly;
    another generation, its session held mid-output meanwhile (parked on a proposal), goes on
    with plain decoding's output and the KV in step; and the service runs verify runs after it."""
    import grpc

    from echospec.services.rpc import grpc_util
    from echospec.services.verifier import engine as engine_mod
    from echospec.services.verifier.servicer import VerifierServicer
    from echospec.v1 import verifier_pb2, verifier_pb2_grpc

    msg = f"a round's forward failed ({status} injected by the test)"
    failing = _FailingRun(engine_mod.lib, getattr(engine_mod.lib, status), msg)
    monkeypatch.setattr(engine_mod, "lib", failing)
    core = make_core(smollm2_path)
    prompt_a, prompt_b = SMOL_PROMPT, SMOL_PROMPT[:6] + [28, 2683, 359, 253, 30, 2]
    plain_a, plain_b = tokens_of(generate(core, prompt_a, 60)), tokens_of(generate(core, prompt_b, 60))
    parked, go = threading.Event(), threading.Event()

    class _Parked(_OracleDraft):   # B's link: its second proposal (in flight) waits until A has failed
        def recv_proposal(self):
            if len(self.asked) == 2 and not parked.is_set():
                parked.set()
                assert go.wait(60)
            return super().recv_proposal()
    links = {"a": lambda: _OracleDraft(prompt_a + plain_a), "b": lambda: _Parked(prompt_b + plain_b)}
    servicer = VerifierServicer(core, lambda timeout, **setup: links[setup["draft_namespace"]]())
    h = grpc_util.build_server("127.0.0.1", 0, 8, 1 << 22, ["echospec.v1.VerifierService"])
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, h.server)
    h.server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    stub = verifier_pb2_grpc.VerifierServiceStub(ch)

    def call(ns: str, prompt: list[int], got: list, spec: bool = True, max_tokens: int = 60) -> list:
        """The generation's messages (its tokens appended to ``got`` as they come)."""
        msgs = []
        req = verifier_pb2.GenerateTokensRequest(prompt=prompt, max_tokens=max_tokens, spec=spec, k=4,
                                                 fixed_k=True, tree_nodes=-1, draft_namespace=ns)
        for m in stub.GenerateTokens(req, timeout=120):
            msgs.append(m)
            got += [t for r in m.rounds for t in r.result.tokens]
        return msgs

    b_got: list = []
    b_msgs: list = []
    b_thread = threading.Thread(target=lambda: b_msgs.extend(call("b", prompt_b, b_got)))
    try:
        b_thread.start()
        assert parked.wait(60), "B never asked a second proposal"
        t_end = time.monotonic() + 10
        while not b_got and time.monotonic() < t_end:   # B's rounds so far reach its client
            time.sleep(0.01)
        assert core.active_sessions == 1 and 0 < len(b_got) < 60
        failing.armed = True
        a_got: list = []
        with pytest.raises(grpc.RpcError) as ei:
            call("a", prompt_a, a_got)
        assert failing.failed and failing.failed[0] >= 2, failing.failed   # in a run's third round on
        assert ei.value.code() == getattr(grpc.StatusCode, code), ei.value
        assert ei.value.details() == ("generation: " if status == "ES_ERR_CAPACITY"
                                      else f"generation: {status}: ") + msg
        assert 1 <= len(a_got) < 60 and a_got == plain_a[:len(a_got)]
        assert core.active_sessions == 1                          # A's session is back; B's held
        go.set()
        b_thread.join(60)
        assert b_got == plain_b
        n = 0
        for r in (r for m in b_msgs for r in m.rounds):   # B's KV in step: all but its last token
            n += len(r.result.tokens)
            assert r.result.n_past == len(prompt_b) + n - 1
        assert core.active_sessions == 0
        # the KV A left (rolled back to before the run): a next turn over it decodes as from scratch
        turn2 = prompt_a + a_got + [7, 8, 9]
        again = call("", turn2, [], spec=False, max_tokens=12)
        assert again[0].cached_prompt_tokens == len(prompt_a) + len(a_got) - 1
        fresh = make_core(smollm2_path, prefix_cache=False)
        try:
            assert [t for m in again for r in m.rounds for t in r.result.tokens] == \
                tokens_of(generate(fresh, turn2, 12))
        finally:
            fresh.close()
        # and the service speculates on, with verify runs
        runs, got = failing.runs, []
        call("a", prompt_a, got)
        assert got == plain_a and failing.runs > runs
    finally:
        go.set()
        b_thread.join(60)
        ch.close()
        h.server.stop(0).wait()
        core.close()
