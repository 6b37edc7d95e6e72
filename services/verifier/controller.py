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
draft (R >= 1) resets the back-off. Eager (``eager``: a request with a
prediction, or a verifier whose engine leaves a CPU free): the skipped rounds
still ask in flight, each beside its plain step, so the first draft after a
stretch of free text is not held back by the back-off (only blocking
proposals are); the price is no in-engine runs of those plain steps.
An in-flight proposal lost only to a round's bonus token, after the round
accepted drafts, is no miss: the next round asks again, blocking.
Fetch: a proposal asks for up to ``fetch_factor * k`` tokens (capped by the
tokens still allowed); the verifier gets at most k of them per round and the
rest is kept as the cache. A generation whose rounds may run in the engine (``runs``: greedy
chains, generation_loop's verify runs) asks for ``run_fetch_factor * k``: a run verifies round
after round of the cache while every draft is kept, with no Python between them.

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
tokens, and with an acceptance of probe_up_p or more but fewer drafts chosen
than at hand, a round after probe_up_every such rounds (then 2, 4, ... 16 times
as many) drafts them all, so a stale
estimate (a V measured once beside other work, or on a cold second thread) is
measured again rather than locking drafting out or holding K down. T, V(K) and o are
measured live by each generation (CostModel: they depend on its context depth);
p is this generation's recency-weighted acceptance of the draft's source
(Beta(1, 1) prior; each source its own: suffix, shared, numbered, prediction; the draft
prior's one-token drafts are the generation loop's, outside the controller), as
in the geometric acceptance model of Leviathan et al. 2023 (section 3.1).
A constrained generation's forced tokens (the grammar source) do not go through
the controller: the loop drafts them whenever the grammar has any, and
``advance`` keeps the cache in step with the tokens those rounds produced.

Shape by cost (token trees, a tree budget n_max > 0): when a kept proposal tree continues the
history (``tree``: tokens, parents, each node's source), the controller chooses the round's
shape among the chains above and trees cut from it (``best_shape``): for each K whose chain the
tree spells, the chain's K nodes, then the tree's other nodes in index order (the proposal's
order), a node kept only with its parent and at most k_cap deep, the chain's own nodes past K
left out; each prefix of n <= max(K, n_max) nodes holding a node beside the chain is a
candidate. The chain is the tree of width 1: with no tree, or none that pays more, the round
drafts the chain as above.
Tree model: q(i) is node i's chance of being the greedy token at its position given its parent
was accepted and its earlier siblings were not: its source's first-guess acceptance when it is
its parent's first child, else its source's alternative acceptance (a separate recency-weighted
count, Beta(1, 3) prior: a second guess is taken to be right less often). Siblings exclude each
other (one greedy token per position), so P(path to i accepted) = P(parent) * prod over earlier
siblings s (1 - q(s)) * q(i), and E(tree) = the sum of P over its nodes: the geometric E(K) is
the width-1 case. This is a model, not a measurement: it takes a source's guesses to be
independent of how deep they are and of one another, and the alternatives of one source to share
one rate. After a tree round each node tried on the accepted path counts for its source (a hit
for the node taken; a rejection for each sibling before it, or for every child where none was
taken). Cost: V_tree(n) measured live in its own table (CostModel.v_tree_ms), V(K = n) until
then. The shape with the most (E + 1) / (V + o [+ h]) among those passing the gain condition
wins, a tree only when it beats the best chain (ties: the chain); none passing: no draft, with
the probe rule. ``k_choice`` says the choice and its numbers (``explain_shape``), the round's
StepResult the E and ms expected.
Per namespace (``NamespacePriors``, kept by the verifier): a generation with a draft namespace
starts from that namespace's counts, scaled to a few observations, and adds its own at its end;
a bounded LRU table.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Sequence

from echospec.services.common.economics import gain_condition


class CostModel:
    """Live estimates of T, V(K) and the round overhead, in ms (thread-safe).

    Exponential moving averages (weight ``alpha`` on the newest sample):
        t_ms          plain decode step (the verifier's own T)
        v_ms[K]       verify of K drafts (verifier forward + rollback)
        overhead_ms   round wall time in the generation loop minus the forward time
        hop_ms        draft service round trip
        v_tree_ms[n]  verify of a token tree of n draft nodes (its own table: the tree's
                      attention mask and the kept path's KV compaction differ from a chain's)
    A measured V(K) above the measured V of a larger K counts as that V (a verify of more
    drafts never costs less; such a figure is stale: ``_measured``), and a sample under half
    of V(K)'s estimate replaces it (the estimate was taken beside other work). V(K) for a K not yet
    measured comes from V(K) = T * (1 + slope * K), slope fitted to those ratios (default
    ``prior_slope``); V_tree(n) not yet measured is V(K = n): the same rows through the same
    weights.
    """

    def __init__(self, alpha: float = 0.1, prior_slope: float = 0.12):
        self.alpha = alpha
        self.prior_slope = prior_slope
        self.t_ms = 0.0
        self.v_ms: dict[int, float] = {}
        self.v_tree_ms: dict[int, float] = {}
        self.overhead_ms = 0.5
        self.hop_ms = 0.4
        self._lock = threading.Lock()

    def _ema(self, old: float, new: float) -> float:
        return new if old <= 0 else old + self.alpha * (new - old)

    def observe(self, k: int, v_ms: float, wall_ms: float, t_ms: float, hop_ms: float | None = None,
                tree: bool = False) -> None:
        """Record one round: K drafts (a tree of K nodes: ``tree``) verified in v_ms, round wall
        time wall_ms, verifier T t_ms."""
        with self._lock:
            if t_ms > 0:
                self.t_ms = self._ema(self.t_ms, t_ms)
            if v_ms > 0:
                table = self.v_tree_ms if tree else self.v_ms
                old = table.get(k, 0.0)
                # a verify never runs faster than it costs: a sample under half the estimate says
                # the estimate came from a forward beside other work or on a cold thread, and
                # replaces it (a K measured rarely would else keep a stale figure for many rounds)
                table[k] = v_ms if v_ms < 0.5 * old else self._ema(old, v_ms)
                if hop_ms is None and wall_ms >= v_ms:
                    self.overhead_ms = self._ema(self.overhead_ms, wall_ms - v_ms)
            if hop_ms is not None and hop_ms > 0:
                self.hop_ms = self._ema(self.hop_ms, hop_ms)

    def _measured(self) -> dict[int, float]:
        """The measured V(K), K >= 1, each no more than any measured V of a larger K: a verify of
        more drafts never costs less, so a V(K) above a larger K's is stale (measured once, on a
        cold thread pool or beside a burst of other work, and never again because it looked
        dear) and the larger K's figure stands for it."""
        out: dict[int, float] = {}
        low = float("inf")
        for k in sorted((k for k in self.v_ms if k >= 1), reverse=True):
            low = min(low, self.v_ms[k])
            out[k] = low
        return out

    def slope(self) -> float:
        """Fitted (V(K) / T - 1) / K over the measured K >= 1 (``_measured``; prior_slope if
        none)."""
        return self._slope(self._measured())

    def _slope(self, measured: dict[int, float]) -> float:
        t = self.v_ms.get(0) or self.t_ms
        pts = [(k, v / t - 1.0) for k, v in measured.items() if t > 0]
        if not pts:
            return self.prior_slope
        return max(0.0, sum(r for _, r in pts) / sum(k for k, _ in pts))

    def v_est(self, k: int) -> float:
        """Estimated V(K) in ms (T for K = 0)."""
        with self._lock:
            if k == 0 and 0 in self.v_ms:
                return self.v_ms[0]
            return self._v_table(k)[k]

    def v_table(self, n: int) -> list[float]:
        """V(K) for K = 0 .. n in ms (``v_est`` of each, under one lock and one fitted slope)."""
        with self._lock:
            return self._v_table(n)

    def _v_table(self, n: int) -> list[float]:
        t = self.v_ms.get(0) or self.t_ms or 1.0
        measured = self._measured()
        slope = None
        out = []
        for k in range(n + 1):
            v = self.v_ms.get(0) if k == 0 else measured.get(k)
            if v is None:
                if slope is None:
                    slope = self._slope(measured)
                v = t * (1.0 + slope * k)
            out.append(v)
        return out

    def v_tree_est(self, n: int) -> float:
        """Estimated V of a tree of n draft nodes in ms (V(K = n) until one is measured)."""
        with self._lock:
            v = self.v_tree_ms.get(n)
        return v if v is not None else self.v_est(n)


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


@dataclass(frozen=True)
class Shape:
    """A round's draft shape and what the cost model expects of it (ms).

    k: the chain's drafts (a tree: the chain drafts it holds; 0 with no nodes: no draft).
    nodes: a tree: the indices of its kept nodes in the tree scored, ascending; (): a chain.
    e: expected accepted drafts. ms: expected round time, V [+ hop] + overhead.
    """

    k: int = 0
    nodes: tuple = ()
    e: float = 0.0
    ms: float = 0.0

    @property
    def rate(self) -> float:
        """Expected tokens per ms, (E + 1) / ms (0 when not costed)."""
        return (self.e + 1.0) / self.ms if self.ms > 0 else 0.0

    def describe(self) -> str:
        if self.nodes:
            return f"tree of {len(self.nodes)} nodes (chain K={self.k} + {len(self.nodes) - self.k})"
        return f"chain K={self.k}" if self.k else "no draft"


def first_children(parents: Sequence[int]) -> list[bool]:
    """Per node: True when it is its parent's first child (the draft's first guess there)."""
    seen: set[int] = set()
    out = []
    for q in parents:
        out.append(q not in seen)
        seen.add(q)
    return out


def node_probs(parents: Sequence[int], p_node: Sequence[float]) -> list[float]:
    """P(the path from the history to node i is all accepted), per node of a tree.

    p_node[i]: the chance that node i's token is the greedy token at its position, given its
    parent was accepted and every earlier sibling's token was not. Siblings exclude each other
    (one greedy token per position), so
        P(i) = P(parent) * prod over earlier siblings s of (1 - p_node[s]) * p_node[i]
    (P(-1) = 1); the P(i) of siblings sum to at most P(parent).

    Example: parents [-1, 0, -1], p_node [0.6, 0.5, 0.3] -> [0.6, 0.3, 0.4 * 0.3 = 0.12].
    """
    out: list[float] = []
    miss: dict[int, float] = {}   # parent -> prod (1 - p) of its children so far
    for i, q in enumerate(parents):
        m = miss.get(q, 1.0)
        out.append((1.0 if q < 0 else out[q]) * m * p_node[i])
        miss[q] = m * (1.0 - p_node[i])
    return out


def chain_nodes(tokens: Sequence[int], parents: Sequence[int], chain: Sequence[int]) -> list[int]:
    """The nodes spelling ``chain`` from the roots, as far as the tree has it."""
    out: list[int] = []
    node = -1
    for t in chain:
        node = next((i for i in range(node + 1, len(parents)) if parents[i] == node and tokens[i] == t),
                    None)
        if node is None:
            break
        out.append(node)
    return out


def best_shape(p: float, available: int, cost: CostModel, hop: bool,
               tree: tuple | None = None, p_node: Sequence[float] = (), chain: Sequence[int] = (),
               budget: int = 0, depth: int = 0) -> tuple[Shape, Shape]:
    """The round's shape with the most expected tokens per ms among those passing
    ``gain_condition``, and the best chain (Shape() when none passes).

    Chains: K = 1 .. available drafts, E(K) the geometric sum of the chain's acceptance p, cost
    V(K) (``best_k``'s). Trees, when ``tree`` (tokens, parents) continues the history: for each
    K whose chain[:K] the tree spells, the chain's K nodes then the tree's other nodes in index
    order, a node kept only with its parent and at most ``depth`` deep, the chain's nodes past K
    left out; every prefix of that order of n <= max(K, budget) nodes that holds a node beside the
    chain is a candidate, with E = the sum of ``node_probs`` (p_node per node) over its nodes and
    cost V_tree(n). A tree is chosen only when its rate beats the best chain's (ties: the chain).
    """
    hop_ms = cost.hop_ms if hop else 0.0
    v = cost.v_table(max(available, 0))
    t, o = v[0], cost.overhead_ms
    best_chain = Shape()
    best_k, best_e, best_lhs, best_rate = 0, 0.0, 0.0, 0.0
    e, term = 0.0, 1.0
    for k in range(1, available + 1):   # E(K) grown term by term: expected_accepted(p, k)
        term *= p
        e += term
        ok, lhs, _ = gain_condition(e, v[k] + hop_ms, o, t)
        rate = (e + 1.0) / lhs if lhs > 0 else 0.0
        if ok and rate > best_rate:
            best_k, best_e, best_lhs, best_rate = k, e, lhs, rate
    if best_k:
        best_chain = Shape(best_k, (), best_e, best_lhs)
    if tree is None or budget <= 0:
        return best_chain, best_chain
    tokens, parents = tree[0], tree[1]
    probs = node_probs(parents, p_node)
    path = chain_nodes(tokens, parents, chain[:available])
    d: list[int] = []
    for q in parents:
        d.append(1 if q < 0 else d[q] + 1)
    best, best_rate, best_kept = best_chain, best_chain.rate, None
    for k in range(1, len(path) + 1):
        kept = set(path[:k])
        order = list(path[:k])
        e = sum(probs[i] for i in order)
        past = set(path[k:])
        for i, q in enumerate(parents):
            if len(order) >= max(k, budget):
                break
            if i in kept or i in past or d[i] > depth or (q >= 0 and q not in kept):
                continue
            kept.add(i)
            order.append(i)
            e += probs[i]
            ok, lhs, _ = gain_condition(e, cost.v_tree_est(len(order)) + hop_ms, cost.overhead_ms, t)
            rate = (e + 1.0) / lhs if lhs > 0 else 0.0
            if ok and rate > best_rate:
                best, best_rate, best_kept = Shape(k, (), e, lhs), rate, list(order)
    if best_kept is not None:
        best = Shape(best.k, tuple(sorted(best_kept)), best.e, best.ms)
    return best, best_chain


def explain_shape(shape: Shape, chain: Shape, p: float, available: int, cost: CostModel,
                  hop: bool) -> str:
    """Why best_shape chose ``shape``: a chain or no draft as ``explain_k``; a tree against the
    best chain, e.g. ``"tree of 7 nodes (chain K=3 + 4): E 2.41 in V+o 5.1 ms, 0.669 tok/ms >
    chain K=3: E 1.90 in 4.3 ms, 0.674 tok/ms (T=2.9 ms)"``."""
    if not shape.nodes:
        return explain_k(shape.k, p, available, cost, hop)
    vs = (f"{chain.describe()}: E {chain.e:.2f} in {chain.ms:.1f} ms, {chain.rate:.3f} tok/ms"
          if chain.k else "no chain pays")
    return (f"{shape.describe()}: E {shape.e:.2f} in V+o {shape.ms:.1f} ms, {shape.rate:.3f} tok/ms > "
            f"{vs} (T={cost.v_est(0):.1f} ms, chain p={p:.2f})")


@dataclass
class SpecController:
    """State of one generation's draft source (see the module docstring)."""

    k: int
    fetch_factor: int = 4
    # a generation whose rounds may run in the engine (``runs``: es_verify_run) asks for more: a run
    # goes on over the whole proposal with no Python between its rounds
    run_fetch_factor: int = 16
    runs: bool = False
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
    probe_up_p: float = 0.7            # ... and with fewer chosen than at hand at this acceptance
    probe_up_every: int = 3            # ... all of them after n such rounds, then 2 n, 4 n, ... 16 n
    probe_up_gap: int = 0              # the current wait (0: probe_up_every)
    since_probe_up: int = 0
    cache_source: int = 0              # the draft source of the cache's proposal (DraftSource)
    # back-off rounds still ask in flight (a request with a prediction, or a verifier whose engine
    # leaves a CPU free: the probe then runs beside the forward at no cost to it)
    eager: bool = False
    k_choice: str = ""                 # the cost model's last choice of shape and why (explain_shape)
    _k_key: tuple = ()
    # token trees: the alternatives' acceptance per source (a node beside its parent's first
    # child), [decayed accepted, decayed rejected], prior Beta(alt_prior)
    acc_alt: dict = field(default_factory=dict)
    alt_prior: tuple = (1.0, 3.0)
    # the tree at hand for the next choice (tokens, parents, node sources) continuing the history
    # (None: chains), its node budget and depth; set by the loop before plan / on_proposal
    tree: tuple | None = None
    tree_budget: int = 0
    tree_depth: int = 0
    shape: Shape = Shape()             # this round's choice (plan / on_proposal)
    _round: tuple = ()                 # a tree round's (parents, sources, first-child flags)
    _hit: bool = False                 # this round verified a draft and accepted some (on_result)
    _missed: bool = False              # this round verified a draft and accepted none

    @property
    def p_accept(self) -> float:
        """Recency-weighted per-token acceptance probability of the cache's source, Beta(1, 1)
        prior: a source's misses do not hold back another (a prediction that rejoins the output
        after the suffix index missed drafts at once)."""
        return self.p_source(self.cache_source)

    def p_source(self, source: int, alt: bool = False) -> float:
        """The acceptance of ``source``'s drafts: its first guesses (Beta(1, 1) prior) or, with
        ``alt``, its alternatives beside another node (Beta(alt_prior))."""
        if alt:
            hits, fails = self.acc_alt.get(source, (0.0, 0.0))
            return (hits + self.alt_prior[0]) / (hits + fails + self.alt_prior[0] + self.alt_prior[1])
        hits, fails = self.acc.get(source, (0.0, 0.0))
        return (hits + 1.0) / (hits + fails + 2.0)

    def _choose(self, available: int, hop: bool) -> int:
        if self.cost is None:
            self.shape = Shape(available)
            return available
        tree, p_node = None, ()
        if self.tree is not None and self.tree_budget > 0 and available > 0:
            tree = self.tree
            first = first_children(tree[1])
            p_node = [self.p_source(src, not f) for src, f in zip(tree[2], first)]
        p = self.p_accept
        shape, chain = best_shape(p, available, self.cost, hop, tree, p_node, self.cache,
                                  self.tree_budget, self.tree_depth)
        self.shape = shape
        k = shape.k
        # the reason in words, renewed when the choice or the acceptance (to 0.1) changes, so that a
        # steady choice is reported once, not every round (nor when only the drafts at hand do:
        # a cache shrinks every round, and the words cost more than the choice)
        key = (k, len(shape.nodes), round(p, 1))
        if available > 0 and key != self._k_key:
            self._k_key = key
            self.k_choice = explain_shape(shape, chain, p, available, self.cost, hop)
        if k == 0 and available > 0:
            # Probe now and then, so a stale or pessimistic estimate of V(K)
            # or p is measured again instead of locking drafting out.
            self.since_probe += 1
            if self.since_probe >= self.probe_every:
                self.since_probe = 0
                k = min(available, 2)
                e = expected_accepted(p, k)
                self.shape = Shape(k, (), e, self.cost.v_est(k) + (self.cost.hop_ms if hop else 0.0)
                                   + self.cost.overhead_ms)
        elif 0 < k < available and not shape.nodes and p >= self.probe_up_p:
            self.probe_up_gap = self.probe_up_gap or self.probe_up_every
            # A high acceptance drafting fewer than it has: every probe_up_every-th such round
            # drafts them all, so a V of the longer drafts measured once too dear (a forward beside
            # other work, a cold thread) is measured again instead of holding K down for good; at
            # this acceptance a long draft that was not worth it costs little.
            # A model that still drafts fewer after a probe had V right: each probe doubles the
            # wait for the next (3, 6, 12, ... up to 48 such rounds).
            self.since_probe_up += 1
            if self.since_probe_up >= self.probe_up_gap:
                self.since_probe_up = 0
                self.probe_up_gap = min(2 * self.probe_up_gap, 16 * self.probe_up_every)
                k = available
                e = expected_accepted(p, k)
                self.shape = Shape(k, (), e, self.cost.v_est(k) + (self.cost.hop_ms if hop else 0.0)
                                   + self.cost.overhead_ms)
        return k

    def round_tree(self) -> tuple[list[int], list[int]] | None:
        """This round's tree (tokens, parents; the kept nodes of ``tree`` renumbered in index
        order, the round's draft chain among them) when the choice was a tree, else None."""
        if not self.shape.nodes or self.tree is None:
            return None
        toks, par, srcs = self.tree
        first = first_children(par)
        new = {-1: -1}
        out_t, out_p, out_s, out_f = [], [], [], []
        for i in self.shape.nodes:
            new[i] = len(out_t)
            out_t.append(toks[i])
            out_p.append(new[par[i]])
            out_s.append(srcs[i])
            out_f.append(first[i])
        self._round = (out_p, out_s, out_f)
        return out_t, out_p

    def on_tree_result(self, accepted_nodes: Sequence[int]) -> None:
        """Count a tree round's acceptance per node (``round_tree``'s last tree; accepted_nodes:
        its nodes on the kept path, in order): along the path, each node tried at a position
        before the accepted one, or every one there when none was, is a rejection of its source
        (first guess or alternative); the accepted one a hit. Decay once per source and round."""
        parents, srcs, first = self._round
        delta: dict[tuple[int, bool], list[float]] = {}
        node = -1
        for depth in range(len(accepted_nodes) + 1):
            nxt = accepted_nodes[depth] if depth < len(accepted_nodes) else None
            for c in (i for i, q in enumerate(parents) if q == node):
                cell = delta.setdefault((srcs[c], not first[c]), [0.0, 0.0])
                if c == nxt:
                    cell[0] += 1.0
                    break
                cell[1] += 1.0
            if nxt is None:
                break
            node = nxt
        for (src, alt), (h, f) in delta.items():
            table = self.acc_alt if alt else self.acc
            hits, fails = table.get(src, (0.0, 0.0))
            table[src] = (hits * self.decay + h, fails * self.decay + f)

    def plan(self, k_cap: int) -> tuple[str, list[int] | int]:
        """Choose this round's draft source.

        Args:
            k_cap: the most drafts this round may verify (k, remaining tokens
                and context already applied); <= 0 means no drafts.
        Returns:
            ("cached", draft) | ("propose", n_fetch) | ("none", 0).
        """
        self.shape = Shape()
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
        if self.cost is not None and self.cost.hop_ms > self.cost.v_est(0):
            return "none", 0     # a proposal waited for costs more than a plain step: in flight
        return "propose", self.fetch_size()

    def on_proposal(self, draft: list[int], k_cap: int, source: int = 0) -> list[int]:
        """Store a proposal (from ``source``); return this round's draft (its first min(k, k_cap) tokens)."""
        self.cache = list(draft)
        self.cache_source = source
        if not self.cache:
            self._miss()
            return []
        return self.cache[:self._choose(min(self.k, k_cap, len(self.cache)), hop=False)]

    def on_result(self, draft: list[int], tokens: list[int], count: bool = True) -> None:
        """Update after a verify of ``draft`` that yielded ``tokens`` (R accepted + bonus);
        ``count`` False: the acceptance was counted elsewhere (``on_tree_result``)."""
        r = len(tokens) - 1 if draft else 0
        self._hit = r >= 1
        self._missed = bool(draft) and r == 0
        if not draft:
            # a plain step: the cached tail still holds if it predicted this token
            self.cache = self.cache[1:] if self.cache and tokens and self.cache[0] == tokens[0] else []
            return
        if count:
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

    def on_other(self, tokens: list[int]) -> None:
        """Update after a round whose draft came from elsewhere (the verifier's draft prior): for
        this controller a plain step that moved the output on by ``tokens`` (the cache still holds
        when it starts with them); no acceptance is counted."""
        self._hit = self._missed = False
        self.advance(tokens)

    def _miss(self) -> None:
        self.cache = []
        self.misses += 1
        self.skip = min(2 ** (self.misses - 1), self.max_skip)

    def fetch_size(self) -> int:
        """Tokens a proposal asks for: fetch_factor (run_fetch_factor with ``runs``) times k."""
        return max(1, (self.run_fetch_factor if self.runs else self.fetch_factor) * self.k)

    def prefetch_size(self, n_draft: int) -> int:
        """Tokens to ask for in flight during a round that drafts ``n_draft`` cached
        tokens (0: plain step); 0 when the cache still covers the next round or
        the back-off is skipping proposals.
        """
        if self.k <= 0 or (self.skip > 0 and not self.eager):
            return 0
        if len(self.cache) - n_draft - 1 >= self.k:
            return 0
        return self.fetch_size()

    def on_prefetch(self, proposal: list[int], tokens: list[int], source: int = 0) -> None:
        """Take an in-flight proposal made on the history before a round that yielded ``tokens``.

        It replaces the cache when it starts with ``tokens`` (its remainder
        continues the new history); an empty proposal is a miss; one that
        disagrees with the round's tokens is dropped, a miss too when there is no cache. A round
        that verified a draft has had its say in ``on_result``: one that accepted a draft is no
        miss (the source was right and only lost the round's bonus token, so the next round asks
        it again on the new history, a blocking proposal, a hop of well under T, rather than
        backing off into a plain step), and one that accepted none is one miss, not two.
        """
        counted = self._hit or self._missed   # the round's verify already said (one miss a round)
        self._hit = self._missed = False
        n = len(tokens)
        if len(proposal) > n and proposal[:n] == list(tokens):
            self.cache = list(proposal[n:])
            self.cache_source = source
        elif not self.cache and not counted:
            self._miss()

    def drop(self) -> None:
        """Forget the cache (the draft service went away)."""
        self.cache = []


class NamespacePriors:
    """Acceptance counts per draft namespace, seeding a new generation's (thread-safe, bounded).

    A generation with a draft namespace starts from its namespace's counts (per source, first
    guesses and alternatives) in place of the bare Beta priors, scaled down to at most
    ``weight`` observations per source so that its own rounds soon outweigh them; at its end
    its counts are added to the namespace's (scaled likewise). At most ``max_namespaces``
    namespaces are kept, the least recently used dropped first.
    """

    def __init__(self, max_namespaces: int = 256, weight: float = 4.0):
        self.max_namespaces = max_namespaces
        self.weight = weight
        self._table: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def _scaled(self, counts: dict) -> dict:
        out = {}
        for src, (h, f) in counts.items():
            n = h + f
            s = min(1.0, self.weight / n) if n > 0 else 1.0
            out[src] = (h * s, f * s)
        return out

    def seed(self, namespace: str, ctl: SpecController) -> bool:
        """Give ``ctl`` the namespace's counts; False when it has none ("" has none)."""
        if not namespace:
            return False
        with self._lock:
            got = self._table.get(namespace)
            if got is None:
                return False
            self._table.move_to_end(namespace)
            ctl.acc, ctl.acc_alt = dict(got[0]), dict(got[1])
        return True

    def learn(self, namespace: str, ctl: SpecController) -> None:
        """Add a finished generation's counts to its namespace's ("" keeps nothing)."""
        if not namespace or not (ctl.acc or ctl.acc_alt):
            return
        with self._lock:
            old = self._table.pop(namespace, ({}, {}))
            merged = []
            for mine, theirs in ((old[0], ctl.acc), (old[1], ctl.acc_alt)):
                sums = dict(mine)
                for src, (h, f) in theirs.items():
                    a, b = sums.get(src, (0.0, 0.0))
                    sums[src] = (a + h, b + f)
                merged.append(self._scaled(sums))
            self._table[namespace] = (merged[0], merged[1])
            while len(self._table) > self.max_namespaces:
                self._table.popitem(last=False)
