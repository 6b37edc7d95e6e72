"""NgramProposer (tests/ngram_reference.py): literal token arrays, one rule per case."""
import pytest

from echospec.services.draft.proposer import ProposerError
from ngram_reference import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramParams, NgramProposer, propose_once


def test_defaults_are_min_2_max_5():
    p = NgramProposer()
    assert (p.params.min_n, p.params.max_n) == (DEFAULT_MIN_N, DEFAULT_MAX_N) == (2, 5)


def test_default_range_matches_a_bigram():
    # suffix (7, 8) occurred at positions 0..2 -> copy what followed: 9, 1
    assert propose_once([7, 8, 9, 1, 7, 8], k=2) == ([9, 1], 2)


def test_default_range_ignores_a_unigram_repeat():
    # only the single token 7 repeats; min_n = 2 needs a bigram
    assert propose_once([7, 8, 9, 7], k=3) == ([], 0)


def test_empty_draft_is_an_empty_list_never_none():
    draft, n = propose_once([1, 2, 3, 4], k=4)
    assert draft == [] and draft is not None and n == 0


def test_empty_history_gives_empty_draft():
    assert NgramProposer().propose(4) == ([], 0)


def test_k_zero_gives_empty_draft():
    assert propose_once([1, 2, 1, 2], k=0) == ([], 0)


def test_most_recent_occurrence_preferred():
    # (1, 2) is followed by 3 at position 2 and by 4 at position 5; the later one wins
    assert propose_once([1, 2, 3, 1, 2, 4, 1, 2], k=1) == ([4], 2)


def test_longest_n_wins_over_more_recent_shorter_match():
    # (9, 1, 2) matched at 0..3 (followed by 5); (1, 2) alone most recently followed by 6
    params = NgramParams(min_n=2, max_n=3)
    assert propose_once([9, 1, 2, 5, 1, 2, 6, 9, 1, 2], k=1, params=params) == ([5], 3)


def test_k_caps_the_draft():
    assert propose_once([1, 2, 3, 4, 5, 6, 1, 2], k=3) == ([3, 4, 5], 2)


def test_copy_stops_at_k_not_at_history_end_for_self_repeat():
    # [a a a a]: suffix (a a a) last occurred ending at 3; the copy overlaps itself
    params = NgramParams(min_n=1, max_n=3)
    assert propose_once([4, 4, 4, 4], k=5, params=params) == ([4, 4, 4, 4, 4], 3)


def test_period_two_self_repeat_continues_the_period():
    assert propose_once([1, 2, 1, 2, 1, 2], k=5) == ([1, 2, 1, 2, 1], 4)


def test_incremental_append_equals_one_shot():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5]
    p = NgramProposer()
    for i, t in enumerate(tokens):
        p.append([t])
        assert p.propose(4) == propose_once(tokens[:i + 1], k=4)


def test_suffix_itself_is_not_an_earlier_occurrence():
    # the only occurrence of (5, 6) is the suffix: nothing earlier to copy
    assert propose_once([1, 2, 5, 6], k=2) == ([], 0)


@pytest.mark.parametrize("min_n,max_n", [(0, 3), (3, 2), (1, 65)])
def test_bad_ngram_range_raises(min_n, max_n):
    with pytest.raises(ProposerError):
        NgramProposer(NgramParams(min_n, max_n))


@pytest.mark.parametrize("k", [-1, 1025])
def test_bad_k_raises(k):
    with pytest.raises(ProposerError):
        NgramProposer().propose(k)


def test_negative_token_raises():
    with pytest.raises(ProposerError):
        NgramProposer().append([1, -2])
