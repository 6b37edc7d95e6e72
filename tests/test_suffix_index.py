"""Suffix automaton (services/draft/suffix_index.py): literal token arrays, one rule per case,
and a randomized check of the longest match against a brute-force matcher."""
import random

from echospec.services.draft.suffix_index import SuffixAutomaton, SuffixParams
from ngram_reference import NgramParams, propose_once

P1 = SuffixParams(min_match=1)


def sam_of(tokens, walk_cap=48):
    s = SuffixAutomaton(walk_cap)
    s.extend(tokens)
    return s


def draft_of(tokens, k, params=P1):
    s = sam_of(tokens)
    state, n = s.match()
    return s.draft(state, n, k, params)[0]


def brute_longest_earlier(h):
    """The longest suffix of h that also ends at an earlier position."""
    L = len(h)
    for n in range(L - 1, 0, -1):
        suf = h[L - n:]
        for e in range(n, L):
            if h[e - n:e] == suf:
                return n
    return 0


def test_longest_match_is_the_longest_earlier_suffix():
    # (9, 1, 2) ended at 3; (1, 2) alone is also earlier but shorter
    assert sam_of([9, 1, 2, 5, 1, 2, 6, 9, 1, 2]).match()[1] == 3


def test_no_earlier_occurrence_is_no_match_and_empty_draft():
    s = sam_of([1, 2, 3, 4])
    assert s.match() == (0, 0)
    assert draft_of([1, 2, 3, 4], 4) == []


def test_empty_sequence_drafts_nothing():
    assert draft_of([], 4) == []


def test_match_shorter_than_min_match_drafts_nothing():
    assert draft_of([7, 8, 9, 7], 3, SuffixParams(min_match=2)) == []
    assert draft_of([7, 8, 9, 7], 1, SuffixParams(min_match=1)) == [8]


def test_recency_breaks_a_frequency_tie():
    # (1, 2) followed by 3 once and by 4 once; 4 is the more recent
    assert draft_of([1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]


def test_frequency_beats_recency_by_more_than_the_bonus():
    # 3 followed (1, 2) three times, 4 once (the most recent): 3 > 1 + bonus 1
    assert draft_of([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], 1) == [3]


def test_confidence_limits_draft_length_by_match_length():
    # match length 2 with depth_factor 1: at most 2 tokens though k is 8
    params = SuffixParams(min_match=2, depth_factor=1.0)
    assert draft_of([5, 6, 7, 8, 9, 10, 11, 5, 6], 8, params) == [7, 8]
    params = SuffixParams(min_match=2, depth_factor=3.0)
    assert draft_of([5, 6, 7, 8, 9, 10, 11, 5, 6], 8, params) == [7, 8, 9, 10, 11, 5]


def test_ambiguous_continuation_stops_at_min_prob():
    # after (1,) come 2, 3, 4, 5 once each: share 1/4 < min_prob 0.3 -> nothing
    params = SuffixParams(min_match=1, min_prob=0.3)
    assert draft_of([1, 2, 1, 3, 1, 4, 1, 5, 1], 2, params) == []
    assert draft_of([1, 2, 1, 3, 1, 4, 1, 5, 1], 1, SuffixParams(min_match=1, min_prob=0.2)) == [5]


def test_overlap_copy_continues_a_period_past_the_history():
    params = SuffixParams(min_match=1, depth_factor=4.0)
    assert draft_of([4, 4, 4, 4], 5, params) == [4, 4, 4, 4, 4]
    assert draft_of([1, 2, 1, 2, 1, 2], 5, SuffixParams(min_match=2)) == [1, 2, 1, 2, 1]


def test_separators_are_never_drafted_and_never_matched_across():
    s = SuffixAutomaton()
    s.extend([1, 2, 3, -1, 1, 2])
    state, n = s.match()
    assert n == 2 and s.draft(state, n, 4, P1)[0] == [3]   # stops at the separator
    t = SuffixAutomaton()
    t.extend([5, 6, -1, 7, 8])
    assert t.walk([6, 7])[1] == 1      # (6, 7) spans the separator: only (7,) matches


def test_walk_finds_the_matching_statistic():
    s = sam_of([3, 1, 4, 1, 5, 9, 2, 6])
    assert s.walk([7, 7, 1, 5, 9]) == (s.walk([1, 5, 9])[0], 3)
    assert s.walk([8, 8])[1] == 0


def test_counts_are_occurrences_when_the_walk_is_uncapped():
    s = sam_of([1, 2, 1, 2, 1, 2, 3], walk_cap=1000)
    st = s.walk([1, 2])[0]
    assert s.cnt[st] == 3 and s.recent[st] == 6


def test_randomized_longest_match_equals_brute_force():
    rng = random.Random(7)
    for trial in range(60):
        alphabet = rng.choice([2, 3, 5, 20])
        h = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        s = SuffixAutomaton()
        for i, t in enumerate(h):
            s.append(t)
            assert s.match()[1] == brute_longest_earlier(h[:i + 1]), (trial, h[:i + 1])
        # the first drafted token follows an earlier occurrence of the matched suffix
        state, n = s.match()
        d = s.draft(state, n, 1, P1)[0]
        if d:
            suf = h[len(h) - n:]
            follows = {h[e] for e in range(n, len(h)) if h[e - n:e] == suf}
            assert d[0] in follows


def test_exact_repeats_draft_what_the_ngram_reference_drafts():
    # a text seen once before: the suffix index and the n-gram reference copy the same tokens
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    h = text + [99] + text[:4]
    params = SuffixParams(min_match=2, depth_factor=4.0)
    assert draft_of(h, 5, params) == propose_once(h, 5, NgramParams(2, 5))[0] == [15, 16, 17, 18, 19]


def test_the_one_pass_choice_is_the_best_ranked_candidate():
    rng = random.Random(11)
    for _ in range(100):
        s = sam_of([rng.randrange(4) for _ in range(rng.randrange(2, 80))])
        for st in range(s.n_states):
            ranked = s.candidates(st, 1.0)
            best = s._best(st, 1.0)
            assert (ranked == []) == (best is None)
            if ranked:
                assert (ranked[0][2], ranked[0][3]) == best[:2]
