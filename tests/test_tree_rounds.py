"""Token-tree rounds in the verifier's generation loop, on a tiny random GGUF model
(tests/ggufgen.py): the output is plain greedy decoding's with trees on, a tree round accepts
from a branch other than the draft chain, the KV cache holds exactly the accepted path (n_past),
the counters add up, and the cases that must fall back to chains do."""
from __future__ import annotations

import threading

import pytest

from echospec.services.common.config import VerifierConfig
from echospec.services.draft.proposer import DraftParams, DraftProposer
from echospec.services.draft.suffix_index import SuffixParams
from echospec.services.verifier.generation_loop import GenerationRequest, check, run_generation
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore
from echospec.services.verifier.tree_accept import first_branch

N_CTX = 256
V = 320


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(arch="llama", n_vocab=V, n_ctx_train=512, seed=0)


@pytest.fixture(scope="module")
def core(model_path):
    c = VerifierCore(VerifierConfig(model=model_path, n_ctx=N_CTX, n_threads=1, prefix_cache=False))
    yield c
    c.close()


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def plain(core, prompt, n) -> list[int]:
    req = GenerationRequest(prompt=list(prompt), max_tokens=n, eos_ids=frozenset(), sampling=Sampling())
    check(core, req)
    return tokens_of(run_generation(core, req, threading.Event()))


class _TreeOracle:
    """A draft link proposing trees: the chain (first branch) starts with a wrong token, a
    second branch is the true continuation (from a plain run), a third is another wrong one.
    Every ``chain_every``-th proposal is a plain chain of the truth (no parents)."""

    def __init__(self, truth: list[int], chain_every: int = 0):
        self.truth, self.chain_every = truth, chain_every
        self.history: list[int] = []
        self.asked: list[tuple[int, int]] = []
        self.tree_nodes = 0
        self.last_tree = None
        self.last_source = 0

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked.append((n, self.tree_nodes))

    def recv_proposal(self):
        assert self.truth[:len(self.history)] == self.history, "the draft history is not the real one"
        n, _ = self.asked[-1]
        true = self.truth[len(self.history):len(self.history) + n]
        if not true:
            self.last_tree = None
            return []
        if self.chain_every and len(self.asked) % self.chain_every == 0:
            self.last_tree = None
            return true
        wrong = [(true[0] + 1) % V] + true[1:]
        other = [(true[0] + 2) % V, 7, 7]
        toks = wrong + true + other
        par = ([-1] + list(range(len(wrong) - 1)) +
               [-1] + [len(wrong) + i for i in range(len(true) - 1)] +
               [-1, len(wrong) + len(true), len(wrong) + len(true) + 1])
        self.last_tree = (toks, par)
        return first_branch(toks, par)

    def close(self):
        pass

    def cancel(self):
        pass


def spec_req(prompt, n, tree_nodes, k=4, fixed_k=True, **kw):
    return GenerationRequest(prompt=list(prompt), max_tokens=n, eos_ids=frozenset(), sampling=Sampling(),
                             spec=True, k=k, fixed_k=fixed_k, tree_nodes=tree_nodes, **kw)


PROMPT = [(i * 5) % 300 + 3 for i in range(12)]


@pytest.mark.parametrize("chain_every", [0, 3])
def test_tree_rounds_give_the_plain_output_and_accept_from_another_branch(core, chain_every):
    want = plain(core, PROMPT, 48)
    link = _TreeOracle(PROMPT + want, chain_every)
    req = spec_req(PROMPT, 48, 12)
    check(core, req)
    evs = list(run_generation(core, req, threading.Event(), lambda: link))
    assert tokens_of(evs)[:48] == want[:48] and len(tokens_of(evs)) <= 49
    trees = [e for e in evs if e.tree_nodes]
    assert trees, "no tree round"
    # the chain's first token is always wrong: a tree round that accepted took another branch,
    # where the chain alone would have accepted nothing
    assert any(e.accepted >= 1 and e.chain_accepted == 0 for e in trees)
    assert all(e.chain_accepted <= e.accepted for e in trees)
    assert all(e.tree_nodes == e.k and 2 <= e.k <= 12 for e in trees)
    assert all(t == 12 for _, t in link.asked)   # the budget went with every proposal
    # the KV cache holds the prompt and every output token but the last (pending) one
    produced = 0
    for e in evs:
        produced += len(e.tokens)
        assert e.n_past == len(PROMPT) + produced - 1
    if chain_every:
        assert any(e.k and not e.tree_nodes and e.accepted for e in evs)   # chain rounds too


def test_trees_off_sends_no_budget_and_verifies_chains(core):
    want = plain(core, PROMPT, 24)
    link = _TreeOracle(PROMPT + want)
    req = spec_req(PROMPT, 24, 0)
    evs = list(run_generation(core, req, threading.Event(), lambda: link))
    assert tokens_of(evs)[:24] == want[:24]
    assert not any(e.tree_nodes for e in evs)
    assert all(t == 0 for _, t in link.asked)


def test_an_engine_that_refuses_trees_gets_chains(tiny_model):
    # Q8_0 KV (head_dim 32: its blocks): the engine refuses trees, the loop verifies chains and
    # the output stays plain
    path = tiny_model(arch="llama", n_vocab=V, n_ctx_train=512, seed=0, head_dim=32)
    q8 = VerifierCore(VerifierConfig(model=path, n_ctx=N_CTX, n_threads=1, prefix_cache=False,
                                     kv_type="q8_0"))
    try:
        assert q8.tree_refusal == "a Q8_0 KV cache"
        want = plain(q8, PROMPT, 24)
        link = _TreeOracle(PROMPT + want)
        evs = list(run_generation(q8, spec_req(PROMPT, 24, 12), threading.Event(), lambda: link))
        assert tokens_of(evs)[:24] == want[:24] and not any(e.tree_nodes for e in evs)
    finally:
        q8.close()


def test_logprobs_fall_back_to_chains(core):
    want = plain(core, PROMPT, 16)
    link = _TreeOracle(PROMPT + want)
    evs = list(run_generation(core, spec_req(PROMPT, 16, 12, logprobs=True), threading.Event(),
                              lambda: link))
    assert tokens_of(evs)[:16] == want[:16] and not any(e.tree_nodes for e in evs)


def test_check_refuses_a_tree_budget_out_of_range(core):
    for bad in (-1, 64):
        with pytest.raises(InvalidArgument, match="tree_nodes must be in"):
            check(core, spec_req(PROMPT, 8, bad))


class _ProposerLink:
    """The draft service's session (DraftProposer) in process, as the verifier's link."""

    def __init__(self):
        self.p = DraftProposer(DraftParams(suffix=SuffixParams(min_match=1)))
        self.tree_nodes = 0
        self.last_tree = None
        self.last_source = 0
        self.started = False
        self.pending = 0

    def append(self, tokens):
        self.p.append(tokens)
        if not self.started:
            self.p.start_output()
            self.started = True

    def send_propose(self, append, n):
        self.append(append)
        self.pending = n

    def recv_proposal(self):
        if self.tree_nodes:
            toks, par, _, self.last_source = self.p.propose_tree(self.pending, self.pending + self.tree_nodes)
            self.last_tree = (toks, par) if toks else None
            return first_branch(toks, par)
        d, _, self.last_source = self.p.propose(self.pending)
        return d

    def close(self):
        pass

    def cancel(self):
        pass


def test_draft_proposer_trees_give_the_plain_output(core):
    # prompts with a phrase repeated under several continuations; the draft service's session
    # (in process) proposes trees from them and from the model's own repeats
    for prompt in ([11, 12, 13, 40, 41, 11, 12, 13, 50, 51, 11, 12, 13, 60, 61, 11, 12],
                   [3, 101, 101, 4, 5, 101, 7, 8, 5]):
        want = plain(core, prompt, 48)
        for nodes in (0, 8):
            link = _ProposerLink()
            evs = list(run_generation(core, spec_req(prompt, 48, nodes, k=6), threading.Event(),
                                      lambda: link))
            assert tokens_of(evs)[:48] == want[:48]
            if not nodes:
                assert not any(e.tree_nodes for e in evs)


def test_the_cost_models_trees_give_the_plain_output_and_win_from_another_branch(core):
    # the cost model's choice of shape (fixed_k off): the chain's first guesses always miss and the
    # alternatives hit, so the counts turn to trees that accept past the chain, output unchanged
    want = plain(core, PROMPT, 64)
    link = _TreeOracle(PROMPT + want)
    req = spec_req(PROMPT, 64, 12, fixed_k=False)
    check(core, req)
    evs = list(run_generation(core, req, threading.Event(), lambda: link))
    assert tokens_of(evs)[:64] == want[:64] and len(tokens_of(evs)) <= 65
    trees = [e for e in evs if e.tree_nodes]
    assert any(e.accepted >= 1 and e.chain_accepted == 0 for e in trees)
    assert all(e.expected is not None and e.expected[0] > 0 and e.expected[1] > 0
               for e in evs if e.k)
    assert any(e.k_choice.startswith("tree of ") for e in evs)


def test_the_cost_models_chains_with_trees_off(core):
    # tree budget 0 with the cost model: chains as ever, no tree asked for or verified
    want = plain(core, PROMPT, 32)
    link = _TreeOracle(PROMPT + want)
    evs = list(run_generation(core, spec_req(PROMPT, 32, 0, fixed_k=False), threading.Event(),
                              lambda: link))
    assert tokens_of(evs)[:32] == want[:32]
    assert not any(e.tree_nodes for e in evs) and all(t == 0 for _, t in link.asked)


def test_draft_proposer_trees_of_the_cost_models_choice_give_the_plain_output(core):
    for prompt in ([11, 12, 13, 40, 41, 11, 12, 13, 50, 51, 11, 12, 13, 60, 61, 11, 12],
                   [3, 101, 101, 4, 5, 101, 7, 8, 5]):
        want = plain(core, prompt, 48)
        for nodes in (0, 8):
            link = _ProposerLink()
            evs = list(run_generation(core, spec_req(prompt, 48, nodes, k=6, fixed_k=False),
                                      threading.Event(), lambda: link))
            assert tokens_of(evs)[:48] == want[:48]


def test_a_namespaced_generation_leaves_its_counts_for_the_next(core):
    want = plain(core, PROMPT, 24)
    link = _TreeOracle(PROMPT + want)
    req = spec_req(PROMPT, 24, 12, fixed_k=False, draft_namespace="team-a")
    list(run_generation(core, req, threading.Event(), lambda: link))
    from echospec.services.verifier.controller import SpecController
    ctl = SpecController(k=4)
    assert core.spec_priors.seed("team-a", ctl)
    # the oracle's alternatives at the roots win: the namespace's prior for them is above the bare
    # Beta(1, 3)'s 0.25, and holds at most NamespacePriors.weight observations per source
    assert ctl.p_source(0, alt=True) > 0.25
    assert all(h + f <= core.spec_priors.weight + 1e-9 for h, f in ctl.acc.values())
