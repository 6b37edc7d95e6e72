"""Draft token trees (services/draft): merge_tree, SuffixAutomaton.branches and
DraftProposer.propose_tree on literal token arrays, one rule per case."""
import pytest

from echospec.services.draft.proposer import (SOURCE_PREDICTION, SOURCE_SUFFIX, DraftParams,
                                              DraftProposer, ProposerError, merge_tree,
                                              merge_tree_origins)
from echospec.services.draft.suffix_index import SuffixAutomaton, SuffixParams

P1 = SuffixParams(min_match=1)


def test_merge_tree_shares_prefixes_and_keeps_the_first_sequence_a_chain():
    assert merge_tree([[1, 2, 3], [1, 4], [5]], 5) == ([1, 2, 3, 4, 5], [-1, 0, 1, 0, -1])


def test_merge_tree_budget_cuts_later_sequences_only():
    assert merge_tree([[1, 2, 3], [1, 4], [5]], 4) == ([1, 2, 3, 4], [-1, 0, 1, 0])
    # the first sequence is never cut, even past the budget
    assert merge_tree([[1, 2, 3], [6]], 2) == ([1, 2, 3], [-1, 0, 1])


def test_merge_tree_of_a_duplicate_or_prefix_adds_nothing():
    assert merge_tree([[1, 2, 3], [1, 2], [1, 2, 3]], 10) == ([1, 2, 3], [-1, 0, 1])


def test_merge_tree_branches_deeper_than_the_root():
    # [1, 2, 7, 8] leaves the chain after 1, 2: its nodes hang off node 1
    assert merge_tree([[1, 2, 3], [1, 2, 7, 8]], 10) == ([1, 2, 3, 7, 8], [-1, 0, 1, 1, 3])


def test_merge_tree_parents_precede_children():
    toks, par = merge_tree([[5, 6, 7], [8, 9], [5, 1, 2], [8, 3]], 10)
    assert all(-1 <= p < i for i, p in enumerate(par))
    assert (toks, par) == ([5, 6, 7, 8, 9, 1, 2, 3], [-1, 0, 1, -1, 3, 0, 5, 3])


def sam_of(tokens):
    s = SuffixAutomaton()
    s.extend(tokens)
    return s


def test_branches_give_the_other_continuation_of_a_match():
    # (9, 1) occurred once, followed by 2, 4; the shorter context (1, 2) was also followed by 3:
    # the branch is 2 then 3
    s = sam_of([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    state, n = s.match()
    assert n == 2
    assert s.draft(state, n, 4, P1)[0] == [2, 4, 9, 1]
    assert s.branches(state, n, 4, P1) == [[2, 3, 9, 1]]


def test_branches_at_the_root_from_a_shorter_context():
    # the match (0, 5, 6) was followed by 2 only; the shorter (5, 6) by 1 and 2: branch 1
    s = sam_of([5, 6, 1, 0, 5, 6, 2, 0, 5, 6])
    state, n = s.match()
    assert s.draft(state, n, 2, P1)[0] == [2, 0]
    assert s.branches(state, n, 2, P1) == [[1, 0]]


def test_branches_none_for_a_single_continuation_or_no_match():
    s = sam_of([1, 2, 3, 1, 2])
    state, n = s.match()
    assert s.branches(state, n, 3, P1) == []
    s = sam_of([1, 2, 3])
    assert s.branches(*s.match(), 3, P1) == []


def test_branches_at_several_candidates_of_one_state():
    # (1, 2) was followed by 3 and 4 (4 more recent): the draft takes 4, 1, 2 and then 4
    # again; branches: 3 at the root, and 3 after 4, 1, 2
    s = sam_of([1, 2, 3, 1, 2, 4, 1, 2])
    state, n = s.match()
    assert s.draft(state, n, 4, P1)[0] == [4, 1, 2, 4]
    assert s.branches(state, n, 4, P1) == [[3, 1, 2, 4], [4, 1, 2, 3]]


def test_branches_respect_k_and_min_prob():
    s = sam_of([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    state, n = s.match()
    assert s.branches(state, n, 2, P1) == [[2, 3]]
    # the other continuation's share, 1/2 (cnt 1 of 2), is below a min_prob of 0.6
    assert s.branches(state, n, 4, SuffixParams(min_match=1, min_prob=0.6)) == []


def proposer(history, prediction=(), nodes=None):
    p = DraftProposer(DraftParams(suffix=P1), prediction=prediction)
    p.append(history)
    p.start_output()
    return p


def test_propose_tree_first_branch_is_the_chain_proposal():
    p = proposer([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    chain, n, src = p.propose(4)
    toks, par, m, src2 = p.propose_tree(4, 8)
    assert (chain, n, src) == ([2, 4, 9, 1], 2, SOURCE_SUFFIX) == (toks[:4], m, src2)
    assert par[:4] == [-1, 0, 1, 2]
    # the other continuation hangs off the shared first token 2
    assert toks[4:] == [3, 9, 1] and par[4:] == [0, 4, 5]


def test_propose_tree_zero_nodes_is_the_chain_alone():
    p = proposer([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    assert p.propose_tree(4, 0) == ([2, 4, 9, 1], [-1, 0, 1, 2], 2, SOURCE_SUFFIX)


def test_propose_tree_budget_bounds_the_other_branches():
    p = proposer([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    toks, par, _, _ = p.propose_tree(4, 5)
    assert (toks, par) == ([2, 4, 9, 1, 3], [-1, 0, 1, 2, 0])


def test_propose_tree_puts_the_suffix_draft_beside_a_prediction():
    # the prediction (drafted first) says 8, 8; the history repeats 5 6 -> 1 0
    p = proposer([5, 6, 1, 0, 5, 6], prediction=[8, 8])
    toks, par, _, src = p.propose_tree(2, 6)
    assert src == SOURCE_PREDICTION
    assert (toks, par) == ([8, 8, 1, 0], [-1, 0, -1, 2])


def test_merge_tree_origins_name_the_sequence_that_added_each_node():
    assert merge_tree_origins([[1, 2, 3], [1, 4], [5]], 5) == (
        [1, 2, 3, 4, 5], [-1, 0, 1, 0, -1], [0, 0, 0, 1, 2])


def test_propose_tree_sources_say_each_nodes_source():
    # the prediction's nodes, then the suffix index's beside them
    p = proposer([5, 6, 1, 0, 5, 6], prediction=[8, 8])
    toks, par, srcs, _, src = p.propose_tree_sources(2, 6)
    assert (toks, par, src) == ([8, 8, 1, 0], [-1, 0, -1, 2], SOURCE_PREDICTION)
    assert srcs == [SOURCE_PREDICTION, SOURCE_PREDICTION, SOURCE_SUFFIX, SOURCE_SUFFIX]
    # a suffix index's other continuation is the suffix index's too
    assert proposer([7, 1, 2, 3, 9, 1, 2, 4, 9, 1]).propose_tree_sources(4, 8)[2] == [SOURCE_SUFFIX] * 7


def test_propose_tree_empty_when_nothing_drafts():
    assert proposer([1, 2, 3]).propose_tree(4, 8) == ([], [], 0, 0)


def test_propose_tree_refuses_a_negative_budget():
    with pytest.raises(ProposerError, match="tree_nodes"):
        proposer([1, 2, 1]).propose_tree(4, -1)
