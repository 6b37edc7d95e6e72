"""Spec controller: decides, per round, where the draft comes from. Pure logic.

It runs in the verifier's generation loop (generation_loop.py), which consults
the draft service itself. Per round there are three choices:
    cached  the unused tail of an earlier proposal still continues the
            history (the previous round accepted every draft and the bonus
            token equalled the next cached token): draft from the cache, no
            draft round trip on the round's critical path;
    propose ask the draft service (append the new tokens + propose in one
            stream message) and wait for it before the forward;
    none    plain decode step (K = 0).
In-flight proposal: when a cached or plain round would leave fewer than k
cached tokens, the loop also sends a proposal for the history as it stands
(pending token included) before the round's forward and collects it after:
the draft service works while the engine does. A proposal made on history h
predicts the tokens after h; after the round produced the tokens t
(accepted drafts + bonus) it is still valid when it starts with t, and its
remainder becomes the cache (``on_prefetch``).

Back-off: a proposal that comes back empty or wrong, or a verified draft with
R = 0, is a miss; after m consecutive misses the next proposal waits
min(2 ** (m - 1), max_skip) rounds (plain decode steps in between) and is
sent in flight, beside a plain step, never on the critical path, so free text
that finds no drafts pays no draft hop at all; its proposal is drafted from
the cache the round after, when it still continues the output. Any accepted
draft (R >= 1) resets the back-off.
Fetch: a proposal asks for up to ``fetch_factor * k`` tokens (capped by the
tokens still allowed); the verifier gets at most k of them per round and the
rest is kept as the cache.

Draft length by cost (the gain condition, per round): with T the ms of a
plain decode step, V(K) the ms of a verify of K drafts, o the per-round
overhead and h the draft hop, a round that drafts K tokens yields
E(K) + 1 tokens, where E(K) = p + p^2 + ... + p^K is the expected accepted
run for a per-token acceptance probability p (each draft token is taken only
if every earlier one was). So the controller drafts the K in [1, available]
that maximises (E(K) + 1) / (V(K) + o [+ h]) among the K that pass the gain
condition V(K) [+ h] + o < (E(K) + 1) * T (services/common/economics.py
gain_condition, the formula of the reported verdict too), and drafts nothing
when none passes (plain decoding, 1 / T tokens per ms, is faster); with
drafts at hand but none chosen, every probe_every-th round still drafts 2
tokens, so a stale
estimate is measured again rather than locking drafting out. T, V(K) and o are
measured live by each generation (CostModel: they depend on its context depth);
p is this generation's recency-weighted acceptance of the draft's source
(Beta(1, 1) prior; each source its own: suffix, shared, numbered, prediction), as
in the geometric acceptance model of Leviathan et al. 2023 (section 3.1).
A constrained generation's forced tokens (the grammar source) do not go through
the controller: the loop drafts them whenever the grammar has any, and
``advance`` keeps the cache in step with the tokens those rounds produced.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from echospec.services.common.economics import gain_condition


class CostModel:
    """Live estimates of T, V(K) and the round overhead, in ms (thread-safe).

    Exponential moving averages (weight ``alpha`` on the newest sample):
        t_ms          plain decode step (the verifier's own T)
        v_ms[K]       verify of K drafts (verifier forward + rollback)
        overhead_ms   round wall time in the generation loop minus the forward time
        hop_ms        draft service round trip
    V(K) for a K not yet measured comes from V(K) = T * (1 + slope * K),
    slope fitted to the measured ratios (default ``prior_slope``).
    """

    def __init__(self, alpha: float = 0.1, prior_slope: float = 0.12):
        self.alpha = alpha
        self.prior_slope = prior_slope
        self.t_ms = 0.0
        self.v_ms: dict[int, float] = {}
        self.overhead_ms = 0.5
        self.hop_ms = 0.4
        self._lock = threading.Lock()

    def _ema(self, old: float, new: float) -> float:
        return new if old <= 0 else old + self.alpha * (new - old)

    def observe(self, k: int, v_ms: float, wall_ms: float, t_ms: float, hop_ms: float | None = None) -> None:
        """Record one round: K drafts verified in v_ms, round wall time wall_ms, verifier T t_ms."""
        with self._lock:
            if t_ms > 0:
                self.t_ms = self._ema(self.t_ms, t_ms)
            if v_ms > 0:
                self.v_ms[k] = self._ema(self.v_ms.get(k, 0.0), v_ms)
                if hop_ms is None and wall_ms >= v_ms:
                    self.overhead_ms = self._ema(self.overhead_ms, wall_ms - v_ms)
            if hop_ms is not None and hop_ms > 0:
                self.hop_ms = self._ema(self.hop_ms, hop_ms)

    def slope(self) -> float:
        """Fitted (V(K) / T - 1) / K over the measured K >= 1 (prior_slope if none)."""
        t = self.v_ms.get(0) or self.t_ms
        pts = [(k, v / t - 1.0) for k, v in self.v_ms.items() if k >= 1 and t > 0]
        if not pts:
            return self.prior_slope
        return max(0.0, sum(r for _, r in pts) / sum(k for k, _ in pts))

    def v_est(self, k: int) -> float:
        """Estimated V(K) in ms (T for K = 0)."""
        with self._lock:
            if k in self.v_ms:
                return self.v_ms[k]
            t = self.v_ms.get(0) or self.t_ms or 1.0
            return t * (1.0 + self.slope() * k)


def expected_accepted(p: float, k: int) -> float:
    """E(K) = p + p^2 + ... + p^K: the mean accepted run of K drafts."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= p
        total += term
    return total


def explain_k(k: int, p: float, available: int, cost: CostModel, hop: bool) -> str:
    """Why best_k chose ``k``: the numbers of its gain condition (of K = 1 when k is 0), e.g.
    ``"K=3 of 4: p=0.82 E(K)=2.0, V(K)+o=31.2 ms < (E+1)T=60.3 ms (T=20.1 ms, V(K)/T=1.53)"``."""
    t = cost.v_est(0)
    kk = k if k > 0 else 1
    e = expected_accepted(p, kk)
    lhs = cost.v_est(kk) + (cost.hop_ms if hop else 0.0) + cost.overhead_ms
    ratio = cost.v_est(kk) / t if t > 0 else 0.0
    if k > 0:
        return (f"K={k} of {available}: p={p:.2f} E(K)={e:.2f}, V(K)+o={lhs:.1f} ms < (E+1)T={(e + 1) * t:.1f} ms "
                f"(T={t:.1f} ms, V(K)/T={ratio:.2f}; the most tokens per ms)")
    need = ratio + (lhs - cost.v_est(kk)) / t - 1.0 if t > 0 else 0.0
    return (f"K=0 of {available}: no K pays at p={p:.2f}; K=1 needs V(1)+o={lhs:.1f} ms < (E+1)T="
            f"{(e + 1) * t:.1f} ms (T={t:.1f} ms, V(1)/T={ratio:.2f}: an acceptance above {max(need, 0.0):.2f})")


def best_k(p: float, available: int, cost: CostModel, hop: bool) -> int:
    """The draft length in [0, available] with the most expected tokens per ms, among those
    that pass `metrics.gain_condition` (the formula the reported verdict uses): a K with
    V(K) [+ hop] + overhead < (E(K) + 1) * T.

    Returns 0 when plain decoding is expected to be faster than any draft.
    """
    if available <= 0:
        return 0
    t = cost.v_est(0)
    best, best_rate = 0, 0.0
    for k in range(1, available + 1):
        e = expected_accepted(p, k)
        ok, lhs, _ = gain_condition(e, cost.v_est(k) + (cost.hop_ms if hop else 0.0),
                                    cost.overhead_ms, t)
        rate = (e + 1.0) / lhs
        if ok and rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecController:
    """State of one generation's draft source (see the module docstring)."""

    k: int
    fetch_factor: int = 4
    # 64: on a host whose cores the engine fills, each in-flight probe still takes CPU from the
    # forward beside it; free text then makes about 10 probes in 256 tokens instead of 23
    max_skip: int = 64
    cost: CostModel | None = None      # None: always draft min(k, available) (no cost model)
    decay: float = 0.8                 # recency weight of the acceptance counts per round
    cache: list[int] = field(default_factory=list)
    misses: int = 0
    skip: int = 0
    # per draft source (DraftSource value): [decayed accepted drafts, decayed rejections
    # (rounds that stopped before K)]
    acc: dict = field(default_factory=dict)
    probe_every: int = 8               # with drafts at hand but none chosen: probe every n-th round
    since_probe: int = 0
    cache_source: int = 0              # the draft source of the cache's proposal (DraftSource)
    eager: bool = False                # back-off rounds still ask in flight (a request with a prediction)
    k_choice: str = ""                 # the cost model's last choice of K and why (explain_k)
    _k_key: tuple = ()

    @property
    def p_accept(self) -> float:
        """Recency-weighted per-token acceptance probability of the cache's source, Beta(1, 1)
        prior: a source's misses do not hold back another (a prediction that rejoins the output
        after the suffix index missed drafts at once)."""
        hits, fails = self.acc.get(self.cache_source, (0.0, 0.0))
        return (hits + 1.0) / (hits + fails + 2.0)

    def _choose(self, available: int, hop: bool) -> int:
        if self.cost is None:
            return available
        k = best_k(self.p_accept, available, self.cost, hop)
        # the reason in words, renewed when the choice or the acceptance (to 0.1) changes, so that a
        # steady choice is reported once, not every round
        key = (k, available, round(self.p_accept, 1))
        if available > 0 and key != self._k_key:
            self._k_key = key
            self.k_choice = explain_k(k, self.p_accept, available, self.cost, hop)
        if k == 0 and available > 0:
            # Probe now and then, so a stale or pessimistic estimate of V(K)
            # or p is measured again instead of locking drafting out.
            self.since_probe += 1
            if self.since_probe >= self.probe_every:
                self.since_probe = 0
                return min(available, 2)
        return k

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
            n = self._choose(min(self.k, k_cap, len(self.cache)), hop=False)
            if n == 0:
                return "none", 0
            return "cached", self.cache[:n]
        if self.skip > 0:
            self.skip -= 1
            return "none", 0
        if self.misses > 0:
            return "none", 0     # backing off: the next proposal goes in flight (prefetch_size)
        return "propose", max(1, self.fetch_factor * self.k)

    def on_proposal(self, draft: list[int], k_cap: int, source: int = 0) -> list[int]:
        """Store a proposal (from ``source``); return this round's draft (its first min(k, k_cap) tokens)."""
        self.cache = list(draft)
        self.cache_source = source
        if not self.cache:
            self._miss()
            return []
        return self.cache[:self._choose(min(self.k, k_cap, len(self.cache)), hop=False)]

    def on_result(self, draft: list[int], tokens: list[int]) -> None:
        """Update after a verify of ``draft`` that yielded ``tokens`` (R accepted + bonus)."""
        if not draft:
            # a plain step: the cached tail still holds if it predicted this token
            self.cache = self.cache[1:] if self.cache and tokens and self.cache[0] == tokens[0] else []
            return
        r = len(tokens) - 1
        hits, fails = self.acc.get(self.cache_source, (0.0, 0.0))
        self.acc[self.cache_source] = (hits * self.decay + r,
                                       fails * self.decay + (1.0 if r < len(draft) else 0.0))
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

    def advance(self, tokens: list[int]) -> None:
        """The output moved on by ``tokens`` from a round drafted elsewhere (the grammar's forced
        tokens): the cache still holds when it starts with them; no acceptance is counted."""
        n = len(tokens)
        self.cache = self.cache[n:] if self.cache[:n] == list(tokens) else []

    def _miss(self) -> None:
        self.cache = []
        self.misses += 1
        self.skip = min(2 ** (self.misses - 1), self.max_skip)

    def prefetch_size(self, n_draft: int) -> int:
        """Tokens to ask for in flight during a round that drafts ``n_draft`` cached
        tokens (0: plain step); 0 when the cache still covers the next round or
        the back-off is skipping proposals.
        """
        if self.k <= 0 or (self.skip > 0 and not self.eager):
            return 0
        if len(self.cache) - n_draft - 1 >= self.k:
            return 0
        return max(1, self.fetch_factor * self.k)

    def on_prefetch(self, proposal: list[int], tokens: list[int], source: int = 0) -> None:
        """Take an in-flight proposal made on the history before a round that yielded ``tokens``.

        It replaces the cache when it starts with ``tokens`` (its remainder
        continues the new history); an empty proposal is a miss; one that
        disagrees with the round's tokens is dropped (a miss too when there is no cache).
        """
        if not proposal:
            if not self.cache:
                self._miss()
            return
        n = len(tokens)
        if len(proposal) > n and proposal[:n] == list(tokens):
            self.cache = list(proposal[n:])
            self.cache_source = source
        elif not self.cache:
            self._miss()

    def drop(self) -> None:
        """Forget the cache (the draft service went away)."""
        self.cache = []
