"""The exact-repeat n-gram rule: the reference the suffix index is checked against on exact
repeats (tests/test_suffix_index.py), with its literal tests in tests/test_proposer.py and a
drafter of bench/draft_replay.py. Pure: no gRPC, no engine.

Rule (one call of :meth:`NgramProposer.propose`): take the longest suffix of
the history whose length n lies in [min_n, max_n] and that occurred earlier in
the history; of its earlier occurrences take the most recent one; the draft is
the up-to-k tokens that followed it. When no suffix in that range occurred
earlier the draft is the empty list (never None).

The copy may run into the suffix itself (an overlapping, LZ77-style copy): a
token to be copied from position >= len(history) is the draft token already
produced at that offset. So a period-p repeat drafts k tokens, not just p.

Worked example (min_n=1, max_n=3, k=4)::

    history = [5, 6, 7, 9, 5, 6, 7]
    suffix n=3: (5, 6, 7) ended earlier at position 3 -> copy from 3: [9, 5, 6, 7]
    history = [1, 1, 1, 1], suffix (1, 1, 1) ended earlier at 3 -> [1, 1, 1, 1]

Index: for every n in [min_n, max_n] a dict maps an n-gram (tuple) to the end
position (exclusive) of its most recent occurrence. The n-grams ending at
positions < len(history) are indexed lazily, on the next propose, so the cost
of a call is O((tokens appended since the last call + 1) * (max_n - min_n + 1)),
independent of the history's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from echospec.services.draft.proposer import MAX_K_LIMIT, ProposerError

DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 5
MAX_N_LIMIT = 64


@dataclass(frozen=True)
class NgramParams:
    """n-gram range of the matcher: suffix lengths n with min_n <= n <= max_n."""

    min_n: int = DEFAULT_MIN_N
    max_n: int = DEFAULT_MAX_N

    def validate(self) -> "NgramParams":
        """Return self; raise ProposerError unless 1 <= min_n <= max_n <= MAX_N_LIMIT."""
        if not (1 <= self.min_n <= self.max_n <= MAX_N_LIMIT):
            raise ProposerError(
                f"n-gram range must satisfy 1 <= min_n <= max_n <= {MAX_N_LIMIT}, "
                f"got min_n={self.min_n} max_n={self.max_n}")
        return self


class NgramProposer:
    """Per-session token history with an incremental n-gram index.

    Args:
        params: the n-gram range (validated).
    Raises:
        ProposerError: invalid n-gram range.
    """

    def __init__(self, params: NgramParams = NgramParams()):
        self.params = params.validate()
        self.history: list[int] = []
        # index[n - min_n]: n-gram -> end position (exclusive) of its most recent occurrence
        self._index: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(params.max_n - params.min_n + 1)]
        self._indexed_end = 0  # n-grams ending at positions <= this are indexed

    def __len__(self) -> int:
        return len(self.history)

    def append(self, tokens: Iterable[int]) -> None:
        """Append tokens (ints >= 0) to the history. O(len(tokens)).

        Raises:
            ProposerError: a token id is negative or not an int.
        """
        new = list(tokens)
        for t in new:
            if not isinstance(t, int) or t < 0:
                raise ProposerError(f"token ids must be ints >= 0, got {t!r}")
        self.history.extend(new)

    def _index_until(self, end: int) -> None:
        """Index every n-gram ending at positions in (indexed_end, end]."""
        h = self.history
        lo = self.params.min_n
        for e in range(self._indexed_end + 1, end + 1):
            for i, table in enumerate(self._index):
                n = lo + i
                if e - n < 0:
                    break
                table[tuple(h[e - n:e])] = e
        self._indexed_end = max(self._indexed_end, end)

    def propose(self, k: int) -> tuple[list[int], int]:
        """Propose up to k draft tokens continuing the history.

        Args:
            k: maximum draft length, 0 <= k <= MAX_K_LIMIT.
        Returns:
            (draft, n): draft is a list of 0..k token ids (empty when nothing
            matches or k == 0); n is the matched suffix length (0 if none).
        Raises:
            ProposerError: k out of range.
        """
        if not (0 <= k <= MAX_K_LIMIT):
            raise ProposerError(f"k must be in [0, {MAX_K_LIMIT}], got {k}")
        h = self.history
        length = len(h)
        # Earlier occurrences end at positions < length: index those first.
        self._index_until(length - 1)
        if k == 0:
            return [], 0
        lo = self.params.min_n
        for i in range(len(self._index) - 1, -1, -1):
            n = lo + i
            if n > length - 1:  # an earlier occurrence needs at least one more token
                continue
            start = self._index[i].get(tuple(h[length - n:]))
            if start is None:
                continue
            draft: list[int] = []
            for j in range(k):
                src = start + j
                draft.append(h[src] if src < length else draft[src - length])
            return draft, n
        return [], 0


def propose_once(tokens: Sequence[int], k: int, params: NgramParams = NgramParams()
                 ) -> tuple[list[int], int]:
    """Stateless form: build a proposer over ``tokens`` and propose up to k tokens.

    Returns and raises as :meth:`NgramProposer.propose` (and append).
    """
    p = NgramProposer(params)
    p.append(tokens)
    return p.propose(k)
