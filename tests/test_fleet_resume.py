"""A generation moves to another verifier when its own fails or stalls after the first token.

Two boards (verifier + draft service, separate processes, tests/test_fleet.py's Board) on
loopback serve SmolLM2; one coordinator in this process balances over them. A generation of
200 tokens is interrupted at its 20th token by SIGKILL (the connection drops) or SIGSTOP (the
verifier freezes: only the progress deadline notices) of the verifier serving it. The client's
stream carries no error and its text is byte-identical to an uninterrupted run; the result's
`moves` says from where and at which token. With no verifier left the generation ends with
UNAVAILABLE naming its moves. Pure parts (the deadline formula, the sampler's RNG skip) have
literal tests.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_fleet import Board, running  # noqa: E402
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.services.common.config import CoordinatorConfig  # noqa: E402
from echospec.services.coordinator import server as cserver  # noqa: E402
from echospec.services.coordinator.progress import STALL_FACTOR, ProgressClock  # noqa: E402

N_CTX = 1024
MAX_TOKENS = 200
KILL_AT = 20
STALL_FLOOR_S = 1.0
PROMPT = ("<|im_start|>user\nWrite a long story about a lighthouse keeper and her cat, with many "
          "details about the sea.<|im_end|>\n<|im_start|>assistant\n")


# ---- pure parts --------------------------------------------------------------------------------

def test_deadline_is_the_floor_for_a_fast_verifier_alone():
    c = ProgressClock(1.0, t_ms=20.0, prefill_chunk=256, prompt_tokens=5)
    assert c.deadline_s(0) == 1.0                     # the prefill: 8 * 5 * 20 ms = 0.8 s < floor
    c.observe(wall_ms=50.0, t_ms=20.0)
    assert c.deadline_s(0) == 1.0                     # 8 * 50 ms = 0.4 s < floor


def test_deadline_follows_the_verifiers_own_costs_under_load():
    c = ProgressClock(1.0, t_ms=20.0, prefill_chunk=256, prompt_tokens=600)
    assert c.deadline_s(0) == pytest.approx(STALL_FACTOR * 600 * 20 / 1e3)   # the prefill: 96 s
    c.observe(wall_ms=400.0, t_ms=25.0)              # a round behind other sessions' steps
    assert c.deadline_s(0) == pytest.approx(STALL_FACTOR * 0.4)
    c.observe(wall_ms=10.0, t_ms=25.0)               # the slow round is remembered, decaying
    assert c.deadline_s(0) == pytest.approx(STALL_FACTOR * 0.36)
    # 3 other sessions may each run a prefill chunk before this one's next step
    assert c.deadline_s(3) == pytest.approx(STALL_FACTOR * (0.36 + 3 * 256 * 0.025))


def test_deadline_off_with_floor_zero_or_unknown_t():
    assert ProgressClock(0.0, 20.0, 256, 10).deadline_s(0) is None
    assert ProgressClock(1.0, 0.0, 256, 10).deadline_s(0) is None


def test_rng_advance_is_the_samplers_own_state_after_n_draws():
    from echospec.services.verifier.engine import rng_advance, sample
    rows = np.random.default_rng(0).standard_normal((40, 50)).astype(np.float32)
    for seed in (0, 1, 2 ** 64 - 1, 12345):
        rng = seed
        for n, row in enumerate(rows):
            assert rng_advance(seed, n) == rng & 0xFFFFFFFFFFFFFFFF, (seed, n)
            _, rng = sample(row, temperature=0.9, top_k=20, rng=rng)


class _FakeLink:
    """generate()'s link over literal verifier messages (a Move between two of them: a resume)."""

    def __init__(self, items):
        self.items = items

    def events(self):
        yield from self.items

    def cancel(self):
        pass


def _msg(tokens, v_ms=10.0, wall_ms=12.0, cached=0):
    from echospec.v1 import verifier_pb2
    return verifier_pb2.GenerateTokensResponse(cached_prompt_tokens=cached, rounds=[
        verifier_pb2.GenerationRound(result=verifier_pb2.StepResult(tokens=[t], t_ms=20.0, v_ms=v_ms),
                                     wall_ms=wall_ms) for t in tokens])


def test_text_and_stop_strings_run_across_a_move_without_a_seam(smollm2_path):
    # the detokenizer and the stop matcher live in the coordinator's generate() and carry on
    # over the next verifier's tokens: a UTF-8 character whose bytes are split over the move,
    # and a stop string that starts before it and ends after it, come out as without a move
    from echospec.services.coordinator.generation import GenerationParams, Move, Outcome, generate
    from echospec.services.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm2_path)
    text = "The lighthouse 🐈 keeper said: the sea is calm tonight. Then"
    ids = tok.encode(text)
    cat = tok.encode(" 🐈")
    assert len(cat) >= 2       # byte-level tokens: the move falls inside the character
    cut = next(i for i in range(len(ids)) if ids[i:i + len(cat)] == cat) + 1

    def run(items, stop):
        params = GenerationParams(max_tokens=len(ids), stop=stop, sampling=None, spec=False,
                                  spec_reason="", k=1)
        evs = list(generate([1, 2, 3], params, tok, _FakeLink(items)))
        return "".join(e.text for e in evs[:-1]), evs[-1]

    whole = [_msg(ids[:1], cached=3)] + [_msg([t]) for t in ids[1:]]
    move = Move("a:1", "b:1", cut, "UNAVAILABLE: gone", resume_ms=30.0)
    moved = [_msg(ids[:1], cached=3)] + [_msg([t]) for t in ids[1:cut]] + \
        [move, _msg(ids[cut:cut + 1], v_ms=55.0, cached=7)] + [_msg([t]) for t in ids[cut + 1:]]
    for stop in (["sea is calm"], ["🐈 keeper"], []):
        streamed_a, out_a = run(whole, stop)
        streamed_b, out_b = run(moved, stop)
        assert isinstance(out_b, Outcome) and streamed_b.encode() == streamed_a.encode()
        assert out_b.text == out_a.text and out_b.finish_reason == out_a.finish_reason, stop
        assert out_b.text == (text[:text.index(stop[0])] if stop else text)
    assert streamed_b == text and out_b.token_ids == ids
    # the resumed prefill is the move's, not a round of the stats
    assert [m.prefill_ms for m in out_b.moves] == [55.0] and out_b.moves[0].cached_prompt_tokens == 7
    assert out_b.counters.rounds == out_a.counters.rounds - 1
    assert out_b.counters.cached_prompt_tokens == 3


def test_resumed_output_reaches_the_draft_session_as_output():
    # the draft session's first append is its prompt, later ones are output (the prediction
    # follows the output): a resumed generation's output so far goes in as output
    from echospec.services.verifier.generation_loop import _Drafts

    class Recorder:
        def __init__(self):
            self.appends = []

        def append(self, tokens):
            self.appends.append(list(tokens))

    fresh, resumed = Recorder(), Recorder()
    _Drafts(fresh, 4, True, [1, 2, 3, 4, 5])
    d = _Drafts(resumed, 4, True, [1, 2, 3, 4, 5], resumed=2)
    assert fresh.appends == [[1, 2, 3, 4, 5]]
    assert resumed.appends == [[1, 2, 3], [4, 5]] and d.synced == 5


def test_verifier_refuses_a_resumed_count_outside_the_prompt():
    from types import SimpleNamespace
    from echospec.services.verifier.generation_loop import GenerationRequest, check
    from echospec.services.verifier.sessions import InvalidArgument, Sampling
    core = SimpleNamespace(config=SimpleNamespace(n_ctx=64, max_k=8), n_vocab=100, context_limit=64)

    def req(resumed):
        return GenerationRequest(prompt=[1, 2, 3], max_tokens=4, eos_ids=frozenset({0}),
                                 sampling=Sampling(), resumed=resumed)
    check(core, req(2))
    for bad in (3, -1):
        with pytest.raises(InvalidArgument, match=r"resumed_tokens must be in \[0, 3\)"):
            check(core, req(bad))


def test_a_resumed_generation_leaves_its_session_for_the_next_turn(tiny_model):
    # the session a resumed generation leaves is its conversation's: the next turn, which
    # starts with the original prompt but may tokenize the output so far otherwise, takes it
    # (was: the output so far counted as the entry's prompt, so such a turn was refused it as
    # "another conversation" and prefilled everything)
    from echospec.stack import start_stack
    from echospec.v1 import verifier_pb2 as vpb, verifier_pb2_grpc
    st = start_stack(tiny_model(), spec=False, n_ctx=256, n_threads=1)
    ch = grpc.insecure_channel(st.verifier_target)
    try:
        stub = verifier_pb2_grpc.VerifierServiceStub(ch)
        prompt, out = list(range(10, 20)), list(range(40, 70))   # 10 of its own, 30 resumed
        list(stub.GenerateTokens(vpb.GenerateTokensRequest(
            prompt=prompt + out, resumed_tokens=len(out), max_tokens=8), timeout=60))
        turn2 = prompt + [90 + i for i in range(len(out))] + [5, 6, 7]   # the output re-tokenized
        first = next(iter(stub.GenerateTokens(vpb.GenerateTokensRequest(prompt=turn2, max_tokens=2),
                                              timeout=60)))
        assert first.cached_prompt_tokens == len(prompt), first.cached_prompt_tokens
    finally:
        ch.close()
        st.stop()


def test_python_client_result_carries_the_moves():
    from echospec_client import Move, Result
    from echospec_client.v1 import coordinator_pb2 as client_pb2
    r = Result.from_proto(client_pb2.GenerationResult(text="ab", verifier="b:1", moves=[
        client_pb2.VerifierMove(from_verifier="a:1", to_verifier="b:1", at_token=20,
                                reason="UNAVAILABLE: gone", resume_ms=31.5, prefill_ms=20.0,
                                cached_prompt_tokens=12)]))
    assert r.moves == (Move("a:1", "b:1", 20, "UNAVAILABLE: gone", 31.5, 20.0, 12),)
    assert Result.from_proto(client_pb2.GenerationResult(text="ab")).moves == ()


# ---- the fleet -----------------------------------------------------------------------------------

class SmolBoard(Board):
    """A test_fleet Board with a small KV cache (SmolLM2's sessions are larger than the tiny model's)."""

    def start_verifier(self) -> None:
        self.verifier = self._spawn("verifier", [
            "--host", self.ip, "--port", str(self.vport), "--model", self.model,
            "--n-ctx", str(N_CTX), "--n-threads", "1", "--max-sessions", "4",
            "--draft-target", f"{self.ip}:{self.dport}"])

    def restart(self) -> None:
        if self.verifier is not None and self.verifier.poll() is None:
            self.verifier.kill()
            self.verifier.wait(10)
        self.start_verifier()
        self.wait()


@pytest.fixture(scope="module")
def boards(smollm2_path):
    with running(SmolBoard, ["127.0.0.21", "127.0.0.22"], smollm2_path) as bs:
        yield bs


class Coordinator:
    def __init__(self, model: str, boards, **settings):
        cfg = CoordinatorConfig(model=model, port=0, verifier=tuple(b.address for b in boards),
                                verifier_poll_s=0.2, metrics_port=-1, log_level="WARNING",
                                stall_floor_s=STALL_FLOOR_S, **settings)
        self.server = cserver.start(cfg, verifier_wait_s=60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def info(self) -> dict:
        return {v.address: v for v in self.stub.GetInfo(cpb.GetInfoRequest(), timeout=10).verifiers}

    def wait_healthy(self, addresses, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.info()[a].healthy for a in addresses):
            assert time.monotonic() < deadline, f"not healthy in time: {self.info()}"
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture(scope="module")
def coord(smollm2_path, boards):
    c = Coordinator(smollm2_path, boards)
    yield c
    c.close()


def _request(mode: str, prediction: str = "", max_tokens: int = MAX_TOKENS) -> cpb.GenerateRequest:
    """plain: greedy; spec: greedy with speculation, drafting from ``prediction``; sampled:
    temperature 0.8 with a seed. Each with logprobs (those of the tokens before a move came with
    them, the next verifier's follow)."""
    spec = common_pb2.SPEC_MODE_ON if mode == "spec" else common_pb2.SPEC_MODE_OFF
    lp = dict(logprobs=True, top_logprobs=2)
    if mode == "sampled":
        return cpb.GenerateRequest(text=PROMPT, max_tokens=max_tokens, spec=spec, temperature=0.8,
                                   top_k=40, seed=7, **lp)
    return cpb.GenerateRequest(text=PROMPT, max_tokens=max_tokens, spec=spec, prediction=prediction,
                               **lp)


def _serving(coord: Coordinator, boards) -> SmolBoard:
    info = coord.info()
    [b] = [b for b in boards if info[b.address].in_flight == 1]
    return b


def _interrupted(coord, boards, req: cpb.GenerateRequest, sig: int):
    """Stream a generation, send ``sig`` to its verifier at token KILL_AT; returns (text, token
    ids, result, seconds from the signal to the next token, the victim)."""
    text, ids, result = [], [], None
    victim, t_sig, gap = None, None, None
    for msg in coord.stub.Generate(req, timeout=120):
        if msg.HasField("result"):
            result = msg.result
            break
        if t_sig is not None and gap is None and msg.token_ids:
            gap = time.monotonic() - t_sig
        text.append(msg.text)
        ids.extend(msg.token_ids)
        if victim is None and len(ids) >= KILL_AT:
            victim = _serving(coord, boards)
            os.kill(victim.verifier.pid, sig)
            t_sig = time.monotonic()
    return "".join(text), ids, result, gap, victim


@pytest.mark.parametrize("mode", ["plain", "spec", "sampled"])
def test_killed_verifier_resumes_elsewhere_with_the_same_text(coord, boards, mode):
    def complete(req):
        return coord.stub.Complete(cpb.CompleteRequest(**{f.name: v for f, v in req.ListFields()}),
                                   timeout=120).result
    # speculation drafts from a prediction (the plain output), so its drafts are mostly
    # accepted on both sides of the move: the draft session's history moved with it
    prediction = complete(_request("plain")).text if mode == "spec" else ""
    req = _request(mode, prediction)
    ref = complete(req)
    assert ref.completion_tokens == MAX_TOKENS and not ref.moves
    moves = coord.server.servicer.metrics.v_moves
    before = {b.address: moves.labels(verifier=b.address)._value.get() for b in boards}
    text, ids, result, gap, victim = _interrupted(coord, boards, req, signal.SIGKILL)
    try:
        assert victim is not None and result is not None
        assert text.encode() == ref.text.encode() and ids == list(ref.token_ids)
        assert result.text == ref.text and result.completion_tokens == MAX_TOKENS
        assert [x.token_id for x in result.logprobs] == list(ref.token_ids)
        # bitwise: the next verifier's prefill row for a position is the one decoding computed
        # there (the engine's contract: one call over N tokens == N one-token calls)
        assert [x.logprob for x in result.logprobs] == [x.logprob for x in ref.logprobs]
        [move] = result.moves
        other = next(b for b in boards if b is not victim)
        assert (move.from_verifier, move.to_verifier) == (victim.address, other.address)
        assert result.verifier == other.address
        assert KILL_AT <= move.at_token < MAX_TOKENS and "UNAVAILABLE" in move.reason
        assert result.spec_enabled == (mode == "spec")
        assert moves.labels(verifier=victim.address)._value.get() == before[victim.address] + 1
        if mode == "spec":
            assert result.stats.tries > 0 and result.stats.acceptance_rate > 0.9, result.stats
        print(f"\n{mode}: SIGKILL at token {KILL_AT}: next token after {gap * 1e3:.0f} ms, "
              f"moved at token {move.at_token}, resume {move.resume_ms:.0f} ms (prefill "
              f"{move.prefill_ms:.0f} ms, {move.cached_prompt_tokens} cached)")
        assert gap < 3.0
    finally:
        victim.restart()
        coord.wait_healthy([b.address for b in boards])


def test_stopped_verifier_misses_its_deadline_and_the_generation_moves(coord, boards):
    ref = coord.stub.Complete(cpb.CompleteRequest(text=PROMPT, max_tokens=MAX_TOKENS), timeout=120).result
    t0 = time.monotonic()
    text, ids, result, gap, victim = _interrupted(coord, boards, _request("plain"),
                                                          signal.SIGSTOP)
    try:
        assert result is not None and text == ref.text and ids == list(ref.token_ids)
        [move] = result.moves
        assert move.from_verifier == victim.address and "progress deadline" in move.reason
        # the bound: the deadline the move names (the 1 s floor while the verifier's own reported
        # rounds are fast; 8 times the slowest recent one when slower, as on a busy machine)
        # plus 2 s for the other verifier's prefill of prompt + 20 tokens
        deadline = float(re.search(r"progress deadline of ([0-9.]+) s", move.reason).group(1))
        print(f"\nSIGSTOP at token {KILL_AT}: next token after {gap * 1e3:.0f} ms (deadline "
              f"{deadline:.2f} s), whole generation {time.monotonic() - t0:.1f} s, resume "
              f"{move.resume_ms:.0f} ms")
        assert STALL_FLOOR_S <= deadline and gap < deadline + 2.0
        # cancelled for the generation and unhealthy until its health check passes again
        assert not coord.info()[victim.address].healthy
        os.kill(victim.verifier.pid, signal.SIGCONT)
        coord.wait_healthy([victim.address])
    finally:
        os.kill(victim.verifier.pid, signal.SIGCONT)


def test_a_lone_verifier_is_waited_for_past_the_floor(smollm2_path, boards):
    # nowhere to move: a verifier frozen for longer than the floor is not cancelled, and the
    # generation completes once it runs again
    lone = Coordinator(smollm2_path, boards[:1])
    try:
        n, stopped = 0, False
        for msg in lone.stub.Generate(cpb.GenerateRequest(text=PROMPT, max_tokens=48), timeout=60):
            if msg.HasField("result"):
                result = msg.result
                break
            n += len(msg.token_ids)
            if n >= KILL_AT and not stopped:
                stopped = True
                os.kill(boards[0].verifier.pid, signal.SIGSTOP)
                time.sleep(STALL_FLOOR_S + 1.0)
                os.kill(boards[0].verifier.pid, signal.SIGCONT)
        assert stopped and result.completion_tokens == 48 and not result.moves
        assert result.verifier == boards[0].address
    finally:
        os.kill(boards[0].verifier.pid, signal.SIGCONT)
        lone.close()


def test_a_frozen_verifier_with_nowhere_to_go_is_left_once_another_is_back(coord, boards):
    # B is down, so the generation runs on A and A freezes with nowhere to go: it is waited
    # for, not cancelled. B comes back: the next look at A's missed deadline moves the
    # generation there (was: it stayed on the frozen A until gRPC's keepalive, about 61 s)
    a, b = boards
    ref = coord.stub.Complete(cpb.CompleteRequest(text=PROMPT, max_tokens=MAX_TOKENS), timeout=120).result
    os.kill(b.verifier.pid, signal.SIGKILL)
    b.verifier.wait(10)
    deadline = time.monotonic() + 30
    while coord.info()[b.address].healthy:
        assert time.monotonic() < deadline, "the coordinator did not see B go"
        time.sleep(0.05)
    text, ids, result, t_back = [], [], None, None
    try:
        for msg in coord.stub.Generate(_request("plain"), timeout=120):
            if msg.HasField("result"):
                result = msg.result
                break
            if t_back is not None and msg.token_ids and gap is None:
                gap = time.monotonic() - t_back
            text.append(msg.text)
            ids.extend(msg.token_ids)
            if t_back is None and len(ids) >= KILL_AT:
                os.kill(a.verifier.pid, signal.SIGSTOP)
                time.sleep(STALL_FLOOR_S + 0.5)   # past the floor: still waited for
                b.start_verifier()
                b.wait()
                coord.wait_healthy([b.address])
                t_back, gap = time.monotonic(), None
        assert result is not None and "".join(text) == ref.text and ids == list(ref.token_ids)
        [move] = result.moves
        assert (move.from_verifier, move.to_verifier) == (a.address, b.address), move
        assert "progress deadline" in move.reason, move.reason
        deadline_s = float(re.search(r"progress deadline of ([0-9.]+) s", move.reason).group(1))
        print(f"\nB back: next token after {gap * 1e3:.0f} ms (deadline {deadline_s:.2f} s)")
        assert gap < 2 * deadline_s + 5.0
    finally:
        os.kill(a.verifier.pid, signal.SIGCONT)
        if b.verifier.poll() is not None:
            b.restart()
        coord.wait_healthy([x.address for x in boards])


def test_busy_verifiers_under_honest_load_are_not_flagged(coord, boards):
    # 4 generations per verifier (batch_max 1: each waits for the others' steps, long prompts
    # prefilled in chunks meanwhile) on 2 shared cores: rounds far slower than alone, and the
    # deadlines, built from each verifier's own reported costs, grow with them
    from concurrent.futures import ThreadPoolExecutor
    prompts = [PROMPT.replace("her cat", f"her {n} cats") + "word " * 300 for n in range(8)]

    def one(p):
        return coord.stub.Complete(cpb.CompleteRequest(text=p, max_tokens=24), timeout=120).result
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(one, prompts))
    assert {r.verifier for r in rs} == {b.address for b in boards}
    assert all(r.completion_tokens == 24 and not r.moves for r in rs), [list(r.moves) for r in rs]
    assert all(v.healthy and not v.last_error for v in coord.info().values())


def test_no_verifier_left_ends_with_unavailable_naming_the_moves(coord, boards):
    text, ids, first, second = [], [], None, None
    with pytest.raises(grpc.RpcError) as ei:
        for msg in coord.stub.Generate(_request("plain"), timeout=120):
            ids.extend(msg.token_ids)
            if first is None and len(ids) >= KILL_AT:
                first = _serving(coord, boards)
                os.kill(first.verifier.pid, signal.SIGKILL)
            elif first is not None and second is None and len(ids) >= 2 * KILL_AT:
                second = _serving(coord, boards)
                os.kill(second.verifier.pid, signal.SIGKILL)
    try:
        assert first is not None and second is not None and second is not first
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        d = ei.value.details()
        assert f"verifier {second.address} failed after" in d and "no verifier left" in d, d
        assert f"moves: {first.address} -> {second.address} at token" in d, d
    finally:
        for b in boards:
            b.restart()
        coord.wait_healthy([b.address for b in boards])


def test_a_restarted_verifier_takes_back_the_generation_that_left_it(coord, boards):
    # the generation leaves A (killed) for B; A restarts and its health returns; B is killed:
    # the generation goes back to A instead of ending with "no verifier left". It must outlast A's
    # restart (about 1 s) on B: 900 tokens (was 200, which a fast host finished on B first)
    n = 900
    ref = coord.stub.Complete(cpb.CompleteRequest(text=PROMPT, max_tokens=n), timeout=120).result
    assert len(ref.token_ids) == n
    text, ids, first, second = [], [], None, None
    try:
        for msg in coord.stub.Generate(_request("plain", max_tokens=n), timeout=120):
            if msg.HasField("result"):
                result = msg.result
                break
            text.append(msg.text)
            ids.extend(msg.token_ids)
            if first is None and len(ids) >= KILL_AT:
                first = _serving(coord, boards)
                os.kill(first.verifier.pid, signal.SIGKILL)
                first.verifier.wait(10)
                first.start_verifier()
            elif first is not None and second is None and len(ids) >= 2 * KILL_AT:
                first.wait()
                coord.wait_healthy([first.address])
                second = _serving(coord, boards)
                os.kill(second.verifier.pid, signal.SIGKILL)
        assert second is not None and second is not first
        assert "".join(text) == ref.text and ids == list(ref.token_ids)
        assert [(m.from_verifier, m.to_verifier) for m in result.moves] == \
            [(first.address, second.address), (second.address, first.address)]
        assert result.verifier == first.address
    finally:
        for b in boards:
            if b.verifier.poll() is not None:
                b.restart()
        coord.wait_healthy([b.address for b in boards])


def test_the_move_cap_ends_a_generation_with_unavailable_naming_it(smollm2_path, boards):
    capped = Coordinator(smollm2_path, boards, max_moves=0)
    victim = None
    try:
        ids = []
        with pytest.raises(grpc.RpcError) as ei:
            for msg in capped.stub.Generate(_request("plain"), timeout=120):
                ids.extend(msg.token_ids)
                if victim is None and len(ids) >= KILL_AT:
                    victim = _serving(capped, boards)
                    os.kill(victim.verifier.pid, signal.SIGKILL)
        assert victim is not None and ei.value.code() == grpc.StatusCode.UNAVAILABLE
        d = ei.value.details()
        assert f"verifier {victim.address} failed after" in d, d
        assert "the generation cannot move on: 0 move(s) tried of at most 0 per generation (no move made)" in d, d
    finally:
        if victim is not None:
            victim.restart()
        capped.close()
