"""Spec controller: decides, per round, where the draft comes from. Pure logic.

Per round the coordinator has three choices:
    cached  the unused tail of an earlier proposal still continues the
            history (the previous round accepted every draft and the bonus
            token equalled the next cached token): draft from the cache, no
            draft round trip (one hop on the round's critical path);
    propose ask the draft service (append the new tokens + propose in one
            stream message): two hops;
    none    plain decode step (K = 0): one hop.

Back-off: a proposal that comes back empty, or a verified draft with R = 0,
is a miss; after m consecutive misses the next proposal waits
min(2 ** (m - 1), max_skip) rounds (plain decode steps in between), so free
text that finds no drafts pays the draft hop only now and then. Any accepted
draft (R >= 1) resets the back-off.
Fetch: a proposal asks for up to ``fetch_factor * k`` tokens (capped by the
tokens still allowed); the verifier gets at most k of them per round and the
rest is kept as the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecController:
    """State of one generation's draft source (see the module docstring)."""

    k: int
    fetch_factor: int = 4
    max_skip: int = 16
    cache: list[int] = field(default_factory=list)
    misses: int = 0
    skip: int = 0

    def plan(self, k_cap: int) -> tuple[str, list[int] | int]:
        """Choose this round's draft source.

        Args:
            k_cap: the most drafts this round may verify (k, remaining tokens
                and context already applied); <= 0 means no drafts.
        Returns:
            ("cached", draft) | ("propose", n_fetch) | ("none", 0).
        """
        if k_cap <= 0 or self.k <= 0:
            return "none", 0
        if self.cache:
            return "cached", self.cache[:min(self.k, k_cap)]
        if self.skip > 0:
            self.skip -= 1
            return "none", 0
        return "propose", max(1, self.fetch_factor * self.k)

    def on_proposal(self, draft: list[int], k_cap: int) -> list[int]:
        """Store a proposal; return this round's draft (its first min(k, k_cap) tokens)."""
        self.cache = list(draft)
        if not self.cache:
            self._miss()
            return []
        return self.cache[:min(self.k, k_cap)]

    def on_result(self, draft: list[int], tokens: list[int]) -> None:
        """Update after a verify of ``draft`` that yielded ``tokens`` (R accepted + bonus)."""
        if not draft:
            return
        r = len(tokens) - 1
        if r < len(draft):
            self.cache = []
        else:
            rest = self.cache[len(draft):]
            bonus = tokens[-1]
            self.cache = rest[1:] if rest and rest[0] == bonus else []
        if r == 0:
            self._miss()
        else:
            self.misses = 0
            self.skip = 0

    def _miss(self) -> None:
        self.cache = []
        self.misses += 1
        self.skip = min(2 ** (self.misses - 1), self.max_skip)

    def drop(self) -> None:
        """Forget the cache (the draft service went away)."""
        self.cache = []
