"""Draft proposers. Pure: no gRPC, no engine.

``DraftProposer`` is the draft service's session (one per generation): the
client's prediction, numbered lists, the suffix automaton of
suffix_index.py over the history and the namespace's shared memory
(memory.py); its docstring gives the order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from echospec.v1 import common_pb2
from echospec.services.draft.suffix_index import SuffixAutomaton, SuffixParams

MIN_N_LIMIT = 64
MAX_K_LIMIT = 1024


class ProposerError(ValueError):
    """Bad proposer argument (min_n, k, token id)."""


def check_min_n(min_n: int) -> int:
    """Return ``min_n``, the shortest suffix match the suffix index drafts from.

    Raises:
        ProposerError: min_n outside [1, MIN_N_LIMIT].
    """
    if not 1 <= min_n <= MIN_N_LIMIT:
        raise ProposerError(f"min_n must be in [1, {MIN_N_LIMIT}], got {min_n}")
    return min_n


# --- the draft session: several sources over a suffix automaton --------------------------------

# echospec.v1.DraftSource values, the draft each proposal came from (the proto is the source)
SOURCE_NONE = common_pb2.DRAFT_SOURCE_UNSPECIFIED
SOURCE_SUFFIX = common_pb2.DRAFT_SOURCE_SUFFIX
SOURCE_SHARED = common_pb2.DRAFT_SOURCE_SHARED
SOURCE_NUMBERED = common_pb2.DRAFT_SOURCE_NUMBERED
SOURCE_PREDICTION = common_pb2.DRAFT_SOURCE_PREDICTION


class PredictionTracker:
    """Where the output stands in a client's prediction (token ids).

    While the output agrees with the prediction, ``pos`` advances with it and
    the draft is prediction[pos:pos + k]. A token that disagrees loses sync;
    from then on each new output token tries to resynchronise: the last
    ``resync_n`` output tokens are looked up in the prediction and the first
    occurrence starting at or after the position where sync was lost wins
    (else the latest one before it), so an edit that inserts, deletes or
    replaces text rejoins the prediction where the output does.

    Example (resync_n=2): prediction [1, 2, 3, 4, 5, 6], output 1, 2, 9, 9, 4, 5
    -> synced through 2, lost at 9, rejoins after (4, 5) -> draft [6].
    """

    def __init__(self, prediction: list[int], resync_n: int = 3):
        self.pred = list(prediction)
        self.resync_n = resync_n
        self.pos = 0
        self.synced = bool(self.pred)
        self.recent: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        for e in range(resync_n, len(self.pred) + 1):
            self._ends.setdefault(tuple(self.pred[e - resync_n:e]), []).append(e)

    def feed(self, tok: int) -> None:
        """One more output token."""
        self.recent.append(tok)
        if len(self.recent) > self.resync_n:
            del self.recent[0]
        if self.synced and self.pos < len(self.pred) and self.pred[self.pos] == tok:
            self.pos += 1
            return
        self.synced = False
        if len(self.recent) == self.resync_n:
            ends = self._ends.get(tuple(self.recent))
            if ends:
                later = [e for e in ends if e - self.resync_n >= self.pos]
                self.pos = later[0] if later else ends[-1]
                self.synced = True

    def propose(self, k: int) -> list[int]:
        return self.pred[self.pos:self.pos + k] if self.synced else []


class NumberTracker:
    """Numbered-list drafts: "3." after "2." a line ago -> "4.".

    ``digits`` are the token ids of "0".."9" (a tokenizer that writes each
    digit as its own token); empty turns the source off. Each maximal run of
    digit tokens that has ended is recorded under the 1..``max_ctx`` tokens
    before it. The rule applies where the history ends with such a context and
    its latest runs there count up by one to x: the next number there is x + 1.

    ``propose`` (no copied draft; two runs x - 1, x suffice): the digits of
    x + 1, then a copy of what followed x (the rest of the latest item).
    ``correct``: a copied draft (suffix or shared memory) that writes x there,
    repeating the latest item, gets x + 1, the rest of the copy kept.
    With ``line_breaks`` (ids of tokens ending a line) only numbers that start a
    line count, and two runs x - 1, x suffice for a correction; without, any
    context counts and a correction needs three (x - 2, x - 1, x). A copy that
    writes any other number is left alone (code: "= 1" copied after "= 0" and
    "= 1" is no list).
    """

    def __init__(self, digits: list[int], max_ctx: int = 3, line_breaks: Sequence[int] = ()):
        self.value = {t: i for i, t in enumerate(digits)} if len(digits) == 10 else {}
        self.line_breaks = frozenset(line_breaks)
        self.need = 2 if self.line_breaks else 3   # runs counting up before a copy is corrected
        self.digits = list(digits)
        self.max_ctx = max_ctx
        self.runs: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # ctx -> [(value, end)], 3 latest
        # counting: separator (the non-digit tokens before a number) -> [(value, start, end)], 3 latest
        self.seq: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        self._start = -1

    def feed(self, h: list[int], i: int) -> None:
        """h[i] was appended."""
        if not self.value:
            return
        if h[i] in self.value:
            if self._start < 0:
                self._start = i
            return
        if self._start >= 0:
            s, self._start = self._start, -1
            sep = self._separator(h, s)
            if i - s <= 9 and sep:
                lst = self.seq.setdefault(sep, [])
                lst.append((int("".join(str(self.value[t]) for t in h[s:i])), s, i))
                del lst[:-3]
            if i - s <= 9 and (not self.line_breaks or (s > 0 and h[s - 1] in self.line_breaks)):
                x = int("".join(str(self.value[t]) for t in h[s:i]))
                for j in range(1, min(self.max_ctx, s) + 1):
                    lst = self.runs.setdefault(tuple(h[s - j:s]), [])
                    lst.append((x, i))
                    del lst[:-3]

    def _rule(self, h: list[int], extra: Sequence[int], need: int = 2
              ) -> tuple[list[int], int] | None:
        """Where the rule applies after h + extra: (the digit tokens still to write, end of
        the latest run). The ``need`` latest runs after the context count up by one to x;
        the tokens to write are those of x + 1 after any of its digits already written."""
        look = h[-(self.max_ctx + 10):] + list(extra)
        p = len(look)
        while p > 0 and look[p - 1] in self.value:
            p -= 1
        written, tail = look[p:], look[:p][-self.max_ctx:]
        if not self.value or not tail or len(written) >= 10:
            return None
        for j in range(len(tail), 0, -1):
            lst = self.runs.get(tuple(tail[-j:]))
            if lst and len(lst) >= need and all(b[0] == a[0] + 1 for a, b in zip(lst[-need:], lst[-need + 1:])):
                nxt = self._digits(lst[-1][0] + 1)
                if nxt[:len(written)] != written or len(nxt) == len(written):
                    return None
                return nxt[len(written):], lst[-1][1]
        return None

    def _digits(self, x: int) -> list[int]:
        return [self.digits[int(c)] for c in str(x)]

    def _separator(self, h: list[int], s: int) -> tuple[int, ...]:
        """The up to ``max_ctx`` non-digit tokens right before position s, after the number
        before them (empty where a number or the start is right before s)."""
        j = s
        while j > 0 and s - j < self.max_ctx and h[j - 1] not in self.value:
            j -= 1
        if j == 0 or h[j - 1] not in self.value:
            return ()                 # no number before the separator (or it is too long)
        return tuple(h[j:s])

    def _shift(self, item: Sequence[int], d: int) -> list[int]:
        """``item`` with each number in it (a run of digit tokens) plus d."""
        out, i = [], 0
        while i < len(item):
            if item[i] in self.value:
                j = i
                while j < len(item) and item[j] in self.value:
                    j += 1
                out += self._digits(int("".join(str(self.value[t]) for t in item[i:j])) + d)
                i = j
            else:
                out.append(item[i])
                i += 1
        return out

    def count(self, h: list[int], k: int) -> list[int]:
        """Counting ("1, 2, 3, " -> "4, 5, 6, ...", "1. 1\n2. 2\n3. 3\n" -> "4. 4\n5. 5\n..."):
        where the three latest numbers after one separator (the up to ``max_ctx`` non-digit
        tokens before a number) count up by one, what lies between each two is the same but
        for its own numbers, one more each time, and the history ends with the next such item
        (or inside its number): the numbers after them, each followed by that item with its
        numbers shifted along, up to k tokens; [] otherwise."""
        if not self.value or k <= 0:
            return []
        p = len(h)
        while p > 0 and h[p - 1] in self.value:
            p -= 1
        written = h[p:]
        sep = self._separator(h, p)
        lst = self.seq.get(sep) if sep else None
        if not lst or len(lst) < 3 or len(written) >= 10:
            return []
        a, b, c = lst[-3:]
        if b[0] != a[0] + 1 or c[0] != b[0] + 1 or p - c[2] > 64:
            return []
        item = h[c[2]:p]              # between the latest number and the one being written
        if self._shift(h[a[2]:b[1]], 2) != item or self._shift(h[b[2]:c[1]], 1) != item:
            return []
        x = c[0] + 1
        nxt = self._digits(x)
        if nxt[:len(written)] != written or len(nxt) == len(written):
            return []
        out, d = nxt[len(written):], 0
        while len(out) < k:
            d += 1
            out += self._shift(item, d) + self._digits(x + d)
        return out[:k]

    def propose(self, h: list[int], k: int) -> list[int]:
        """The next number after the history h (its digits still to write), then a copy of
        what followed the latest one (the rest of its item); up to k tokens; [] when the rule
        does not apply."""
        rule = self._rule(h, ()) if k > 0 else None
        if rule is None:
            return []
        digits, end = rule
        return (digits + h[end:end + k])[:k]

    def correct(self, h: list[int], draft: list[int]) -> list[int] | None:
        """``draft`` with its first number where the rule applies replaced by the rule's
        (same length cap); None when it has none or it is already right. Without line breaks
        only a number that repeats the latest item's is replaced."""
        for j in range(len(draft)):
            starts = draft[j] in self.value and (j == 0 or draft[j - 1] not in self.value)
            partial = j == 0 and bool(h) and h[-1] in self.value   # h ends inside a number
            if not (starts or partial):
                continue
            e = j
            while e < len(draft) and draft[e] in self.value:
                e += 1
            if e == len(draft):
                return None            # the number may go on past the draft
            rule = self._rule(h, draft[:j], need=self.need)
            if rule is None:
                continue
            digits, end = rule
            if draft[j:e] == digits:
                return None
            if not self.line_breaks:
                # only a copy of the latest item's number (h[end - len(digits) ...] is that number)
                latest = []
                q = end - 1
                while q >= 0 and h[q] in self.value:
                    latest.insert(0, h[q])
                    q -= 1
                written = len(self._digits(int("".join(str(self.value[t]) for t in latest)) + 1)) - len(digits)
                if j == e or draft[j:e] != latest[written:]:
                    continue
            return (draft[:j] + digits + draft[e:])[:len(draft)]
        return None


def merge_tree(seqs: Sequence[Sequence[int]], budget: int) -> tuple[list[int], list[int]]:
    """``merge_tree_origins`` without the origins."""
    tokens, parents, _ = merge_tree_origins(seqs, budget)
    return tokens, parents


def merge_tree_origins(seqs: Sequence[Sequence[int]], budget: int
                       ) -> tuple[list[int], list[int], list[int]]:
    """Token sequences (each continuing the same history) merged into a prefix-sharing tree:
    (tokens, parents), parents[i] in [-1, i) (-1: the history's last token), as the engine's
    es_forward_tree takes them. The first sequence is nodes 0 .. len - 1 in order (a chain,
    never cut); the others add their nodes beyond the shared prefix in order while the tree
    holds fewer than ``budget`` nodes (a sequence cut short keeps its head).

    Returns (tokens, parents, origins): origins[i] is the index in ``seqs`` of the sequence
    that added node i (a node shared by several sequences: the first of them).

    Example: [[1, 2, 3], [1, 4], [5]], budget 5 -> tokens [1, 2, 3, 4, 5], parents
    [-1, 0, 1, 0, -1], origins [0, 0, 0, 1, 2]; budget 4 -> tokens [1, 2, 3, 4], parents
    [-1, 0, 1, 0].
    """
    tokens: list[int] = []
    parents: list[int] = []
    origins: list[int] = []
    children: dict[tuple[int, int], int] = {}   # (parent node, token) -> node
    for j, seq in enumerate(seqs):
        node = -1
        for t in seq:
            nxt = children.get((node, t))
            if nxt is None:
                if j > 0 and len(tokens) >= budget:
                    break
                nxt = len(tokens)
                tokens.append(t)
                parents.append(node)
                origins.append(j)
                children[(node, t)] = nxt
            node = nxt
    return tokens, parents, origins


@dataclass(frozen=True)
class DraftParams:
    """A draft session's settings: the suffix index's knobs and the prediction's resync length."""

    suffix: SuffixParams = SuffixParams()
    resync_n: int = 3


class DraftProposer:
    """One generation's draft session: prompt + output history and its sources.

    Sources, first non-empty wins: the client's prediction (while synced with
    the output); counting ("1, 2, 3, 4, " -> "5, 6, ...", NumberTracker.count,
    source: numbered); the session's suffix index or the namespace's shared memory,
    whichever matches the longer suffix (the session on a tie; the other when
    the first drafts nothing); the numbered rule alone. A copied draft that
    repeats the latest item's number where the numbered rule applies gets the
    next number instead (source: numbered), so a copied list line does not
    repeat the old number.

    Args:
        params: DraftParams. prediction: the client's expected output (token ids).
        digits: token ids of "0".."9" (numbered lists; [] off). line_breaks: ids of tokens
            ending a line (numbered-list numbers start a line; [] any context).
        memory: SharedMemory (None: none). namespace: its scope ("" shares nothing).
    Raises:
        ProposerError: a prediction or digit token is negative.
    """

    def __init__(self, params: DraftParams = DraftParams(), prediction: Sequence[int] = (),
                 digits: Sequence[int] = (), memory=None, namespace: str = "",
                 line_breaks: Sequence[int] = ()):
        for t in list(prediction) + list(digits):
            if not isinstance(t, int) or t < 0:
                raise ProposerError(f"token ids must be ints >= 0, got {t!r}")
        self.params = params
        self.sp = params.suffix
        self.history: list[int] = []
        self.sam = SuffixAutomaton(self.sp.walk_cap)
        self.prompt_len = -1           # set by start_output
        self.prediction = PredictionTracker(list(prediction), params.resync_n) if prediction else None
        self.numbers = NumberTracker(list(digits), line_breaks=line_breaks)
        self.memory = memory
        self.namespace = namespace

    def __len__(self) -> int:
        return len(self.history)

    def start_output(self) -> None:
        """Mark the end of the prompt: tokens appended from now on are output."""
        if self.prompt_len < 0:
            self.prompt_len = len(self.history)

    def append(self, tokens: Iterable[int]) -> None:
        """Append tokens (ints >= 0). Raises ProposerError on a bad id."""
        new = list(tokens)
        for t in new:
            if not isinstance(t, int) or t < 0:
                raise ProposerError(f"token ids must be ints >= 0, got {t!r}")
        for t in new:
            self.history.append(t)
            self.sam.append(t)
            self.numbers.feed(self.history, len(self.history) - 1)
            if self.prediction is not None and self.prompt_len >= 0:
                self.prediction.feed(t)

    def propose(self, k: int) -> tuple[list[int], int, int]:
        """Up to k draft tokens; returns (draft, matched length, source) with source one of
        the SOURCE_* values (SOURCE_NONE and [] when no source has a draft).

        Raises:
            ProposerError: k out of range.
        """
        if not (0 <= k <= MAX_K_LIMIT):
            raise ProposerError(f"k must be in [0, {MAX_K_LIMIT}], got {k}")
        if k == 0:
            return [], 0, SOURCE_NONE
        if self.prediction is not None and self.prompt_len >= 0:
            d = self.prediction.propose(k)
            if d:
                return d, len(self.prediction.recent), SOURCE_PREDICTION
        d = self.numbers.count(self.history, k)
        if d:
            return d, 0, SOURCE_NUMBERED
        state, n = self.sam.match()
        shared_n = -1
        sd: list[int] = []
        if self.memory is not None and self.namespace:
            sd, shared_n, _ = self.memory.propose(self.namespace, self.history, k, self.sp)
        order = [SOURCE_SUFFIX, SOURCE_SHARED] if n >= shared_n else [SOURCE_SHARED, SOURCE_SUFFIX]
        for src in order:
            if src == SOURCE_SUFFIX:
                d, _ = self.sam.draft(state, n, k, self.sp)
                m = n
            else:
                d, m = (sd, shared_n) if shared_n > 0 else ([], 0)
            if d:
                fixed = self.numbers.correct(self.history, d) if self.numbers.value else None
                if fixed is not None:
                    return fixed, m, SOURCE_NUMBERED
                return d, m, src
        d = self.numbers.propose(self.history, k)
        if d:
            return d, 0, SOURCE_NUMBERED
        return [], 0, SOURCE_NONE

    def propose_tree(self, k: int, nodes: int) -> tuple[list[int], list[int], int, int]:
        """``propose_tree_sources`` without the nodes' sources: (tokens, parents, matched
        length, source)."""
        tokens, parents, _, m, source = self.propose_tree_sources(k, nodes)
        return tokens, parents, m, source

    def propose_tree_sources(self, k: int, nodes: int
                             ) -> tuple[list[int], list[int], list[int], int, int]:
        """A token tree of up to ``nodes`` nodes: (tokens, parents, node sources, matched
        length, source).

        Its first branch (nodes 0 .. len - 1, a chain) is ``propose(k)``'s draft, with its
        matched length and source, whatever the budget. The other branches, while the budget
        lasts (merge_tree): the other sources' drafts (the prediction, the suffix index, the
        shared memory, the numbered rule), then the suffix index's other continuations where
        its walk had several (SuffixAutomaton.branches), each at most k tokens. ``nodes`` 0:
        the chain alone (parents [-1, 0, 1, ...]). node sources[i]: the SOURCE_* value of the
        draft that added node i (the first branch's: ``source``).

        Raises:
            ProposerError: k or nodes out of range.
        """
        if not 0 <= nodes <= MAX_K_LIMIT:
            raise ProposerError(f"tree_nodes must be in [0, {MAX_K_LIMIT}], got {nodes}")
        primary, m, source = self.propose(k)
        seqs: list[tuple[list[int], int]] = [(primary, source)]
        if k > 0 and nodes > len(primary):
            if self.prediction is not None and self.prompt_len >= 0:
                seqs.append((self.prediction.propose(k), SOURCE_PREDICTION))
            state, n = self.sam.match()
            seqs.append((self.sam.draft(state, n, k, self.sp)[0], SOURCE_SUFFIX))
            if self.memory is not None and self.namespace:
                seqs.append((self.memory.propose(self.namespace, self.history, k, self.sp)[0],
                             SOURCE_SHARED))
            seqs.append((self.numbers.propose(self.history, k), SOURCE_NUMBERED))
            seqs.extend((b, SOURCE_SUFFIX) for b in self.sam.branches(state, n, k, self.sp))
        seqs = [(s, src) for s, src in seqs if s]
        tokens, parents, origins = merge_tree_origins([s for s, _ in seqs], max(nodes, len(primary)))
        return tokens, parents, [seqs[j][1] for j in origins], m, source

    def remember(self) -> None:
        """Add this session's history to its namespace's shared memory (none for "")."""
        if self.memory is not None and self.namespace:
            self.memory.add(self.namespace, self.history)
