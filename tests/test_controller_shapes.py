"""The spec controller's choice of a round's shape (controller.best_shape): a chain of K drafts,
a token tree cut to n nodes, or no draft, by expected tokens per ms under the gain condition;
the tree model's node probabilities, the per-node acceptance counts of a tree round and the
per-namespace priors. Made-up p, T and V values, one rule per case."""
from __future__ import annotations

import random

import pytest

from echospec.services.common.economics import gain_condition
from echospec.services.verifier.controller import (CostModel, NamespacePriors, Shape, SpecController,
                                                   best_shape, chain_nodes, first_children, node_probs)

SUFFIX, PRED = 1, 4


def cost(t: float, slope: float, overhead: float = 0.5) -> CostModel:
    c = CostModel(prior_slope=slope)
    c.observe(0, t, t + overhead, t)
    c.overhead_ms = overhead
    return c


# chain [1, 2, 3] (the first branch), and an alternative root 9 beside token 1
TREE = ([1, 2, 3, 9], [-1, 0, 1, -1])


def test_node_probs_make_siblings_exclusive():
    assert node_probs([-1, 0, -1], [0.6, 0.5, 0.3]) == pytest.approx([0.6, 0.3, 0.4 * 0.3])
    # the children of one node never sum past it
    probs = node_probs([-1, 0, 0, 0], [0.5, 0.9, 0.9, 0.9])
    assert sum(probs[1:]) <= probs[0]


def test_first_children_and_chain_nodes():
    assert first_children([-1, 0, 1, -1, 0]) == [True, True, True, False, False]
    assert chain_nodes([1, 2, 3, 9], [-1, 0, 1, -1], [1, 2, 7]) == [0, 1]
    assert chain_nodes([1, 2, 3, 9], [-1, 0, 1, -1], [9]) == [3]


def test_a_tree_is_chosen_when_its_alternative_pays_more_than_the_chain():
    # V(K) = 5 (1 + 0.1 K), overhead 0.5; chain p 0.3: K = 1 gives 1.3 tokens in 6.0 ms (0.217/ms);
    # with the root alternative (p 0.6 after the chain's first token fails: 0.7 * 0.6 = 0.42) the
    # tree of 2 nodes gives 1.72 tokens in 6.5 ms (0.265/ms)
    c = cost(t=5.0, slope=0.1)
    shape, chain = best_shape(0.3, 3, c, False, TREE, [0.3, 0.3, 0.3, 0.6], [1, 2, 3], 4, 3)
    assert chain == Shape(1, (), pytest.approx(0.3), pytest.approx(6.0))
    assert shape.k == 1 and shape.nodes == (0, 3)
    assert shape.e == pytest.approx(0.3 + 0.42) and shape.ms == pytest.approx(6.5)
    assert shape.rate > chain.rate


def test_the_chain_is_kept_when_the_alternative_is_unlikely():
    c = cost(t=5.0, slope=0.1)
    shape, chain = best_shape(0.3, 3, c, False, TREE, [0.3, 0.3, 0.3, 0.05], [1, 2, 3], 4, 3)
    assert shape == chain and shape.k == 1 and not shape.nodes   # 1.335 / 6.5 < 1.3 / 6.0


def test_a_measured_slow_tree_forward_keeps_the_chain():
    # V of a tree of 2 nodes measured at 20 ms (its own table; the chains' V(2) is untouched)
    c = cost(t=5.0, slope=0.1)
    for _ in range(30):
        c.observe(2, 20.0, 20.5, 5.0, tree=True)
    assert c.v_tree_est(2) == pytest.approx(20.0, rel=0.05) and c.v_est(2) == pytest.approx(6.0)
    assert c.v_tree_est(3) == pytest.approx(c.v_est(3))   # not measured: the chain's
    shape, _ = best_shape(0.3, 3, c, False, TREE, [0.3, 0.3, 0.3, 0.6], [1, 2, 3], 2, 3)
    assert not shape.nodes and shape.k == 1


def test_no_draft_when_verify_costs_too_much_for_chain_and_tree():
    # V(K) = 5 (1 + 1.2 K): a chain of 1 costs 11.5 ms for at most 2 tokens (10 ms plainly)
    c = cost(t=5.0, slope=1.2)
    shape, chain = best_shape(0.9, 3, c, False, TREE, [0.9, 0.9, 0.9, 0.9], [1, 2, 3], 4, 3)
    assert shape == Shape() and chain == Shape()


def test_tree_nodes_respect_parents_depth_and_budget():
    # random trees and acceptances: a chosen tree holds its chain's first k nodes, a node only
    # with its parent, at most depth deep and max(k, budget) nodes, passes the gain condition
    # and beats the best chain's rate
    rng = random.Random(3)
    trees = 0
    for _ in range(300):
        n = rng.randint(1, 12)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        tokens = [rng.randint(0, 5) for _ in range(n)]
        # distinct tokens among siblings, as a proposal's
        seen: set = set()
        for i, q in enumerate(parents):
            while (q, tokens[i]) in seen:
                tokens[i] += 1
            seen.add((q, tokens[i]))
        chain, node = [], -1
        while True:
            nxt = next((i for i in range(len(parents)) if parents[i] == node), None)
            if nxt is None:
                break
            chain.append(tokens[nxt])
            node = nxt
        c = cost(t=5.0, slope=rng.choice([0.02, 0.1, 0.3]))
        p_node = [rng.random() for _ in range(n)]
        avail, budget, depth = min(len(chain), 4), rng.randint(1, 8), rng.randint(1, 4)
        avail = min(avail, depth)
        shape, best_chain = best_shape(rng.random(), avail, c, False, (tokens, parents), p_node,
                                       chain, budget, depth)
        if not shape.nodes:
            assert shape == best_chain
            continue
        trees += 1
        kept = set(shape.nodes)
        assert set(chain_nodes(tokens, parents, chain[:shape.k])) <= kept
        assert len(kept) <= max(shape.k, budget)
        d = []
        for q in parents:
            d.append(1 if q < 0 else d[q] + 1)
        assert all((parents[i] < 0 or parents[i] in kept) and d[i] <= depth for i in kept)
        probs = node_probs(parents, p_node)
        assert shape.e == pytest.approx(sum(probs[i] for i in kept))
        ok, lhs, _ = gain_condition(shape.e, c.v_tree_est(len(kept)), c.overhead_ms, c.v_est(0))
        assert ok and shape.ms == pytest.approx(lhs) and shape.rate > best_chain.rate
    assert trees > 10


def test_the_controller_drafts_the_chosen_trees_chain_and_builds_its_tree():
    ctl = SpecController(k=3, cost=cost(t=5.0, slope=0.1))
    ctl.acc[SUFFIX] = (0.0, 3.0)          # p = 1 / 5: its first guesses miss
    ctl.acc_alt[SUFFIX] = (4.0, 0.0)      # alternatives p = 5 / 8
    ctl.tree, ctl.tree_budget, ctl.tree_depth = (TREE[0], TREE[1], [SUFFIX] * 4), 4, 3
    assert ctl.on_proposal([1, 2, 3], k_cap=3, source=SUFFIX) == [1]
    assert ctl.shape.nodes == (0, 3)
    assert ctl.round_tree() == ([1, 9], [-1, -1])
    assert ctl.k_choice.startswith("tree of 2 nodes (chain K=1 + 1): E ")
    # p 0.2: a chain of 1 (1.2 tokens in 6.0 ms) is no faster than plain decoding (1.2 * 5 ms)
    assert "> no chain pays (T=5.0 ms, chain p=0.20)" in ctl.k_choice
    # the alternative 9 was the greedy token: a rejection of the first guess, a hit of the alternative
    ctl.on_tree_result([1])
    assert ctl.acc[SUFFIX] == pytest.approx((0.0, 3 * 0.8 + 1))
    assert ctl.acc_alt[SUFFIX] == pytest.approx((4 * 0.8 + 1, 0.0))


def test_tree_round_counts_follow_the_path():
    ctl = SpecController(k=3, cost=cost(t=5.0, slope=0.1), decay=1.0)
    ctl.tree, ctl.tree_budget, ctl.tree_depth = (TREE[0], TREE[1], [SUFFIX, SUFFIX, SUFFIX, PRED]), 4, 3
    ctl.shape = Shape(3, (0, 1, 2, 3), 1.0, 1.0)
    ctl.round_tree()
    ctl.on_tree_result([0, 1, 2])          # the whole chain, nothing deeper to try
    assert ctl.acc == {SUFFIX: (3.0, 0.0)} and ctl.acc_alt == {}
    ctl.on_tree_result([])                 # neither root: both rejected, each its own source
    assert ctl.acc == {SUFFIX: (3.0, 1.0)} and ctl.acc_alt == {PRED: (0.0, 1.0)}
    ctl.on_tree_result([0])                # 1 then a miss of 2 below it
    assert ctl.acc == {SUFFIX: (4.0, 2.0)}


def test_without_a_tree_the_choice_is_best_k():
    ctl = SpecController(k=4, cost=cost(t=5.0, slope=0.05))
    ctl.acc[SUFFIX] = (20.0, 0.0)
    assert ctl.on_proposal([1, 2, 3, 4], k_cap=4, source=SUFFIX) == [1, 2, 3, 4]
    assert ctl.shape.k == 4 and not ctl.shape.nodes and ctl.round_tree() is None
    assert ctl.k_choice.startswith("K=4 of 4")


def test_namespace_priors_seed_a_new_generation_scaled_and_bounded():
    pri = NamespacePriors(max_namespaces=2, weight=4.0)
    a = SpecController(k=4)
    assert not pri.seed("docs", a) and a.acc == {}
    a.acc, a.acc_alt = {SUFFIX: (9.0, 1.0)}, {SUFFIX: (1.0, 3.0)}
    pri.learn("docs", a)
    pri.learn("", a)                       # no namespace: nothing kept
    assert len(pri) == 1
    b = SpecController(k=4)
    assert pri.seed("docs", b)
    assert b.acc[SUFFIX] == pytest.approx((3.6, 0.4))      # 9 : 1 scaled to 4 observations
    assert b.acc_alt[SUFFIX] == pytest.approx((1.0, 3.0))
    assert b.p_source(SUFFIX) == pytest.approx(4.6 / 6.0)
    # bounded: the least recently used namespace goes first
    pri.learn("code", a)
    pri.seed("docs", SpecController(k=4))
    pri.learn("mail", a)
    assert len(pri) == 2 and pri.seed("docs", SpecController(k=4))
    assert not pri.seed("code", SpecController(k=4))
