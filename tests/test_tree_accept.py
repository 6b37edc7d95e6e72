"""The verifier's token-tree logic (services/verifier/tree_accept.py): literal trees, one rule
per case, and the chain case against the chain accept rule."""
import random

from echospec.services.verifier.sessions import longest_accepted_prefix
from echospec.services.verifier.tree_accept import (accept, first_branch, is_chain, reroot,
                                                    round_tree, trim, verify_tree)

# a -> b -> c and a -> d, and e: tokens 10, 11, 12, 13, 14
TOK = [10, 11, 12, 13, 14]
PAR = [-1, 0, 1, 0, -1]


def test_is_chain():
    assert is_chain([]) and is_chain([-1, 0, 1])
    assert not is_chain(PAR) and not is_chain([-1, -1])


def test_first_branch_follows_first_children():
    assert first_branch(TOK, PAR) == [10, 11, 12]
    assert first_branch([], []) == []


def test_reroot_walks_into_a_branch():
    assert reroot(TOK, PAR, []) == (TOK, PAR)
    assert reroot(TOK, PAR, [10]) == ([11, 12, 13], [-1, 0, -1])
    assert reroot(TOK, PAR, [10, 13]) == ([], [])
    assert reroot(TOK, PAR, [14]) == ([], [])
    assert reroot(TOK, PAR, [10, 12]) is None
    assert reroot(TOK, PAR, [99]) is None


def test_trim_by_budget_and_depth():
    assert trim(TOK, PAR, 3, 9) == ([10, 11, 12], [-1, 0, 1])
    assert trim(TOK, PAR, 9, 1) == ([10, 14], [-1, -1])
    assert trim(TOK, PAR, 4, 2) == ([10, 11, 13, 14], [-1, 0, 0, -1])


def test_verify_tree_puts_the_pending_token_on_top():
    assert verify_tree(7, TOK, PAR) == ([7, 10, 11, 12, 13, 14], [-1, 0, 1, 2, 1, 0])


def test_accept_from_a_non_first_branch():
    t, p = verify_tree(7, TOK, PAR)   # nodes: 0=7, 1=10, 2=11, 3=12, 4=13, 5=14
    # after 7 the model says 10, after 10 it says 13 (the second branch), after 13 it says 99
    argmax = [10, 13, 0, 0, 99, 0]
    assert accept(t, p, argmax) == ([0, 1, 4], [10, 13], 99)


def test_accept_nothing_and_everything():
    t, p = verify_tree(7, TOK, PAR)
    assert accept(t, p, [55, 0, 0, 0, 0, 0]) == ([0], [], 55)
    assert accept(t, p, [14, 0, 0, 0, 0, 66]) == ([0, 5], [14], 66)
    assert accept(t, p, [10, 11, 12, 77, 0, 0]) == ([0, 1, 2, 3], [10, 11, 12], 77)


def test_accept_on_a_chain_is_the_chain_rule():
    rng = random.Random(5)
    for _ in range(200):
        k = rng.randint(0, 6)
        drf = [rng.randint(0, 3) for _ in range(k)]
        argmax = [rng.randint(0, 3) for _ in range(k + 1)]
        t, p = verify_tree(9, drf, list(range(-1, k - 1)))
        path, acc, bonus = accept(t, p, argmax)
        r = longest_accepted_prefix(drf, argmax)
        assert (acc, bonus, path) == (drf[:r], argmax[r], list(range(r + 1)))


def test_round_tree_keeps_the_chain_then_other_nodes_by_budget_and_depth():
    assert round_tree(TOK, PAR, [10, 11], 4, 2) == ([10, 11, 13, 14], [-1, 0, 0, -1])
    # the whole chain is kept whatever the budget; nothing beside it fits: a chain -> None
    assert round_tree(TOK, PAR, [10, 11, 12], 2, 9) is None
    assert round_tree(TOK, PAR, [10, 11, 12], 4, 9) == ([10, 11, 12, 13], [-1, 0, 1, 0])


def test_round_tree_none_when_the_tree_does_not_spell_the_chain():
    assert round_tree(TOK, PAR, [10, 12], 9, 9) is None
    assert round_tree(TOK, PAR, [99], 9, 9) is None


def test_round_tree_chain_from_a_non_first_branch():
    # the controller drafts [10, 13] (the tree's second branch after 10): still verified with 11
    assert round_tree(TOK, PAR, [10, 13], 3, 2) == ([10, 11, 13], [-1, 0, 0])


def test_round_tree_renumbers_in_index_order():
    # roots 10 and 11; 12 under 11, 13 under 10
    t, p = [10, 11, 12, 13], [-1, -1, 1, 0]
    assert round_tree(t, p, [10, 13], 9, 2) == ([10, 11, 12, 13], [-1, -1, 1, 0])
    assert round_tree(t, p, [10, 13], 3, 2) == ([10, 11, 13], [-1, -1, 0])
    assert round_tree(t, p, [10], 9, 1) == ([10, 11], [-1, -1])
