"""Suffix automaton over a token sequence: longest earlier match and scored continuations. Pure.

The automaton (Blumer et al. 1985) of a sequence h has one state per class of
substrings with the same set of end positions; ``link`` points to the class of
the longest shorter suffix with more end positions. Appending a token costs
O(1) amortized. After each append, ``link[last]`` is the state of the longest
suffix of h that also ends earlier in h, so the longest earlier match is
known in O(1) (``match``).

Per state the index also keeps ``cnt`` (how many times its strings occur) and
``recent`` (the end position, exclusive, of its most recent occurrence).
Appending adds the new end position to every state on the new state's
suffix-link path; that walk is capped at ``walk_cap`` states (the longest
suffix classes, those that matter for long matches), so the shorter classes
beyond the cap may under-count and point to an older occurrence (a real one).

Continuations (``draft``): from the matched state, every transition c is a
candidate next token (a token that followed an occurrence of the match).
Score = cnt(child) + ``recency_bonus`` for the child occurring most recently;
the highest score wins (ties: the more recent). Its share cnt(child) / sum of
the candidates' cnt is the step's confidence; the draft stops when the product
of the shares drops below ``min_prob`` (SuffixDecoding's rule) or when it
reaches ``ceil(depth_factor * match length)`` tokens, so a long match drafts
long and a short or ambiguous one drafts short. When the walk reaches the
end of the sequence (a state with no continuation) it follows the suffix link
to a shorter context: an overlapping copy, so a period-p repeat drafts past p.

Worked example (min_match=1)::

    h = [1, 2, 3, 1, 2, 4, 1, 2]      longest earlier match (1, 2), cnt 3
    candidates after (1, 2): 3 (cnt 1, at 3) and 4 (cnt 1, most recent, at 6)
    4 wins on recency; share 1/2

Separators: negative tokens may be appended (the shared memory separates its
documents with distinct negative ids); no match crosses one, because each
occurs once, and a draft never contains one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixParams:
    """Drafting knobs of the suffix index (see the module docstring)."""

    min_match: int = 2           # a match shorter than this drafts nothing
    depth_factor: float = 2.0    # a draft is at most ceil(depth_factor * match length) tokens
    min_prob: float = 0.1        # stop when the product of the candidates' shares drops below
    recency_bonus: float = 1.0   # added to the score of the most recent candidate
    walk_cap: int = 48           # suffix-link states updated per append (cnt, recent)


class SuffixAutomaton:
    """Incremental suffix automaton of a token sequence (negative tokens: separators)."""

    def __init__(self, walk_cap: int = 48):
        self.walk_cap = walk_cap
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.cnt: list[int] = [0]
        self.recent: list[int] = [0]
        self.last = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_states(self) -> int:
        return len(self.length)

    def _new(self, length: int, link: int, nxt: dict[int, int], cnt: int, recent: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.cnt.append(cnt)
        self.recent.append(recent)
        return len(self.length) - 1

    def append(self, tok: int) -> None:
        """Append one token (the standard online construction, plus cnt/recent upkeep)."""
        self.tokens.append(tok)
        end = len(self.tokens)
        nxt, link, length = self.next, self.link, self.length
        cur = self._new(length[self.last] + 1, 0, {}, 1, end)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new(length[p] + 1, link[q], dict(nxt[q]), self.cnt[q], self.recent[q])
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        s, steps = link[cur], 0
        while s > 0 and steps < self.walk_cap:
            self.cnt[s] += 1
            self.recent[s] = end
            s = link[s]
            steps += 1

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def match(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the sequence that also ends earlier; (0, 0): none."""
        s = self.link[self.last] if self.last > 0 else 0
        s = max(s, 0)
        return s, self.length[s]

    def walk(self, tokens) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``tokens`` that occurs in the sequence
        (the matching statistic at the end of ``tokens``); O(len(tokens)) amortized."""
        nxt, link, length = self.next, self.link, self.length
        s, n = 0, 0
        for t in tokens:
            while s and t not in nxt[s]:
                s = link[s]
                n = length[s]
            if t in nxt[s]:
                s = nxt[s][t]
                n += 1
            else:
                s, n = 0, 0
        return s, n

    def candidates(self, state: int, bonus: float) -> list[tuple[float, int, int, int]]:
        """Continuations of ``state``: (score, recent, token, child) sorted best first."""
        items = [(self.cnt[c], self.recent[c], t, c) for t, c in self.next[state].items() if t >= 0]
        if not items:
            return []
        newest = max(r for _, r, _, _ in items)
        scored = [(cnt + (bonus if r == newest else 0.0), r, t, c) for cnt, r, t, c in items]
        scored.sort(reverse=True)
        return scored

    def _best(self, state: int, bonus: float) -> tuple[int, int, int] | None:
        """(token, child, total cnt of the candidates) of the best continuation, as the first
        of ``candidates`` (one pass, no sort); None when there is none."""
        cnt, recent = self.cnt, self.recent
        best = None
        newest, total = -1, 0
        for t, c in self.next[state].items():
            if t < 0:
                continue
            total += cnt[c]
            if recent[c] > newest:
                newest = recent[c]
        if total == 0 and newest < 0:
            return None
        for t, c in self.next[state].items():
            if t < 0:
                continue
            key = (cnt[c] + (bonus if recent[c] == newest else 0.0), recent[c], t)
            if best is None or key > best[0]:
                best = (key, t, c)
        return best[1], best[2], total

    def draft(self, state: int, n: int, k: int, params: SuffixParams) -> tuple[list[int], float]:
        """Up to k tokens continuing a match (``state``, length ``n``); returns (draft, confidence).

        Confidence is the product of the chosen candidates' shares (1.0 for an empty draft).
        """
        out: list[int] = []
        if n < params.min_match or k <= 0:
            return out, 1.0
        limit = min(k, max(1, math.ceil(params.depth_factor * n)))
        prob = 1.0
        nxt, link, length = self.next, self.link, self.length
        while len(out) < limit:
            while state > 0 and not any(t >= 0 for t in nxt[state]):
                state = link[state]
                n = length[state]
            if n < params.min_match:
                break
            best = self._best(state, params.recency_bonus)
            if best is None:
                break
            tok, child, total = best
            share = self.cnt[child] / total if total else 1.0
            if prob * share < params.min_prob:
                break
            prob *= share
            out.append(tok)
            state, n = child, n + 1
        return out, prob

    def branches(self, state: int, n: int, k: int, params: SuffixParams, limit: int = 8
                 ) -> list[list[int]]:
        """Other continuations beside ``draft``'s (token trees): at each step of the draft's
        walk, every candidate it did not take, and every token that followed a shorter context
        there (the suffix links down to ``min_match``) and is not a candidate already, whose
        share among its state's candidates, times the product of the shares before it, is at
        least ``min_prob``; each becomes a whole sequence from the match's end (the draft's
        first d tokens, the other token, then its own ``draft``), at most k tokens. Best first
        (that product, then the step: shallower first); at most ``limit``.

        Worked example (min_match=1): h = [5, 6, 1, 0, 5, 6, 2, 0, 5, 6] matches (0, 5, 6),
        followed by 2 only: the draft is [2, 0, 5, 6]. The shorter context (5, 6) was followed
        by 1 too (share 1/2: cnt 1 of 2): the branch [1, 0, 5, 6].
        """
        if n < params.min_match or k <= 0:
            return []
        limit_k = min(k, max(1, math.ceil(params.depth_factor * n)))
        found: list[tuple[float, int, list[int]]] = []
        path: list[int] = []
        prob = 1.0
        nxt, link, length = self.next, self.link, self.length
        while len(path) < limit_k:
            while state > 0 and not any(t >= 0 for t in nxt[state]):
                state = link[state]
                n = length[state]
            if n < params.min_match:
                break
            cands = self.candidates(state, params.recency_bonus)
            if not cands:
                break
            total = sum(self.cnt[c] for _, _, _, c in cands)
            others = [(self.cnt[c] / total if total else 1.0, t, c, n) for _, _, t, c in cands[1:]]
            # shorter contexts (suffix links) may have been followed by other tokens too
            seen = {t for _, _, t, _ in cands}
            s = link[state]
            while s > 0 and length[s] >= params.min_match:
                sc = self.candidates(s, params.recency_bonus)
                tot = sum(self.cnt[c] for _, _, _, c in sc)
                for _, _, t, c in sc:
                    if t not in seen:
                        seen.add(t)
                        others.append((self.cnt[c] / tot if tot else 1.0, t, c, length[s]))
                s = link[s]
            for share, t, c, m in others:
                if prob * share >= params.min_prob:
                    rest, _ = self.draft(c, m + 1, k - len(path) - 1, params)
                    found.append((prob * share, len(path), path + [t] + rest))
            _, _, tok, child = cands[0]
            share = self.cnt[child] / total if total else 1.0
            if prob * share < params.min_prob:
                break
            prob *= share
            path.append(tok)
            state, n = child, n + 1
        found.sort(key=lambda f: (-f[0], f[1]))
        return [seq[:k] for _, _, seq in found[:limit]]
