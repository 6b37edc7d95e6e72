"""Draft sources of services/draft/proposer.py (prediction, numbered lists, suffix, shared
memory) and the shared memory's isolation and bounds: literal token arrays, one rule per case."""
import random

import pytest

from echospec.services.draft.memory import SharedMemory
from echospec.services.draft.proposer import (SOURCE_NONE, SOURCE_NUMBERED, SOURCE_PREDICTION,
                                              SOURCE_SHARED, SOURCE_SUFFIX, DraftProposer,
                                              PredictionTracker, ProposerError)

DIGITS = list(range(100, 110))      # token ids of "0".."9" in these tests
DOT, NL = 50, 51


def num(x):
    return [DIGITS[int(c)] for c in str(x)]


def session(prompt, **kw):
    p = DraftProposer(**kw)
    p.append(prompt)
    p.start_output()
    return p


# --- prediction ----------------------------------------------------------------------------------

def test_prediction_drafts_from_the_start_of_the_output():
    p = session([1, 2, 3], prediction=[7, 8, 9, 10])
    assert p.propose(3) == ([7, 8, 9], 0, SOURCE_PREDICTION)


def test_prediction_follows_the_output_while_it_agrees():
    p = session([1], prediction=[7, 8, 9, 10])
    p.append([7, 8])
    assert p.propose(4)[0] == [9, 10]


def test_prediction_resyncs_after_an_edit():
    t = PredictionTracker([1, 2, 3, 4, 5, 6], resync_n=2)
    for tok in [1, 2, 9, 9]:
        t.feed(tok)
    assert t.propose(3) == []               # lost at the first 9
    for tok in [4, 5]:
        t.feed(tok)
    assert t.propose(3) == [6]              # rejoined after (4, 5)


def test_prediction_resync_prefers_the_next_occurrence_forward():
    t = PredictionTracker([1, 2, 0, 1, 2, 7, 1, 2, 8], resync_n=2)
    for tok in [1, 2, 0, 1, 2, 5, 1, 2]:    # synced to 5, then an edit, then (1, 2)
        t.feed(tok)
    assert t.propose(1) == [8]              # the (1, 2) after position 5, not the first one


def test_prediction_ahead_of_the_suffix_index():
    p = session([4, 5, 6, 4, 5], prediction=[9, 9])
    assert p.propose(2)[2] == SOURCE_PREDICTION


def test_exhausted_or_lost_prediction_falls_back_to_the_suffix_index():
    p = session([4, 5, 6, 7, 8], prediction=[4])
    p.append([9, 5, 6])                     # off the prediction at once
    assert p.propose(2) == ([7, 8], 2, SOURCE_SUFFIX)


def test_empty_prediction_is_no_source():
    p = session([1, 2, 3], prediction=[])
    assert p.propose(3) == ([], 0, SOURCE_NONE)


def test_prompt_tokens_do_not_advance_the_prediction():
    p = session([7, 8], prediction=[7, 8, 9])
    assert p.propose(3)[0] == [7, 8, 9]


def test_negative_prediction_token_raises():
    with pytest.raises(ProposerError):
        DraftProposer(prediction=[1, -1])


# --- numbered lists ------------------------------------------------------------------------------

def test_numbered_list_drafts_the_next_number_then_the_latest_items_rest():
    # "\n1. a\n2. b\n" -> "3. b\n" (the number, then a copy of what followed "2")
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 62, NL]
    p = session(h, digits=DIGITS)
    assert p.propose(4) == (num(3) + [DOT, 62, NL], 0, SOURCE_NUMBERED)


def test_numbered_list_crosses_to_two_digits():
    h = [NL] + num(8) + [DOT, 61, NL] + num(9) + [DOT, 62, NL]
    assert session(h, digits=DIGITS).propose(3)[0] == num(10) + [DOT]


def test_numbered_list_needs_a_step_of_one():
    h = [NL] + num(2) + [DOT, 61, NL] + num(5) + [DOT, 62, NL]
    assert session(h, digits=DIGITS).propose(4)[2] != SOURCE_NUMBERED


def test_numbered_list_off_without_digit_tokens():
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 62, NL]
    assert session(h).propose(4)[2] != SOURCE_NUMBERED


def test_numbered_list_not_in_the_middle_of_a_number():
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 62, NL] + num(3)
    assert session(h, digits=DIGITS).propose(4)[2] != SOURCE_NUMBERED


# --- counting ------------------------------------------------------------------------------------

COMMA, SPACE = 70, 71


def counted(*xs):
    out = []
    for x in xs:
        out += num(x) + [COMMA, SPACE]
    return out


def test_counting_drafts_the_next_numbers_with_their_separator():
    # "6, 7, 8, 9, " -> "10, 11, 12, ..." (the copies would repeat "7, 8, 9, ")
    p = session([1, 2] + counted(6, 7, 8, 9), digits=DIGITS, line_breaks=[NL])
    assert p.propose(9) == (num(10) + [COMMA, SPACE] + num(11) + [COMMA, SPACE] + num(12)[:1], 0,
                            SOURCE_NUMBERED)


def test_counting_inside_a_number_writes_its_rest_first():
    p = session(counted(16, 17, 18, 19) + num(2), digits=DIGITS)
    assert p.propose(4)[0] == num(20)[1:] + [COMMA, SPACE] + num(21)[:1]


def test_counting_shifts_the_numbers_inside_the_items():
    # "1. 1\n2. 2\n3. 3\n4. 4\n" -> "5. 5\n6. 6\n..." (the numbered rule's copy would write "5. 4\n")
    h = []
    for x in range(1, 5):
        h += num(x) + [DOT, SPACE] + num(x) + [NL]
    p = session([NL] + h, digits=DIGITS, line_breaks=[NL])
    assert p.propose(12) == (num(5) + [DOT, SPACE] + num(5) + [NL] + num(6) + [DOT, SPACE] + num(6) + [NL]
                             + num(7) + [DOT], 0, SOURCE_NUMBERED)
    # items that differ in more than their numbers are no counting (a list's own rule drafts them)
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 62, NL] + num(3) + [DOT, 63, NL] + num(4) + [DOT, 64, NL]
    assert session(h, digits=DIGITS, line_breaks=[NL]).numbers.count(h, 6) == []


@pytest.mark.parametrize("h", [
    counted(7, 8, 9),                                 # three numbers: not yet counting
    counted(1, 2, 3, 5),                              # a step of two
    counted(1, 2) + num(3) + [COMMA, 72, SPACE] + num(4) + [COMMA, SPACE],  # mixed separators
    counted(1, 2, 3, 4) + [72],                       # something else since the latest number
    counted(1, 2, 3, 4) + num(6),                     # the next number is not the one written
])
def test_counting_needs_three_numbers_a_step_of_one_and_one_separator(h):
    assert session(h, digits=DIGITS, line_breaks=[NL]).numbers.count(h, 6) == []


# --- suffix index and shared memory -----------------------------------------------------------------

def test_suffix_source_copies_an_earlier_repeat():
    assert session([5, 6, 7, 8, 9, 5, 6]).propose(3) == ([7, 8, 9], 2, SOURCE_SUFFIX)


def test_no_namespace_shares_nothing():
    mem = SharedMemory()
    a = session([1, 2, 3, 4, 5, 6], memory=mem, namespace="")
    a.remember()
    assert mem.namespaces() == []
    b = session([1, 2, 3], memory=mem, namespace="")
    assert b.propose(3) == ([], 0, SOURCE_NONE)


def test_shared_memory_drafts_an_earlier_generation_of_the_namespace():
    mem = SharedMemory()
    session([1, 2, 3, 4, 5, 6], memory=mem, namespace="A").remember()
    b = session([9, 3, 4], memory=mem, namespace="A")
    assert b.propose(2) == ([5, 6], 2, SOURCE_SHARED)


def test_namespaces_never_draft_each_others_tokens():
    mem = SharedMemory()
    session([1, 2, 3, 10, 11, 12], memory=mem, namespace="A").remember()
    session([1, 2, 3, 20, 21, 22], memory=mem, namespace="B").remember()
    a = session([7, 1, 2, 3], memory=mem, namespace="A").propose(3)
    b = session([7, 1, 2, 3], memory=mem, namespace="B").propose(3)
    assert a == ([10, 11, 12], 3, SOURCE_SHARED)
    assert b == ([20, 21, 22], 3, SOURCE_SHARED)
    c = session([7, 1, 2, 3], memory=mem, namespace="C").propose(3)
    assert c == ([], 0, SOURCE_NONE)


def test_a_token_trees_branches_never_hold_another_namespaces_tokens():
    # a tree's other branches draw on the shared memory beside the chain's source: the session's
    # own namespace's only, and none for "" ("" never shares: memory.py)
    mem = SharedMemory()
    session([1, 2, 3, 10, 11, 12], memory=mem, namespace="A").remember()
    session([1, 2, 3, 20, 21, 22], memory=mem, namespace="B").remember()
    h = [1, 2, 3, 30, 31, 32, 7, 1, 2, 3]   # its own suffix index continues with 30 31 32
    trees = {ns: session(h, memory=mem, namespace=ns).propose_tree_sources(3, 16) for ns in ("A", "B", "")}
    for ns, own, other in (("A", {10, 11, 12}, {20, 21, 22}), ("B", {20, 21, 22}, {10, 11, 12})):
        tokens, _, sources, _, _ = trees[ns]
        assert {30, 31, 32} | own <= set(tokens) and not other & set(tokens), (ns, tokens)
        assert SOURCE_SHARED in sources
    tokens, _, sources, _, _ = trees[""]
    assert set(tokens) == {30, 31, 32} and SOURCE_SHARED not in sources, tokens
    # and a chain for "" with nothing of its own to copy: no draft, the named memories beside it
    assert session([7, 1, 2, 3], memory=mem, namespace="").propose(3) == ([], 0, SOURCE_NONE)


def test_randomized_isolation_conflicting_histories():
    # A's tokens are even, B's odd: no draft in one namespace holds the other's tokens
    rng = random.Random(3)
    mem = SharedMemory(max_tokens=300)
    for _ in range(30):
        for ns, par in (("A", 0), ("B", 1)):
            toks = [2 * rng.randrange(6) + par for _ in range(rng.randrange(5, 40))]
            session(toks, memory=mem, namespace=ns).remember()
    for _ in range(200):
        for ns, par in (("A", 0), ("B", 1)):
            recent = [2 * rng.randrange(6) + par for _ in range(6)]
            d, _, _ = mem.propose(ns, recent, 8, DraftProposer().sp)
            assert all(t % 2 == par for t in d), (ns, d)
    mem.check_integrity()


def test_eviction_keeps_the_bound_and_drafts_only_kept_tokens():
    mem = SharedMemory(max_tokens=50, max_namespaces=2)
    rng = random.Random(5)
    for i in range(40):
        doc = [1000 + i] + [rng.randrange(8) for _ in range(rng.randrange(3, 30))]
        mem.add("A", doc)
        mem.check_integrity()
        assert mem.n_tokens("A") <= 50
        kept = mem.kept_tokens("A")
        for _ in range(5):
            recent = [rng.randrange(8) for _ in range(4)]
            d, _, _ = mem.propose("A", recent, 8, DraftProposer().sp)
            assert set(d) <= kept
    mem.add("B", [1, 2])
    mem.add("C", [3, 4])                     # a third namespace evicts the least recent (A)
    assert mem.namespaces() == ["B", "C"]
    mem.check_integrity()


def test_a_longer_sequence_than_the_cap_keeps_its_tail():
    mem = SharedMemory(max_tokens=10)
    mem.add("A", list(range(30)))
    assert mem.n_tokens("A") == 10
    assert mem.propose("A", [25, 26], 3, DraftProposer().sp)[0] == [27, 28, 29]
    mem.check_integrity()


def test_a_copied_list_line_takes_the_next_number():
    # the suffix copy of "a .\n" would continue with "3"; the numbered rule makes it "4"
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 61, NL] + num(3) + [DOT, 61]
    draft, _, source = session(h, digits=DIGITS).propose(4)
    assert source == SOURCE_NUMBERED and draft[:3] == [NL] + num(4) + [DOT]


def test_a_proposal_never_waits_for_an_index_being_extended():
    mem = SharedMemory()
    mem.add("A", [1, 2, 3, 4])
    idx = mem._spaces["A"]
    with idx.lock:                          # as while another thread adds a generation
        assert mem.propose("A", [1, 2], 2, DraftProposer().sp) == ([], 0, 1.0)
    assert mem.propose("A", [1, 2], 2, DraftProposer().sp)[0] == [3, 4]


def test_a_copied_number_that_is_not_the_latest_item_is_left_alone():
    # code, not a list: "a = 0\nb = 1\na = " copies "0" (the rule after "= " would say 2)
    A, B, EQ = 70, 71, 72
    h = [A, EQ] + num(0) + [NL, B, EQ] + num(1) + [NL, A, EQ]
    draft, _, source = session(h, digits=DIGITS).propose(3)
    assert source == SOURCE_SUFFIX and draft[:1] == num(0)


def test_with_line_breaks_only_numbers_starting_a_line_count():
    A, EQ = 70, 72
    # "= 0 ... = 1 ... = " is not a list once line breaks are known: no numbered draft
    h = [A, EQ] + num(0) + [NL, A, EQ] + num(1) + [NL, A, EQ]
    assert session(h, digits=DIGITS, line_breaks=[NL]).propose(3)[2] != SOURCE_NUMBERED
    # a list at line starts: two items are enough to correct a copy of the latest
    h = [NL] + num(1) + [DOT, 61, NL] + num(2) + [DOT, 61]
    draft, _, source = session(h, digits=DIGITS, line_breaks=[NL]).propose(4)
    assert source == SOURCE_NUMBERED and draft[:3] == [NL] + num(3) + [DOT]


def test_a_number_half_written_is_completed():
    # "...\n8. a\n9. a\n1" -> "0" then the copy (the history wrote the "1" of "10")
    h = [NL] + num(8) + [DOT, 61, NL] + num(9) + [DOT, 61, NL] + num(1)
    draft, _, source = session(h, digits=DIGITS, line_breaks=[NL]).propose(3)
    assert source == SOURCE_NUMBERED and draft == num(0) + [DOT, 61]
