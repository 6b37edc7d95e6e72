"""Draft sources through the services on SmolLM2-135M-Instruct Q4_1: predictions (followed,
resynchronised after an edit, wrong, empty, long, another script), numbered lists on the real
tokenizer, namespace-scoped shared memory; every output byte-identical to speculation off. The
draft service called directly refuses a bad call naming the rule it breaks."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from echospec.v1 import common_pb2, coordinator_pb2 as cpb

ROOT = Path(__file__).resolve().parents[1]
OFF, ON = common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON


def workload(wid: str) -> dict:
    with open(ROOT / "workloads" / "seed.jsonl") as f:
        return next(w for w in map(json.loads, filter(str.strip, f)) if w["id"] == wid)


@pytest.fixture(scope="module")
def stub(smollm2_stub):
    return smollm2_stub


def chat(messages):
    return [cpb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=600).result


def sources(r) -> dict:
    return {s.source: s for s in r.stats.sources}


def on_off(stub, **kw):
    off = complete(stub, spec=OFF, **kw)
    on = complete(stub, spec=ON, **kw)
    assert on.text.encode() == off.text.encode() and list(on.token_ids) == list(off.token_ids)
    assert on.finish_reason == off.finish_reason
    s = on.stats
    assert s.hits + s.kv_rolls == s.draft_tokens
    assert sum(x.draft_tokens for x in s.sources) == s.draft_tokens
    assert sum(x.hits for x in s.sources) == s.hits and sum(x.tries for x in s.sources) == s.tries
    pred = sources(on).get("prediction")
    if pred is None:
        assert s.accepted_prediction_tokens == s.rejected_prediction_tokens == 0
    else:
        assert s.accepted_prediction_tokens == pred.hits
        assert s.accepted_prediction_tokens + s.rejected_prediction_tokens == pred.draft_tokens
    return off, on


CODE = workload("code_edit_pred")


def test_prediction_of_a_code_edit_is_drafted_and_accepted(stub):
    off, on = on_off(stub, messages=chat(CODE["messages"]), max_tokens=96, prediction=CODE["prediction"])
    # the output's first line ("Here's how ...") is not in the prediction; the code is
    assert on.stats.accepted_prediction_tokens >= 30, on.stats


def test_prediction_resynchronises_after_an_edit(stub):
    kw = dict(messages=chat(CODE["messages"]), max_tokens=96)
    off = complete(stub, spec=OFF, **kw)
    lines = off.text.split("\n")
    assert len(lines) > 8
    # the prediction is the real output with its third line replaced: drafts must rejoin after it
    edited = "\n".join(lines[:2] + ["    this line is not in the output at all = 42"] + lines[3:])
    _, on = on_off(stub, prediction=edited, **kw)
    head = len(stub.Tokenize(cpb.TokenizeRequest(text="\n".join(lines[:3])), timeout=60).token_ids)
    assert len(on.token_ids) > head + 40
    # more prediction tokens accepted than precede the edit: drafting went on after it
    assert on.stats.accepted_prediction_tokens > head + 20, (on.stats, head)


@pytest.mark.parametrize("prediction", [
    "def totally_different():\n    return [x ** 2 for x in range(10)]\n",   # wrong
    "",                                                                     # empty
    CODE["prediction"] * 6,                                                 # longer than max_tokens
    "Кестрел — небольшой сокол. 小さなハヤブサ。",                          # another script
])
def test_any_prediction_gives_the_plain_output(stub, prediction):
    on_off(stub, messages=chat(CODE["messages"]), max_tokens=48, prediction=prediction)


def test_numbered_list_drafts_the_next_number_on_the_real_tokenizer(smollm2_path):
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.coordinator.servicer import digit_tokens
    from echospec.services.draft.proposer import SOURCE_NUMBERED, DraftProposer

    tok = Tokenizer.from_gguf(smollm2_path)
    digits = digit_tokens(tok)
    assert len(digits) == 10
    p = DraftProposer(digits=digits)
    p.append(tok.encode("Shopping list:\n1. Apples\n2. Bread\n3. Milk\n"))
    draft, _, source = p.propose(4)
    assert source == SOURCE_NUMBERED and tok.decode(draft).startswith("4.")
    p = DraftProposer(digits=digits)
    p.append(tok.encode("Steps:\n8. Stir\n9. Serve\n"))
    draft, _, _ = p.propose(4)
    assert tok.decode(draft).startswith("10.")


def test_numbered_workload_accepts_numbered_drafts(stub):
    w = workload("numbered")
    _, on = on_off(stub, messages=chat(w["messages"]), max_tokens=120)
    num = sources(on).get("numbered")
    assert num is not None and num.hits >= 3, on.stats


def test_namespace_shares_only_within_itself(stub):
    msgs = chat([{"role": "user", "content": "Describe a kestrel hunting over a meadow in two sentences."}])
    first = complete(stub, spec=ON, messages=msgs, max_tokens=40, draft_namespace="team-a")
    # the same request again: team-a's memory holds the answer, team-b's and no namespace's do not
    _, again = on_off(stub, messages=msgs, max_tokens=40, draft_namespace="team-a")
    assert list(again.token_ids) == list(first.token_ids)
    assert sources(again)["shared"].hits >= 10, again.stats
    _, other = on_off(stub, messages=msgs, max_tokens=40, draft_namespace="team-b")
    assert "shared" not in sources(other)
    _, none = on_off(stub, messages=msgs, max_tokens=40)
    assert "shared" not in sources(none)


def test_bad_namespace_is_refused(stub):
    with pytest.raises(grpc.RpcError) as ei:
        complete(stub, text="hi", max_tokens=2, draft_namespace="x" * 300)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def draft_stub():
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft import server as dserver
    from echospec.v1 import draft_pb2_grpc
    handle, _ = dserver.start(DraftConfig(port=0))
    ch = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield draft_pb2_grpc.DraftServiceStub(ch)
    ch.close()
    handle.stop(0)


def test_draft_service_refuses_min_n_outside_its_range(draft_stub):
    from echospec.v1 import draft_pb2
    with pytest.raises(grpc.RpcError) as ei:
        draft_stub.Propose(draft_pb2.ProposeRequest(tokens=[1, 2, 1, 2], k=4, min_n=65), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "min_n must be in [1, 64], got 65"
    with pytest.raises(grpc.RpcError) as ei:
        list(draft_stub.ProposeStream(iter([draft_pb2.ProposeStreamRequest(
            append=[1, 2, 1, 2], k=2, min_n=-1)]), timeout=10))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "min_n must be in [1, 64], got -1"
    r = draft_stub.Propose(draft_pb2.ProposeRequest(tokens=[1, 2, 3, 1, 2], k=2, min_n=2), timeout=10)
    assert list(r.draft) == [3, 1]


def test_draft_service_refuses_negative_token_ids(draft_stub):
    # the draft service loads no model: it cannot know the vocabulary, so only negative ids are
    # refused (the verifier checks the vocabulary of the tokens it drafts for)
    from echospec.v1 import draft_pb2
    with pytest.raises(grpc.RpcError) as ei:
        draft_stub.Propose(draft_pb2.ProposeRequest(tokens=[1, -1, 1], k=4), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "token ids must be ints >= 0, got -1"
    big = 2**31 - 1
    r = draft_stub.Propose(draft_pb2.ProposeRequest(tokens=[big, 7, big, 7, big], k=1), timeout=10)
    assert list(r.draft) == [7]


@pytest.mark.parametrize("ns, message", [
    ("\x00\n/../", "draft_namespace must hold printable characters only, got U+0000 at position 0"),
    ("team\u200b", "draft_namespace must hold printable characters only, got U+200B at position 4"),
    ("\x00" * 300, "draft_namespace must be at most 256 characters, got 300"),
    ("n" * 257, "draft_namespace must be at most 256 characters, got 257"),
])
def test_bad_namespace_message_names_the_rule_it_breaks(draft_stub, ns, message):
    # was: "must be at most 256 printable characters" for a short name holding a control
    # character, which reads like a length problem
    from echospec.v1 import draft_pb2
    with pytest.raises(grpc.RpcError) as ei:
        list(draft_stub.ProposeStream(iter([draft_pb2.ProposeStreamRequest(
            append=[1, 2, 1, 2], k=2, draft_namespace=ns)]), timeout=10))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == message
    ok = list(draft_stub.ProposeStream(iter([draft_pb2.ProposeStreamRequest(
        append=[1, 2, 1, 2], k=2, draft_namespace="n" * 256)]), timeout=10))
    assert len(ok) == 1


def test_draft_propose_names_one_range_for_k():
    # was: "k must be >= 1, got 0" but "k must be in [0, 1024], got 1025" for the same field
    import grpc
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft import server as dserver
    from echospec.v1 import draft_pb2, draft_pb2_grpc
    handle, _ = dserver.start(DraftConfig(port=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            for k in (0, -3, 1025):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Propose(draft_pb2.ProposeRequest(tokens=[1, 2, 1, 2], k=k), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == f"k must be in [1, 1024], got {k}"
            r = stub.Propose(draft_pb2.ProposeRequest(tokens=[1, 2, 1, 2, 1], k=1024), timeout=10)
            assert list(r.draft)[:2] == [2, 1]
    finally:
        handle.stop(0)


def test_a_draft_session_past_max_history_is_refused_and_forgotten():
    # a client of the draft port appending without end grew the process's memory without bound
    # (~0.5 KB a token): a session that would pass max_history ends with RESOURCE_EXHAUSTED
    import grpc
    from echospec.services.common.config import DraftConfig
    from echospec.services.draft import server as dserver
    from echospec.v1 import draft_pb2, draft_pb2_grpc
    handle, servicer = dserver.start(DraftConfig(port=0, max_history=100))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            ok = list(stub.ProposeStream(iter([
                draft_pb2.ProposeStreamRequest(append=[1, 2] * 20, k=2, prediction=[1] * 10,
                                               draft_namespace="cap"),
                draft_pb2.ProposeStreamRequest(append=[1, 2] * 25, k=2)]), timeout=10))
            assert len(ok) == 2 and ok[-1].history_len == 90   # 90 + 10 predicted: at the bound
            with pytest.raises(grpc.RpcError) as e:
                list(stub.ProposeStream(iter([
                    draft_pb2.ProposeStreamRequest(append=[1, 2] * 40, k=2, draft_namespace="over"),
                    draft_pb2.ProposeStreamRequest(append=[3] * 21, k=2)]), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == ("the draft session would hold 101 tokens (history and "
                                         "prediction), more than the draft service's max_history 100")
            assert servicer.memory.n_tokens("over") == 0 and servicer.memory.n_tokens("cap") == 90
            with pytest.raises(grpc.RpcError) as e:
                stub.Propose(draft_pb2.ProposeRequest(tokens=[1] * 101, k=1), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_history 100" in e.value.details()
    finally:
        handle.stop(0)


def test_a_stack_gives_its_draft_service_room_for_the_verifiers_context(tmp_path):
    # a verifier's generation holds up to n_ctx tokens of history, and its prediction: the stack
    # raises the draft service's max_history to twice n_ctx where that is larger
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from ggufgen import write_tiny_model
    from echospec.stack import start_stack
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", n_vocab=320, n_ctx_train=1024, seed=0)
    for n_ctx, want in ((70000, 140000), (256, 1 << 17)):
        st = start_stack(str(model), n_ctx=n_ctx, n_threads=1, max_sessions=2)
        try:
            assert st._servers["draft"][1].config.max_history == want
        finally:
            st.stop()
