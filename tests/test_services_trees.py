"""Token-tree speculation through the services (draft service -> verifier, and the
coordinator) on a tiny random GGUF model (tests/ggufgen.py): the verifier's --tree-nodes on,
every output byte-identical with speculation off and with chains, tree rounds reported in
StepResult.tree_nodes, a request's tree_nodes checked and honoured."""
from __future__ import annotations

import grpc
import pytest

from echospec.v1 import (common_pb2, coordinator_pb2 as cpb, draft_pb2, draft_pb2_grpc,
                         verifier_pb2 as vpb, verifier_pb2_grpc)
from echospec.stack import start_stack

OFF, ON = common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON


@pytest.fixture(scope="module")
def stack(tiny_model):
    st = start_stack(tiny_model(arch="llama", n_vocab=320, n_ctx_train=512, seed=0), spec=False,
                     n_ctx=256, n_threads=1, tree_nodes=8, min_n=1)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def verifier(stack):
    ch = grpc.insecure_channel(f"{stack.host}:{stack.verifier_port}")
    yield verifier_pb2_grpc.VerifierServiceStub(ch)
    ch.close()


def run(verifier, prompt, n, spec, tree_nodes=0, fixed_k=True):
    req = vpb.GenerateTokensRequest(prompt=prompt, max_tokens=n, spec=spec, k=4, fixed_k=fixed_k,
                                    tree_nodes=tree_nodes)
    rounds = [r.result for m in verifier.GenerateTokens(req, timeout=300) for r in m.rounds]
    return [t for r in rounds for t in r.tokens], rounds


# a phrase repeated under different continuations, then the phrase again
PROMPTS = [
    [11, 12, 13, 40, 41, 11, 12, 13, 50, 51, 11, 12, 13, 60, 61, 11, 12],
    [5, 6, 7, 8, 90, 5, 6, 7, 8, 91, 5, 6, 7, 8, 92, 93, 5, 6, 7],
    [(i * 7) % 200 + 3 for i in range(30)] + [(i * 7) % 200 + 3 for i in range(12)],
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_rounds_are_byte_identical_to_speculation_off_and_to_chains(verifier, prompt):
    off, _ = run(verifier, prompt, 64, False)
    tree, rounds = run(verifier, prompt, 64, True)          # the verifier's --tree-nodes 8
    chain, chain_rounds = run(verifier, prompt, 64, True, tree_nodes=-1)
    assert tree == off == chain
    assert not any(r.tree_nodes for r in chain_rounds)
    trees = [r for r in rounds if r.tree_nodes]
    assert all(r.k == r.tree_nodes <= 8 + 4 and r.kv_rolls == r.k - r.accepted for r in trees)
    assert sum(r.hits for r in rounds) + sum(r.kv_rolls for r in rounds) == sum(r.k for r in rounds)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_cost_models_shapes_are_byte_identical_to_speculation_off(verifier, prompt):
    # fixed_k off: each round's chain, tree or no draft is the cost model's choice
    off, _ = run(verifier, prompt, 64, False)
    tree, rounds = run(verifier, prompt, 64, True, fixed_k=False)
    chain, chain_rounds = run(verifier, prompt, 64, True, tree_nodes=-1, fixed_k=False)
    assert tree == off == chain
    assert not any(r.tree_nodes for r in chain_rounds)
    drafted = [r for r in rounds + chain_rounds if r.k]
    assert all(r.expected_accepted > 0 and r.expected_ms > 0 for r in drafted)
    assert not any(r.expected_accepted for r in rounds + chain_rounds if not r.k)


def test_getconfig_says_the_tree_budget(verifier):
    cfg = verifier.GetConfig(vpb.GetConfigRequest(), timeout=30)
    assert cfg.tree_nodes == 8 and cfg.tree_refusal == ""


def test_some_round_verifies_a_tree(verifier):
    seen = 0
    for prompt in PROMPTS:
        _, rounds = run(verifier, prompt, 64, True)
        seen += sum(1 for r in rounds if r.tree_nodes >= 2)
    assert seen > 0


def test_a_tree_round_accepts_from_another_branch(verifier):
    # the model answers 107 forever; the draft's longest match, (107, 107), was followed by 212
    # (its chain), the shorter context (107) by 107 too (a branch): with a fixed K (the tree then
    # holds no node past the chain's K on its own branch), a round accepting more than its chain
    # took the other branch
    prompt = [107, 107, 212, 193, 97, 162, 42, 107]
    off, _ = run(verifier, prompt, 24, False)
    assert off[:8] == [107] * 8
    on, rounds = run(verifier, prompt, 24, True)
    assert on == off
    # the chain's first token (212) was wrong: its verify alone would have accepted nothing
    assert any(r.tree_nodes >= 2 and r.chain_accepted == 0 and r.accepted >= 1 for r in rounds), \
        [(r.tree_nodes, r.accepted, r.chain_accepted) for r in rounds]


def test_a_request_tree_budget_out_of_range_is_refused(verifier, stack):
    with pytest.raises(grpc.RpcError) as e:
        run(verifier, PROMPTS[0], 8, True, tree_nodes=64)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_nodes" in e.value.details()
    from echospec.v1 import coordinator_pb2_grpc
    ch = grpc.insecure_channel(stack.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(cpb.CompleteRequest(token_ids=PROMPTS[0], max_tokens=8, spec=ON, tree_nodes=-2),
                          timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_nodes" in e.value.details()
        # through the coordinator: trees (the verifier's default), chains and off agree
        outs = [list(stub.Complete(cpb.CompleteRequest(token_ids=PROMPTS[1], max_tokens=48, spec=s,
                                                       tree_nodes=t), timeout=300).result.token_ids)
                for s, t in ((OFF, 0), (ON, 0), (ON, -1), (ON, 12))]
        assert outs[0] == outs[1] == outs[2] == outs[3]
    finally:
        ch.close()


def test_draft_service_proposes_a_tree_only_when_asked(stack):
    ch = grpc.insecure_channel(f"{stack.host}:{stack.draft_port}")
    try:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        h = [7, 1, 2, 3, 9, 1, 2, 4, 9, 1]
        chain = stub.Propose(draft_pb2.ProposeRequest(tokens=h, k=4, min_n=1), timeout=30)
        tree = stub.Propose(draft_pb2.ProposeRequest(tokens=h, k=4, min_n=1, tree_nodes=8), timeout=30)
        assert list(chain.draft) == [2, 4, 9, 1] and list(chain.parents) == []
        assert list(tree.draft) == [2, 4, 9, 1, 3, 9, 1] and list(tree.parents) == [-1, 0, 1, 2, 0, 4, 5]
        assert list(tree.node_sources) == [common_pb2.DRAFT_SOURCE_SUFFIX] * 7
        assert list(chain.node_sources) == []
        with pytest.raises(grpc.RpcError) as e:
            stub.Propose(draft_pb2.ProposeRequest(tokens=h, k=4, tree_nodes=-3), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ch.close()


def test_smollm2_tree_rounds_accept_past_the_chain(smollm2_path):
    """On the real model through the draft service: trees on give speculation off's tokens, with
    the cost model's choice of shape or a fixed K (every branch the budget takes), some rounds
    verify trees, and every draft round of the cost model's says the accepted drafts it expected
    (another branch winning is shown with controlled drafts in test_tree_rounds.py)."""
    from conftest import chatml
    st = start_stack(smollm2_path, spec=False, n_ctx=1024, tree_nodes=8)
    try:
        from echospec.v1 import coordinator_pb2_grpc
        with grpc.insecure_channel(st.target) as cch, \
                grpc.insecure_channel(f"{st.host}:{st.verifier_port}") as vch:
            coord = coordinator_pb2_grpc.CoordinatorServiceStub(cch)
            ver = verifier_pb2_grpc.VerifierServiceStub(vch)
            trees = 0
            for user in ('Repeat the word "kestrel" 100 times, separated by spaces.',
                         "List 20 tips for learning to cook, numbered 1. to 20., one short line each."):
                prompt = list(coord.Tokenize(cpb.TokenizeRequest(text=chatml(user)), timeout=60).token_ids)
                off, _ = run(ver, prompt, 160, False)
                for fixed in (False, True):
                    req = vpb.GenerateTokensRequest(prompt=prompt, max_tokens=160, spec=True, k=8,
                                                    fixed_k=fixed)
                    rounds = [r.result for m in ver.GenerateTokens(req, timeout=300) for r in m.rounds]
                    assert [t for r in rounds for t in r.tokens] == off
                    trees += sum(1 for r in rounds if r.tree_nodes)
                    drafted = [r for r in rounds if r.k]
                    assert drafted
                    if fixed:
                        assert not any(r.expected_accepted for r in rounds)
                    else:
                        assert all(r.expected_accepted > 0 and r.expected_ms > 0 for r in drafted)
            assert trees > 0
    finally:
        st.stop()


def test_spec_stats_say_the_tree_rounds_and_the_expected_acceptance(stack):
    # the coordinator's generations take the cost model's choice; their SpecStats count the tree
    # rounds and the mean accepted drafts the cost model expected of its shapes
    from echospec.v1 import coordinator_pb2_grpc
    from echospec_client.client import SpecStats
    ch = grpc.insecure_channel(stack.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        for prompt in PROMPTS:
            res = stub.Complete(cpb.CompleteRequest(token_ids=prompt, max_tokens=64, spec=ON),
                                timeout=300).result
            s = res.stats
            assert s.tries > 0 and 0 <= s.tree_rounds <= s.tries
            assert s.expected_accepted > 0 and s.k_choice
            typed = SpecStats.from_proto(s)
            assert (typed.tree_rounds, typed.expected_accepted) == (s.tree_rounds, s.expected_accepted)
    finally:
        ch.close()
