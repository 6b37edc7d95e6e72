"""The three services end to end on a tiny random GGUF model (tests/ggufgen.py).

The stack runs in this process (three gRPC servers on loopback ports). The
tiny model tends to repeat its last token, so drafts are accepted often and
runs of accepted drafts are long: good material for cut-offs inside a run.
"""
from __future__ import annotations

import gc
import random
import re
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.v1 import (common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, verifier_pb2 as vpb,
                         verifier_pb2_grpc)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from echospec.services.common.economics import gain_condition
from echospec.stack import start_stack

OFF, ON = common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON
N_VOCAB = 320
N_CTX = 256
MAX_MSG = 1 << 20


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_model(path, arch="llama", n_vocab=N_VOCAB, n_ctx_train=512, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def stack(tiny_model):
    st = start_stack(tiny_model, spec=False, n_ctx=N_CTX, n_threads=1, k=4,
                     max_message_bytes=MAX_MSG)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def stub(stack):
    ch = grpc.insecure_channel(stack.target)
    yield coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def vstub(stack):
    ch = grpc.insecure_channel(stack.verifier_target)
    yield verifier_pb2_grpc.VerifierServiceStub(ch)
    ch.close()


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=60).result


def stream(stub, **kw) -> tuple[list[cpb.GenerateResponse], cpb.GenerationResult]:
    msgs = list(stub.Generate(cpb.GenerateRequest(**kw), timeout=60))
    assert msgs[-1].HasField("result")
    assert not any(m.HasField("result") for m in msgs[:-1])
    return msgs[:-1], msgs[-1].result


def random_prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, N_VOCAB) for _ in range(rng.randrange(2, 24))] for _ in range(n)]


def produced_tokens(r: cpb.GenerationResult) -> int:
    """Tokens the verifier produced: the prefill's one, then R + 1 per round."""
    return 1 + r.stats.rounds + r.stats.hits


def assert_same_output(a: cpb.GenerationResult, b: cpb.GenerationResult) -> None:
    assert list(a.token_ids) == list(b.token_ids)
    assert a.text.encode() == b.text.encode()
    assert a.finish_reason == b.finish_reason


def assert_counter_algebra(r: cpb.GenerationResult, k: int) -> None:
    s = r.stats
    assert s.hits + s.kv_rolls == s.draft_tokens <= s.tries * k
    assert s.tries <= s.rounds
    if s.draft_tokens:
        assert s.acceptance_rate == pytest.approx(s.hits / s.draft_tokens)
        assert s.mean_acceptance_length == pytest.approx(1 + s.hits / s.tries)


# -- the contract: byte-identical output with speculation on and off -------------------------

def test_spec_on_off_identical_on_random_prompts(stub):
    total_hits = 0
    for prompt in random_prompts(16):
        off = complete(stub, token_ids=prompt, max_tokens=40, spec=OFF)
        on = complete(stub, token_ids=prompt, max_tokens=40, spec=ON)
        assert_same_output(off, on)
        assert not off.spec_enabled and off.stats.tries == 0
        assert on.spec_enabled and on.spec_reason == ""
        assert_counter_algebra(on, 4)
        total_hits += on.stats.hits
    assert total_hits > 0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_repetitive_text_prompt_accepts_drafts(stub, k):
    text = "the cat sat on the mat. " * 6
    off = complete(stub, text=text, max_tokens=64, spec=OFF)
    on = complete(stub, text=text, max_tokens=64, spec=ON, k=k)
    assert_same_output(off, on)
    assert on.stats.hits > 0
    assert_counter_algebra(on, k)
    st = on.stats
    # every round crosses gRPC to the verifier: the coordinator's wall time exceeds V
    assert st.t_ms > 0 and st.v_ms > 0 and st.overhead_ms > 0
    assert st.overhead_share == pytest.approx(st.overhead_ms / st.t_ms)
    # the verdict is the shared formula over the reported means, and its text says the same
    ok, lhs, rhs = gain_condition(st.mean_accepted_per_round, st.v_ms, st.overhead_ms, st.t_ms)
    assert st.gain == ok
    assert st.gain_verdict.endswith(": gain" if ok else ": no gain"), st.gain_verdict
    assert f"= {lhs:.3f} ms" in st.gain_verdict and f"= {rhs:.3f} ms" in st.gain_verdict


def test_streamed_deltas_add_up_to_the_result(stub):
    for spec in (OFF, ON):
        msgs, res = stream(stub, text="the cat the cat the cat", max_tokens=50, spec=spec)
        assert "".join(m.text for m in msgs) == res.text
        assert [t for m in msgs for t in m.token_ids] == list(res.token_ids)
        assert res.completion_tokens == len(res.token_ids)


def test_max_tokens_inside_an_accepted_run(stub):
    prompt = random_prompts(1, seed=7)[0]
    cut_inside = 0
    for mt in range(1, 33):
        off = complete(stub, token_ids=prompt, max_tokens=mt, spec=OFF)
        on = complete(stub, token_ids=prompt, max_tokens=mt, spec=ON)
        assert_same_output(off, on)
        if on.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            assert len(on.token_ids) == mt
        # drafts never run past max_tokens: the verifier produced no token beyond it
        assert produced_tokens(on) <= mt + 1 or on.finish_reason != common_pb2.FINISH_REASON_LENGTH
        cut_inside += on.stats.hits > 0 and on.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert cut_inside > 0


def test_stop_string_inside_an_accepted_run(stub):
    # stop strings whose first occurrence ends in the middle of a message of >= 3 tokens; a message
    # may carry several rounds (the verifier's loop sends what finished since the last one), so a
    # stop can end on a round boundary: up to 4 candidates, at least one must cut a round
    text = "the cat sat on the mat. " * 6
    msgs, full = stream(stub, text=text, max_tokens=64, spec=ON)
    stops, before = [], 0
    for m in msgs:
        if len(m.token_ids) >= 3 and len(m.text) >= 2 and len(stops) < 4:
            pos = before + len(m.text) // 2
            for width in range(1, pos + 1):
                cand = full.text[pos - width:pos]
                if full.text.find(cand) == pos - width:
                    stops.append(cand)
                    break
        before += len(m.text)
    assert stops, "no message of >= 3 tokens with text (the precondition of this test)"
    cut_inside = 0
    for stop in stops:
        off = complete(stub, text=text, max_tokens=64, spec=OFF, stop=[stop])
        on_msgs, on = stream(stub, text=text, max_tokens=64, spec=ON, stop=[stop])
        assert_same_output(off, on)
        assert on.finish_reason == common_pb2.FINISH_REASON_STOP
        assert on.text == full.text[: full.text.index(stop)]
        assert stop not in "".join(m.text for m in on_msgs)
        assert produced_tokens(on) >= len(on.token_ids)
        # the stop fell inside a round: its later tokens were produced but never sent
        cut_inside += produced_tokens(on) > len(on.token_ids)
    assert cut_inside > 0, stops


def test_eight_concurrent_clients_equal_eight_sequential(stub):
    jobs = [dict(token_ids=p, max_tokens=32, spec=ON if i % 2 else OFF)
            for i, p in enumerate(random_prompts(8, seed=3))]
    sequential = [complete(stub, **j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda j: complete(stub, **j), jobs))
    for a, b in zip(sequential, concurrent):
        assert_same_output(a, b)


def test_sampling_path_is_seeded_and_refuses_speculation(stub):
    kw = dict(text="the cat", max_tokens=24, temperature=0.9, top_k=40, seed=1234, spec=ON)
    a, b = complete(stub, **kw), complete(stub, **kw)
    assert list(a.token_ids) == list(b.token_ids)
    assert not a.spec_enabled and "temperature" in a.spec_reason and a.stats.tries == 0
    greedy = complete(stub, text="the cat", max_tokens=24)
    other_seed = complete(stub, **{**kw, "seed": 99})
    assert list(greedy.token_ids) != list(a.token_ids) or list(other_seed.token_ids) != list(a.token_ids)


def test_server_flag_turns_speculation_on_for_unspecified_requests(tiny_model):
    st = start_stack(tiny_model, spec=True, n_ctx=N_CTX, n_threads=1)
    try:
        with grpc.insecure_channel(st.target) as ch:
            s = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            r = complete(s, text="the cat the cat", max_tokens=24)
            assert r.spec_enabled and r.spec_reason == "" and r.stats.tries > 0
            off = complete(s, text="the cat the cat", max_tokens=24, spec=OFF)
            assert not off.spec_enabled and "by request" in off.spec_reason
            assert_same_output(r, off)
    finally:
        st.stop()


def test_an_in_process_verifier_runs_its_draft_streams_in_process(stub, stack, monkeypatch):
    """One process: the verifier's draft link calls the draft service's ProposeStream directly
    (inproc.LocalDraftStub), not over loopback gRPC; the output is that of plain decoding."""
    from echospec.services.rpc import inproc

    made = []
    real = inproc.LocalCall.__init__

    def counting(self, servicer, handle, request, timeout, method=inproc.GENERATE_TOKENS, *a, **kw):
        made.append(method)
        real(self, servicer, handle, request, timeout, method, *a, **kw)

    monkeypatch.setattr(inproc.LocalCall, "__init__", counting)
    text = "the cat sat on the mat. " * 4
    on = complete(stub, text=text, max_tokens=40, spec=ON)
    off = complete(stub, text=text, max_tokens=40, spec=OFF)
    assert_same_output(on, off)
    assert on.stats.tries > 0 and on.stats.hits > 0
    assert made.count(inproc.PROPOSE_STREAM) == 1, made
    assert inproc.local(stack.draft_target) is not None


# -- the draft service going away --------------------------------------------------------------

def test_killing_the_draft_service_mid_run_changes_no_output(tiny_model):
    # three processes, as deployed; the draft process gets SIGKILL mid-stream
    st = start_stack(tiny_model, spec=True, n_ctx=N_CTX, n_threads=1, processes=True)
    try:
        with grpc.insecure_channel(st.target) as ch:
            s = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            text = "the cat sat on the mat. " * 4
            ref = complete(s, text=text, max_tokens=120, spec=OFF)
            it = s.Generate(cpb.GenerateRequest(text=text, max_tokens=120, spec=ON), timeout=60)
            first = next(it)
            st.kill_draft()
            rest = list(it)
            res = rest[-1].result
            assert first.text + "".join(m.text for m in rest[:-1]) == res.text
            assert_same_output(ref, res)
            assert res.spec_enabled
            # later requests find no draft service: plain decoding, same output, a reason
            again = complete(s, text=text, max_tokens=120, spec=ON)
            assert_same_output(ref, again)
            assert "draft service" in again.spec_reason
    finally:
        st.stop()


def _verifier_beside(tiny_model, draft_servicer, timeout: float):
    """A verifier whose draft target is a gRPC server of ``draft_servicer``; GenerateTokens of one
    prompt with speculation off then on (``timeout`` each): [(tokens, spec reasons)] per run."""
    from echospec.v1 import draft_pb2_grpc
    from echospec.services.common.config import VerifierConfig
    from echospec.services.rpc import grpc_util
    from echospec.services.verifier import server as vserver

    h = grpc_util.build_server("127.0.0.1", 0, 4, 1 << 20, ["echospec.v1.DraftService"])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(draft_servicer, h.server)
    h.server.start()
    v = vserver.start(VerifierConfig(model=tiny_model, n_ctx=N_CTX, n_threads=1, port=0,
                                     draft_target=f"127.0.0.1:{h.port}"))
    out = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{v.port}") as ch:
            vs = verifier_pb2_grpc.VerifierServiceStub(ch)
            for spec in (False, True):
                toks, why = [], []
                for m in vs.GenerateTokens(vpb.GenerateTokensRequest(
                        prompt=[5, 6, 7, 7, 7, 7], max_tokens=30, spec=spec, k=4), timeout=timeout):
                    toks += [t for r in m.rounds for t in r.result.tokens]
                    why += [m.spec_reason] if m.spec_reason else []
                out.append((toks, why))
    finally:
        v.stop(0)
        h.server.stop(0).wait()
    return out


def test_a_draft_service_proposing_ids_outside_the_vocabulary_ends_speculation_not_the_generation(
        tiny_model):
    # e.g. another model's ids, through a draft namespace shared with a verifier of that model:
    # the verifier decodes on plainly (same output, a reason), no INVALID_ARGUMENT for the request
    from echospec.v1 import draft_pb2, draft_pb2_grpc

    class Foreign(draft_pb2_grpc.DraftServiceServicer):
        def ProposeStream(self, request_iterator, context):
            for req in request_iterator:
                if req.k:
                    yield draft_pb2.ProposeStreamResponse(draft=[7, N_VOCAB + 1000, 7])

    (plain, _), (toks, why) = _verifier_beside(tiny_model, Foreign(), 30)
    assert toks == plain
    assert why == [f"draft service proposed token {N_VOCAB + 1000}, outside the vocabulary "
                   f"[0, {N_VOCAB}); decoded plainly from here on"]


def test_a_draft_service_refusing_a_long_session_ends_speculation_with_its_reason(tiny_model):
    # the draft service's max_history passed mid-generation: the verifier decodes on plainly (same
    # output) and says the session was refused, not that the service is unreachable
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft.servicer import DraftServicer

    (plain, _), (toks, why) = _verifier_beside(tiny_model, DraftServicer(DraftConfig(max_history=12)), 30)
    assert toks == plain
    assert len(why) == 1 and why[0].startswith("draft service refused the session (RESOURCE_EXHAUSTED: "), why
    assert "max_history 12" in why[0] and why[0].endswith("decoded plainly from here on"), why


def test_a_stuck_draft_service_leaves_a_short_deadline_to_plain_decoding(tiny_model):
    # a draft service that takes the stream and never answers: a request with a deadline shorter
    # than the reply timeout waits at most half of it for a proposal, then decodes plainly,
    # instead of ending with DEADLINE_EXCEEDED where speculation off would have finished
    from echospec.v1 import draft_pb2_grpc

    class Silent(draft_pb2_grpc.DraftServiceServicer):
        def ProposeStream(self, request_iterator, context):
            for _ in request_iterator:
                pass
            return
            yield   # a generator: the stream's responses (none)

    (plain, _), (toks, why) = _verifier_beside(tiny_model, Silent(), 3)
    assert toks == plain
    assert len(why) == 1, why
    waited = re.fullmatch(r"draft service did not answer within ([0-9.]+) s; decoded plainly "
                          r"from here on", why[0])
    assert waited and 0 < float(waited.group(1)) <= 1.5, why   # half of the 3 s left at most



def test_a_finished_generation_leaves_its_whole_output_to_the_draft_namespace(tiny_model):
    """The end of a GenerateTokens call does not cut its draft stream short: the draft service
    still reads the output the verifier sent last, so the namespace keeps prompt + output (a
    cancel at the RPC's end had dropped the last messages of some streams over gRPC)."""
    from echospec.v1 import draft_pb2_grpc
    from echospec.services.common.config import DraftConfig, VerifierConfig
    from echospec.services.draft.servicer import DraftServicer
    from echospec.services.rpc import grpc_util
    from echospec.services.verifier import server as vserver

    draft = DraftServicer(DraftConfig())
    h = grpc_util.build_server("127.0.0.1", 0, 8, 1 << 20, ["echospec.v1.DraftService"])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, h.server)
    h.server.start()
    v = vserver.start(VerifierConfig(model=tiny_model, n_ctx=N_CTX, n_threads=1, port=0,
                                     draft_target=f"127.0.0.1:{h.port}"))
    rng = random.Random(3)
    want = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{v.port}") as ch:
            vs = verifier_pb2_grpc.VerifierServiceStub(ch)
            for i in range(40):
                prompt = [rng.randrange(3, N_VOCAB) for _ in range(6)] * 3
                n = 0
                for m in vs.GenerateTokens(vpb.GenerateTokensRequest(
                        prompt=prompt, max_tokens=rng.randrange(2, 24), spec=True, k=4,
                        draft_namespace=f"ns{i % 8}"), timeout=30):
                    n += sum(len(r.result.tokens) for r in m.rounds)
                want[f"ns{i % 8}"] = want.get(f"ns{i % 8}", 0) + len(prompt) + n
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(draft.memory.n_tokens(ns) != k for ns, k in want.items()):
            time.sleep(0.05)
        got = {ns: draft.memory.n_tokens(ns) for ns in want}
        assert got == want
    finally:
        v.stop(0)
        h.server.stop(0).wait()

# -- bad input ----------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("no prompt", dict(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ("two prompt forms", dict(text="a", token_ids=[5]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ("token id above vocab", dict(token_ids=[5, N_VOCAB]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("negative token id", dict(token_ids=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("negative k", dict(text="a", k=-1), grpc.StatusCode.INVALID_ARGUMENT, "k must be"),
    ("k above the limit", dict(text="a", k=33), grpc.StatusCode.INVALID_ARGUMENT, "k must be"),
    ("negative max_tokens", dict(text="a", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("empty stop string", dict(text="a", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop[0]"),
    ("top_p above 1", dict(text="a", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("prompt longer than the context", dict(token_ids=[7] * (N_CTX + 10)),
     grpc.StatusCode.INVALID_ARGUMENT, "does not fit the context"),
    ("malformed chat message", dict(messages=[cpb.ChatMessage(role="robot", content="hi")]),
     grpc.StatusCode.INVALID_ARGUMENT, "role"),
    ("oversized message", dict(text="x" * (MAX_MSG + 10)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
]


@pytest.mark.parametrize("name,kw,code,fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_a_status_and_the_service_stays_up(stub, stack, name, kw, code, fragment):
    for call in (lambda: stub.Complete(cpb.CompleteRequest(**kw), timeout=30),
                 lambda: list(stub.Generate(cpb.GenerateRequest(**kw), timeout=30))):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == code, ei.value.details()
        assert fragment in ei.value.details()
    ok = complete(stub, text="the cat", max_tokens=4)
    assert len(ok.token_ids) == 4


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for r in m.rounds for t in r.result.tokens]


def test_verifier_errors_leave_a_running_generation_unaffected(vstub):
    prompt = [11, 12, 13, 14]

    def req(**kw) -> vpb.GenerateTokensRequest:
        return vpb.GenerateTokensRequest(**{"prompt": prompt, "max_tokens": 7, **kw})

    expected = _tokens(vstub.GenerateTokens(req(), timeout=30))
    running = vstub.GenerateTokens(req(), timeout=30)
    got = _tokens([next(running)])
    for kw, code in [
        (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt=[N_VOCAB + 5]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt=[3] * N_CTX), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(spec=True, k=33), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(spec=True, k=2, prediction=[1, -4]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(spec=True, k=2, sampling=common_pb2.SamplingParams(temperature=0.5)),
         grpc.StatusCode.FAILED_PRECONDITION),
    ]:
        with pytest.raises(grpc.RpcError) as ei:
            list(vstub.GenerateTokens(req(**kw), timeout=30))
        assert ei.value.code() == code, ei.value.details()
    got += _tokens(running)
    assert got == expected


def test_rounds_accept_the_greedy_prefix_and_count(vstub):
    """A prediction right for three output tokens, then wrong: every round's tokens are its
    accepted drafts then the bonus token, its counters say so, the KV holds everything but the
    last token, and the output is the plain one."""
    prompt = [21, 22, 23]
    plain = _tokens(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=prompt, max_tokens=6),
                                         timeout=30))
    wrong = (plain[3] + 1) % N_VOCAB
    msgs = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(
        prompt=prompt, max_tokens=6, spec=True, k=3, fixed_k=True,
        prediction=plain[:3] + [wrong] + plain[4:]), timeout=30))
    rounds = [r.result for m in msgs for r in m.rounds]
    assert _tokens(msgs) == plain
    produced = 0
    for r in rounds:
        assert (r.tries, r.hits, r.kv_rolls) == (1 if r.k else 0, r.accepted, r.k - r.accepted)
        assert list(r.tokens) == plain[produced:produced + r.accepted + 1]
        produced += len(r.tokens)
        assert r.n_past == len(prompt) + produced - 1   # the last token is not in the KV yet
    assert rounds[0].k == 0 and len(rounds[0].tokens) == 1   # the prefill
    assert any(0 < r.accepted < r.k for r in rounds), [(r.k, r.accepted) for r in rounds]


def test_rounds_say_where_their_time_went(vstub, stub):
    """A speculative round's RoundCost: its parts are set, >= 0 and within the round's wall time
    beside V (the rollback inside the accept step, and > 0 on a round that rolled back); the
    prefill carries none. The generation's SpecStats.round_cost holds the means per round and
    adds up to the wall time per round the overhead is taken from."""
    prompt = [21, 22, 23]
    plain = _tokens(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=prompt, max_tokens=12),
                                         timeout=30))
    wrong = (plain[3] + 1) % N_VOCAB
    msgs = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(
        prompt=prompt, max_tokens=12, spec=True, k=3, fixed_k=True,
        prediction=plain[:3] + [wrong] + plain[4:]), timeout=30))
    rounds = [r for m in msgs for r in m.rounds]
    assert _tokens(msgs) == plain
    assert not rounds[0].result.HasField("cost")             # the prefill
    assert all(r.result.HasField("cost") for r in rounds[1:])
    for r in rounds[1:]:
        c, v = r.result.cost, r.result.v_ms
        for part in (c.draft_ms, c.sched_ms, c.accept_ms, c.rollback_ms):
            assert part >= 0
        assert c.rollback_ms <= c.accept_ms
        assert v + c.draft_ms + c.sched_ms + c.accept_ms <= r.wall_ms + 1e-6
        assert c.wall_ms == c.v_ms == c.rest_ms == 0      # SpecStats' only
    assert any(r.result.cost.draft_ms > 0 for r in rounds[1:])
    rolled = [r.result.cost for r in rounds[1:] if r.result.accepted < r.result.k]
    assert rolled and all(c.rollback_ms > 0 for c in rolled)

    text = "the cat sat on the mat. " * 6
    for spec in (OFF, ON):
        st = complete(stub, text=text, max_tokens=48, spec=spec, k=4).stats
        rc = st.round_cost
        assert st.rounds > 0
        assert rc.wall_ms == pytest.approx(st.v_ms + st.overhead_ms, rel=1e-6, abs=1e-6)
        assert rc.v_ms == pytest.approx(st.v_ms)
        parts = (rc.v_ms, rc.draft_ms, rc.sched_ms, rc.accept_ms, rc.rest_ms)
        assert all(p >= 0 for p in parts) and rc.rollback_ms <= rc.accept_ms
        assert sum(parts) == pytest.approx(rc.wall_ms, rel=1e-6, abs=1e-6)
        if spec == OFF:   # plain rounds: no draft link, no accept step timed
            assert rc.draft_ms == rc.accept_ms == rc.sched_ms == 0
        else:
            assert rc.draft_ms > 0 and rc.accept_ms > 0


# -- cancellation, deadlines, health, reflection ------------------------------------------------

def active_sessions(vstub) -> int:
    return vstub.GetConfig(vpb.GetConfigRequest()).active_sessions


def wait_sessions(vstub, n: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = active_sessions(vstub)
        if got == n:
            return got
        time.sleep(0.02)
    return active_sessions(vstub)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_cancelled_streams_free_their_sessions(stub, vstub):
    assert wait_sessions(vstub, 0) == 0

    def cancel_one(spec):
        it = stub.Generate(cpb.GenerateRequest(text="the cat sat", max_tokens=200, spec=spec), timeout=30)
        next(it)
        it.cancel()

    for i in range(20):
        cancel_one(ON if i % 2 else OFF)
    assert wait_sessions(vstub, 0) == 0
    gc.collect()
    base = rss_kib()
    for i in range(200):
        cancel_one(ON if i % 2 else OFF)
    assert wait_sessions(vstub, 0) == 0
    gc.collect()
    grown = rss_kib() - base
    assert grown < 64 * 1024, f"RSS grew by {grown} KiB over 200 cancelled streams"


def test_deadline_frees_the_session(stub, vstub):
    with pytest.raises(grpc.RpcError) as ei:
        # spec off: 250 tokens through the verifier's loop and two streams outlast 5 ms (20 ms
        # did not always: the loop runs beside the engine, no round trip per token)
        for _ in stub.Generate(cpb.GenerateRequest(text="the cat", max_tokens=250, spec=OFF), timeout=0.005):
            pass
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_sessions(vstub, 0) == 0


def test_health_serving_and_reflection(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
        ProtoReflectionDescriptorDatabase
    for target, service in ((stack.target, "echospec.v1.CoordinatorService"),
                            (stack.verifier_target, "echospec.v1.VerifierService"),
                            (stack.draft_target, "echospec.v1.DraftService")):
        with grpc.insecure_channel(target) as ch:
            h = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                    health_pb2.HealthCheckResponse.SERVING
            db = ProtoReflectionDescriptorDatabase(ch)
            assert service in db.get_services()
            assert db.FindFileContainingSymbol(service).name.startswith("echospec/v1/")


def test_tokenize_detokenize_round_trip(stub):
    ids = list(stub.Tokenize(cpb.TokenizeRequest(text="the cat sat")).token_ids)
    assert ids and all(0 <= i < N_VOCAB for i in ids)
    assert stub.Detokenize(cpb.DetokenizeRequest(token_ids=ids)).text == "the cat sat"
    with pytest.raises(grpc.RpcError) as ei:
        stub.Detokenize(cpb.DetokenizeRequest(token_ids=[N_VOCAB]))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenize_and_detokenize_refuse_more_than_the_context_holds(stub, stack):
    # was: Tokenize took any text up to gRPC's message limit (4 MB took 9 s of CPU with the GIL
    # held), unlike Complete's prompt text; Detokenize any number of ids
    most = N_CTX * stack._servers["coordinator"].servicer.max_token_bytes
    text = "ab " * (most // 3 + 1)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Tokenize(cpb.TokenizeRequest(text=text), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert ei.value.details().startswith(
        f"text of {len(text)} bytes cannot fit the context of {N_CTX} tokens (at most {most} "
        f"bytes: "), ei.value.details()
    assert stub.Tokenize(cpb.TokenizeRequest(text="ab " * 20), timeout=60).token_ids
    with pytest.raises(grpc.RpcError) as ei:
        stub.Detokenize(cpb.DetokenizeRequest(token_ids=[5] * (N_CTX + 1)), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert ei.value.details() == (f"token_ids of {N_CTX + 1} tokens cannot fit the context of "
                                  f"{N_CTX} tokens (at most {N_CTX} ids)")
    assert stub.Detokenize(cpb.DetokenizeRequest(token_ids=[5] * N_CTX), timeout=60).text


def test_unusable_model_is_a_clear_error(tmp_path):
    from echospec.stack import StackError
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 8)
    with pytest.raises(StackError, match="verifier: ES_ERR_"):
        start_stack(str(bad), n_ctx=N_CTX)


def test_port_taken_is_a_clear_error(tiny_model, stack):
    from echospec.stack import StackError
    with pytest.raises(StackError, match="cannot bind"):
        start_stack(tiny_model, draft_port=stack.draft_port, n_ctx=N_CTX)


@pytest.mark.parametrize("bad,fragment", [
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": float("inf")}, "temperature must be finite"),
    ({"min_p": float("nan")}, "min_p must be finite"),
    ({"top_p": float("nan")}, "top_p must be finite"),
    ({"top_k": -1}, "top_k must be >= 0"),
])
def test_verifier_refuses_sampling_the_engine_cannot_run(vstub, bad, fragment):
    """GenerateTokens refuses the sampling settings the engine's sampler would fail on, with
    INVALID_ARGUMENT, before a session is taken."""
    bad_sampling = common_pb2.SamplingParams(**{"temperature": 0.7, **bad})
    before = vstub.GetConfig(vpb.GetConfigRequest()).active_sessions
    with pytest.raises(grpc.RpcError) as ei:
        list(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=[11, 12, 13], max_tokens=2,
                                                            sampling=bad_sampling), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in ei.value.details()
    assert vstub.GetConfig(vpb.GetConfigRequest()).active_sessions == before
    assert _tokens(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=[11, 12, 13], max_tokens=2),
                                        timeout=30))
