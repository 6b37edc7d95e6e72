"""The services on the real model, SmolLM2-135M-Instruct Q4_1 (fetched by scripts/fetch_model.py).

max_tokens is kept modest (64) so the file runs in CI time on 2 cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from echospec.services.common.config import CoordinatorConfig
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from echospec.stack import start_stack

ROOT = Path(__file__).resolve().parents[1]
OFF, ON = common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON
MAX_TOKENS = 64


def load_workloads() -> list[dict]:
    with open(ROOT / "workloads" / "seed.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def stub(smollm2_stub):
    return smollm2_stub


@pytest.fixture(scope="module")
def fixed_k_stub(smollm2_path):
    # drafts of exactly k (no cost model): the copied EOS lands inside a drafted run
    st = start_stack(smollm2_path, spec=False, n_ctx=1024, adaptive_k=False)
    ch = grpc.insecure_channel(st.target)
    yield coordinator_pb2_grpc.CoordinatorServiceStub(ch)
    ch.close()
    st.stop()


def chat(messages: list[dict]) -> list[cpb.ChatMessage]:
    return [cpb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=600).result


@pytest.mark.parametrize("workload", load_workloads(), ids=lambda w: w["id"])
def test_seed_workload_spec_on_off_byte_identical(stub, workload):
    kw = dict(messages=chat(workload["messages"]), max_tokens=min(MAX_TOKENS, workload["max_tokens"]),
              prediction=workload.get("prediction", ""))
    off = complete(stub, spec=OFF, **kw)
    on = complete(stub, spec=ON, **kw)
    assert on.text.encode() == off.text.encode()
    assert list(on.token_ids) == list(off.token_ids)
    assert on.finish_reason == off.finish_reason
    s = on.stats
    assert s.hits + s.kv_rolls == s.draft_tokens <= s.tries * CoordinatorConfig.k   # the stack's default k
    if workload["kind"] == "repetitive":
        assert s.hits > 0, f"{workload['id']}: no accepted drafts"
    assert off.text.strip(), "empty output"


@pytest.mark.parametrize("answer", ["Kestrel, kestrel, kestrel.", "The kestrel is a small falcon."])
def test_eos_inside_an_accepted_run_ends_where_plain_decoding_does(fixed_k_stub, answer):
    stub = fixed_k_stub
    # the previous assistant turn ends with <|im_end|>: the drafter copies it, EOS is a draft
    msgs = chat([{"role": "user", "content": "Say exactly: " + answer},
                 {"role": "assistant", "content": answer},
                 {"role": "user", "content": "Say exactly: " + answer}])
    off = complete(stub, messages=msgs, max_tokens=32, spec=OFF)
    on = complete(stub, messages=msgs, max_tokens=32, spec=ON)
    assert off.finish_reason == on.finish_reason == common_pb2.FINISH_REASON_EOS
    assert list(on.token_ids) == list(off.token_ids) and on.text == off.text == answer
    produced = 1 + on.stats.rounds + on.stats.hits
    assert produced > len(on.token_ids) + 1, "EOS was not inside an accepted run (precondition)"


def test_random_text_prompts_spec_on_off_identical(stub):
    import random
    rng = random.Random(5)
    words = "the a kestrel sky blue red code list one two three falcon river stone".split()
    for _ in range(3):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 12)))
        off = complete(stub, text=text, max_tokens=32, spec=OFF)
        on = complete(stub, text=text, max_tokens=32, spec=ON)
        assert list(on.token_ids) == list(off.token_ids) and on.text == off.text


def test_eight_concurrent_clients_at_batch_max_8_equal_sequential(smollm2_path):
    import random

    from concurrency import sequential_and_concurrent

    st = start_stack(smollm2_path, spec=False, n_ctx=1024, batch_max=8)
    ch = grpc.insecure_channel(st.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        rng = random.Random(8)
        words = "the a kestrel sky blue red code list one two three falcon river stone".split()
        jobs = [dict(text=" ".join(rng.choice(words) for _ in range(rng.randrange(3, 40))), max_tokens=24)
                for _ in range(8)]
        sequential, concurrent, trace = sequential_and_concurrent(
            lambda **j: complete(stub, **j), st.verifier.core.scheduler, jobs)
        for a, b in zip(sequential, concurrent):
            assert list(a.token_ids) == list(b.token_ids) and a.text.encode() == b.text.encode()
        assert 2 <= max(len(b) for b in trace) <= 8   # es_forward_batch calls over several sessions
        refused = complete(stub, text=jobs[0]["text"], max_tokens=4, spec=ON)
        assert not refused.spec_enabled and "batch_max 8 >= 2" in refused.spec_reason
    finally:
        ch.close()
        st.stop()


def test_readme_grpcurl_prediction_example_prints_what_it_says(stub):
    """The README's grpcurl prediction example, sent as written: the reply is the prediction and
    the stats hold the accepted_prediction_tokens count the README quotes, under grpcurl's
    snake_case name (was: the README said "acceptedPredictionTokens" while the example's output
    left the prediction, 0 accepted and rejected_prediction_tokens 3)."""
    import re

    from google.protobuf import json_format

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## grpcurl", 1)[1].split("```", 2)[1]
    cmd = next(line for line in block.splitlines() if '"prediction"' in line)
    req = json_format.Parse(re.search(r"-d '(.*?)'", cmd).group(1), cpb.CompleteRequest())
    quoted = re.search(r'"accepted_prediction_tokens": "(\d+)"', block)
    assert quoted, "the README no longer quotes the count"
    r = stub.Complete(req, timeout=120).result
    assert r.text == req.prediction and r.spec_enabled
    printed = json.loads(json_format.MessageToJson(r, preserving_proto_field_name=True))  # grpcurl's form
    # the count is the cost model's: K per round follows live timings, so a busy host drafts in
    # fewer rounds (the README says so); every draft was the prediction's and was accepted
    accepted = int(printed["stats"]["accepted_prediction_tokens"])
    assert 1 <= accepted <= req.max_tokens - 1, printed["stats"]
    assert int(quoted.group(1)) <= req.max_tokens - 1
    pred = [s for s in printed["stats"]["sources"] if s["source"] == "prediction"]
    assert pred and pred[0]["hits"] == pred[0]["draft_tokens"] == str(accepted), printed["stats"]
    assert "rejected_prediction_tokens" not in printed["stats"]
