"""Logprobs: the pure computation (literal rows), the values against numpy over the engine's own
logits rows (greedy and sampled), speculation on and off bitwise equal with drafts accepted,
a grammar's mask, the gRPC and HTTP fields (the official openai client, plain and streamed,
n > 1) agreeing with each other, and the refusals (INVALID_ARGUMENT / HTTP 400 naming the
field)."""
from __future__ import annotations

import math

import grpc
import numpy as np
import openai
import pytest

from echospec.services.coordinator.generation import token_piece
from echospec.services.gateway import openai_api as api
from echospec.services.verifier.logprobs import log_softmax, token_logprob, top_ids
from echospec.v1 import common_pb2, coordinator_pb2 as cpb

ON, OFF = common_pb2.SPEC_MODE_ON, common_pb2.SPEC_MODE_OFF
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# a prompt whose continuation repeats it: the suffix index drafts it and the drafts are accepted
REPEAT = "one two three four five six seven eight nine ten. " * 3 + "one two"


# -- the computation on literal rows ------------------------------------------------------------

def test_docstring_example_ties_in_id_order():
    lp = token_logprob(np.array([1, 3, 3, 0], np.float32), 2, n_top=2)
    z = math.log(math.e + 2 * math.e ** 3 + 1)
    assert lp.token_id == 2 and lp.logprob == pytest.approx(3 - z, abs=1e-6)
    assert [i for i, _ in lp.top] == [1, 2]
    assert lp.top[0][1] == lp.top[1][1] == lp.logprob


def test_values_are_a_normalized_log_distribution():
    row = np.random.default_rng(1).normal(0, 4, 1000).astype(np.float32)
    lp = log_softmax(row)
    assert lp.dtype == np.float64 and np.all(lp <= 0)
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-6)
    assert list(top_ids(lp, 5)) == list(np.argsort(-lp, kind="stable")[:5])


def test_mask_renormalizes_and_refused_tokens_are_never_alternatives():
    row = np.array([5.0, 1.0, 2.0, 4.0], np.float32)
    allowed = np.array([False, True, True, False])
    lp = token_logprob(row, 2, n_top=4, allowed=allowed)
    assert [i for i, _ in lp.top] == [2, 1]   # two allowed: two alternatives, not four
    assert lp.logprob == pytest.approx(2 - math.log(math.e ** 2 + math.e), abs=1e-6)
    assert math.exp(lp.top[0][1]) + math.exp(lp.top[1][1]) == pytest.approx(1.0, abs=1e-6)


def test_the_value_depends_on_the_row_only():
    # a row read out of a verify's [K + 1, n_vocab] block and the same values on their own
    rng = np.random.default_rng(2)
    block = rng.normal(0, 3, (3, 4099)).astype(np.float32)
    alone = np.array(block[1], copy=True)
    a, b = token_logprob(block[1], 7, 20), token_logprob(alone, 7, 20)
    assert a == b   # the floats compared exactly


def test_zero_alternatives_and_no_allowed_token():
    assert token_logprob(np.zeros(3, np.float32), 0).top == ()
    with pytest.raises(ValueError):
        log_softmax(np.zeros(3, np.float32), np.zeros(3, bool))


class _Bytes:
    def __init__(self, table):
        self.table = table

    def token_bytes(self, i):
        return self.table[i]


def test_token_piece_writes_a_split_character_as_bytes():
    tok = _Bytes({0: "é".encode(), 1: "€".encode()[:2]})
    assert token_piece(tok, 0) == ("é", b"\xc3\xa9")
    assert token_piece(tok, 1) == ("bytes:\\xe2\\x82", b"\xe2\x82")


def test_text_offsets_count_characters_once_whole():
    off = api.TextOffsets()
    assert [off.take(b) for b in (b"ab", b"\xe2\x82", b"\xac", b"c")] == [0, 2, 2, 3]


# -- the verifier's loop on a tiny model -------------------------------------------------------------

def test_the_loop_refuses_bad_values_and_keeps_its_tokens_with_logprobs(tiny_model):
    import threading
    from echospec.services.common.config import VerifierConfig
    from echospec.services.verifier.generation_loop import GenerationRequest, check, run_generation
    from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore
    core = VerifierCore(VerifierConfig(model=tiny_model(arch="llama", n_vocab=320, n_ctx_train=512,
                                                        seed=0), n_ctx=256, n_threads=1))
    try:
        def req(**kw):
            return GenerationRequest(prompt=[3, 17, 42], max_tokens=20, eos_ids=frozenset(),
                                     sampling=Sampling(), **kw)
        for kw, frag in ((dict(logprobs=True, top_logprobs=21), r"top_logprobs must be in \[0, 20\]"),
                         (dict(top_logprobs=2), "needs logprobs")):
            with pytest.raises(InvalidArgument, match=frag):
                check(core, req(**kw))
        plain = list(run_generation(core, req(), threading.Event()))
        evs = list(run_generation(core, req(logprobs=True, top_logprobs=3), threading.Event()))
        # the logits path (no in-engine greedy runs) gives the tokens of the argmax-only path
        assert [t for e in evs for t in e.tokens] == [t for e in plain for t in e.tokens]
        assert all(len(e.logprobs) == len(e.tokens) for e in evs) and all(not e.logprobs for e in plain)
        assert all(lp.token_id == lp.top[0][0] and len(lp.top) == 3 for e in evs for lp in e.logprobs)
    finally:
        core.close()


# -- the services on the default model --------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(smollm2_api):
    return smollm2_api.stack


@pytest.fixture(scope="module")
def stub(smollm2_api):
    return smollm2_api.stub


@pytest.fixture(scope="module")
def client(smollm2_api):
    return smollm2_api.openai


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=120).result


def values(result) -> list:
    """(id, token, bytes, logprob, [(id, token, bytes, logprob)]) per token: exact floats."""
    return [(lp.token_id, lp.token, lp.bytes, lp.logprob,
             [(t.token_id, t.token, t.bytes, t.logprob) for t in lp.top_logprobs])
            for lp in result.logprobs]


def engine_rows(path: str, prompt: list[int], output: list[int]) -> np.ndarray:
    """The engine's logits rows that chose each output token: one forward over prompt + output."""
    from echospec.services.verifier.engine import Model
    with Model(path) as m, m.new_session(n_ctx=1024, n_threads=2) as s:
        _, logits = s.forward(prompt + output[:-1], logits="all")
    return logits[len(prompt) - 1:]


def numpy_log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}])
def test_logprobs_are_log_softmax_of_the_engines_rows(stub, smollm2_path, sampling):
    prompt = [int(t) for t in stub.Tokenize(cpb.TokenizeRequest(text="The capital of France is"),
                                            timeout=60).token_ids]
    r = complete(stub, token_ids=prompt, max_tokens=8, logprobs=True, top_logprobs=5, **sampling)
    assert len(r.logprobs) == len(r.token_ids) == 8
    rows = engine_rows(smollm2_path, prompt, list(r.token_ids))
    for i, (lp, tok) in enumerate(zip(r.logprobs, r.token_ids)):
        ref = numpy_log_softmax(rows[i])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[tok], abs=1e-5), i
        want = np.argsort(-ref, kind="stable")[:5]
        assert [t.token_id for t in lp.top_logprobs] == list(want), i
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(list(ref[want]), abs=1e-5)
        if not sampling:   # greedy: the token is the most likely one
            assert lp.top_logprobs[0].token_id == tok and lp.top_logprobs[0].logprob == lp.logprob


def test_spec_on_and_off_give_bitwise_equal_logprobs(stub):
    off = complete(stub, text=REPEAT, max_tokens=24, spec=OFF, logprobs=True, top_logprobs=3)
    on = complete(stub, text=REPEAT, max_tokens=24, spec=ON, logprobs=True, top_logprobs=3)
    assert on.spec_enabled and on.stats.hits > 0, on.stats
    assert list(on.token_ids) == list(off.token_ids)
    assert values(on) == values(off)
    assert len(on.logprobs) == len(on.token_ids) >= 16
    assert all(len(lp.top_logprobs) == 3 for lp in on.logprobs)


def test_streamed_deltas_carry_their_tokens_logprobs(stub):
    req = cpb.GenerateRequest(text=REPEAT, max_tokens=16, spec=ON, logprobs=True, top_logprobs=2)
    msgs = list(stub.Generate(req, timeout=120))
    result = msgs[-1].result
    streamed = [lp for m in msgs for lp in m.logprobs]
    assert [len(m.logprobs) for m in msgs] == [len(m.token_ids) for m in msgs]
    assert [lp.SerializeToString() for lp in streamed] == \
        [lp.SerializeToString() for lp in result.logprobs]
    assert b"".join(lp.bytes for lp in result.logprobs).decode() == result.text


def test_no_logprobs_unless_asked(stub):
    r = complete(stub, text=REPEAT, max_tokens=4)
    assert len(r.token_ids) == 4 and len(r.logprobs) == 0


def test_grammar_mask_applies_to_the_logprobs(stub):
    g = common_pb2.Grammar(json_object=True)
    free = complete(stub, text="A JSON object: ", max_tokens=12, logprobs=True, top_logprobs=20)
    kw = dict(text="A JSON object: ", max_tokens=12, grammar=g, logprobs=True, top_logprobs=20)
    off, on = complete(stub, spec=OFF, **kw), complete(stub, spec=ON, **kw)
    assert values(on) == values(off) and off.text.startswith("{")
    first = off.logprobs[0]
    # the mask leaves only tokens that can start an object: the chosen token is the most likely
    # one under it, and renormalized it is more likely than in the free row
    assert first.top_logprobs[0].token_id == first.token_id
    assert all(t.token.lstrip().startswith("{") for t in first.top_logprobs)
    if free.logprobs[0].token_id == first.token_id:
        assert first.logprob >= free.logprobs[0].logprob
    else:
        free_first = {t.token_id: t.logprob for t in free.logprobs[0].top_logprobs}
        assert first.logprob > free_first.get(first.token_id, -math.inf)
    for lp in off.logprobs:
        assert sum(math.exp(t.logprob) for t in lp.top_logprobs) <= 1 + 1e-6   # float32 exps


@pytest.mark.parametrize("kw, field", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be in [0, 20], got -1"),
    ({"top_logprobs": 3}, "top_logprobs (3) needs logprobs to be true"),
])
def test_bad_values_are_invalid_argument(stub, kw, field):
    with pytest.raises(grpc.RpcError) as ei:
        complete(stub, text="hi", max_tokens=2, **kw)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()


# -- HTTP with the official openai client ------------------------------------------------------------

def test_chat_logprobs_agree_with_grpc(client, stub):
    msgs = [{"role": "user", "content": "Count from one to five."}]
    g = complete(stub, messages=[cpb.ChatMessage(**m) for m in msgs], max_tokens=10,
                 logprobs=True, top_logprobs=4)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, logprobs=True,
                                       top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob, bytes(c.bytes)) for c in content] == \
        [(lp.token, lp.logprob, lp.bytes) for lp in g.logprobs]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
        [[(t.token, t.logprob) for t in lp.top_logprobs] for lp in g.logprobs]
    # streamed: each chunk its tokens', together the whole answer's
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                            logprobs=True, top_logprobs=4, stream=True)
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in content]
    # not asked: null, as OpenAI
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_agree_with_grpc(client, stub):
    g = complete(stub, text=REPEAT, max_tokens=12, logprobs=True, top_logprobs=2)
    r = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=12, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [x.token for x in g.logprobs]
    assert lp.token_logprobs == [x.logprob for x in g.logprobs]
    # the N most likely and the chosen token, as OpenAI's legacy dicts
    assert lp.top_logprobs == [{**{t.token: t.logprob for t in x.top_logprobs}, x.token: x.logprob}
                               for x in g.logprobs]
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and all(text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    chunks = list(client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=12, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_n_choices_each_carry_their_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, n=2, temperature=1.0, seed=3, logprobs=True,
                                       top_logprobs=1)
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.content) > 0
        assert b"".join(bytes(t.bytes) for t in c.logprobs.content).decode("utf-8", "replace") == \
            c.message.content
    r = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=5, n=2, logprobs=0)
    assert r.choices[0].logprobs.token_logprobs == r.choices[1].logprobs.token_logprobs
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


@pytest.mark.parametrize("route, extra, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
])
def test_bad_http_values_are_400_naming_the_field(client, route, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with pytest.raises(openai.BadRequestError) as ei:
        client.post(f"/{'chat/completions' if route == 'chat' else 'completions'}", body=body,
                    cast_to=object)
    assert ei.value.body["param"] == param


# -- the coordinator: logprobs across a move to another verifier --------------------------------------

class _FakeLink:
    def __init__(self, items):
        self.items = items

    def events(self):
        yield from self.items

    def cancel(self):
        pass


def _msg(tokens, logprobs=True):
    from echospec.v1 import verifier_pb2
    rounds = []
    for t in tokens:
        lps = [common_pb2.TokenLogprob(token_id=t, logprob=-t / 1000.0,
                                       top_logprobs=[common_pb2.TopLogprob(token_id=t + 1, logprob=-1.0)])]
        rounds.append(verifier_pb2.GenerationRound(result=verifier_pb2.StepResult(
            tokens=[t], t_ms=20.0, v_ms=10.0, logprobs=lps if logprobs else [])))
    return verifier_pb2.GenerateTokensResponse(rounds=rounds)


def test_logprobs_follow_their_tokens_across_a_move_and_a_stop(smollm2_path):
    from echospec.services.coordinator.generation import (GenerationError, GenerationParams, Move,
                                                          generate)
    from echospec.services.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm2_path)
    ids = tok.encode("The sea is calm tonight, said the keeper.")
    params = GenerationParams(max_tokens=len(ids), stop=["keeper"], sampling=None, spec=False,
                              spec_reason="", k=1, logprobs=True, top_logprobs=1)
    cut = 4
    items = [_msg(ids[:2]), _msg(ids[2:cut]), Move("a:1", "b:1", cut, "UNAVAILABLE: gone"),
             _msg(ids[cut:cut + 1]), _msg(ids[cut + 1:])]
    evs = list(generate([1, 2, 3], params, tok, _FakeLink(items)))
    out = evs[-1]
    assert out.text == "The sea is calm tonight, said the " and len(out.moves) == 1
    assert [lp.token_id for lp in out.logprobs] == out.token_ids   # up to the stop's token
    assert [lp.logprob for lp in out.logprobs] == [-t / 1000.0 for t in out.token_ids]
    assert [lp.token for lp in out.logprobs] == [tok.token_bytes(t).decode() for t in out.token_ids]
    assert [lp.top_logprobs[0].token for lp in out.logprobs] == \
        [token_piece(tok, t + 1)[0] for t in out.token_ids]
    assert [lp for d in evs[:-1] for lp in d.logprobs] == out.logprobs
    # a verifier that sends no logprobs (a version without them) is a protocol error, not silence
    with pytest.raises(GenerationError, match="0 logprobs for a round of 1 token"):
        list(generate([1, 2, 3], params, tok, _FakeLink([_msg(ids[:2], logprobs=False)])))
