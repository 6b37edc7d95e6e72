"""Speculation economics: the counters of a generation, the formulas over them (one vocabulary)
and the gain condition. Pure code: no gRPC or Prometheus import; metrics.py exports these
counters to Prometheus and the per-request log line.

Per verify round with K drafts of which the first R are accepted:
    tries    += 1 if K >= 1          (vLLM: num_drafts)
    hits     += R                    (vLLM: num_accepted_tokens)
    kv_rolls += K - R                (rejected positions rolled back)
    draft_tokens += K                (vLLM: num_draft_tokens)
so hits + kv_rolls == draft_tokens <= tries * k_max.

Derived:
    acceptance_rate          = hits / draft_tokens            (0 when no drafts)
    mean_acceptance_length   = 1 + hits / tries               (1 when no drafts)
    mean_accepted_per_round  = hits / rounds                  (rounds include K = 0 steps)
    overhead_ms (per round)  = mean(round wall ms - round V ms)
Gain condition (`gain_condition`, the one formula of the project: the controller's
choice of K and the reported verdict both use it):
    V + overhead < (accepted + 1) * T
A round that verifies drafts costs V + overhead and yields accepted + 1 tokens;
plain decoding yields one token per T. V is the verifier's forward ms, T the ms
of one plain decode step (measured by the verifier), overhead the round's wall
time beyond V. The reported verdict uses the generation's means: V per round,
the mean accepted per round, the mean overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from echospec.v1.common_pb2 import DraftSource

SOURCE_PREDICTION = DraftSource.Value("DRAFT_SOURCE_PREDICTION")
# echospec.v1.DraftSource value -> its name in stats and metric labels: "suffix", "shared", ...
# (the zero value, no draft, as "unknown")
SOURCE_NAMES = {v: n.removeprefix("DRAFT_SOURCE_").lower() if v else "unknown"
                for n, v in DraftSource.items()}


def gain_condition(accepted: float, v_ms: float, overhead_ms: float, t_ms: float
                   ) -> tuple[bool, float, float]:
    """Does a round with these costs beat plain decoding?

    Args:
        accepted: accepted drafts per round (expected or measured mean).
        v_ms: ms of the round's verify (plus a draft hop, when the round pays one).
        overhead_ms: per-round ms beyond the verifier's forward.
        t_ms: ms of one plain decode step.
    Returns:
        (gain, lhs, rhs) with lhs = V + overhead, rhs = (accepted + 1) * T and
        gain = lhs < rhs (False when T <= 0: nothing measured).

    Example: T 10, overhead 2, V 15, 1 accepted: 17 < 20, a gain; with 0 accepted 17 >= 10.
    """
    lhs = v_ms + overhead_ms
    rhs = (accepted + 1.0) * t_ms
    return t_ms > 0 and lhs < rhs, lhs, rhs


@dataclass
class SpecCounters:
    """Accumulated counters and timings of one generation (times in ms)."""

    tries: int = 0
    hits: int = 0
    kv_rolls: int = 0
    draft_tokens: int = 0
    rounds: int = 0
    proposals: int = 0
    v_ms_total: float = 0.0
    wall_ms_total: float = 0.0
    t_ms: float = 0.0
    prefill_ms: float = 0.0
    cached_prompt_tokens: int = 0     # prompt tokens whose KV the verifier reused
    k_choice: str = ""                # the verifier's cost model: its last choice of K and why
    # per draft source (echospec.v1.DraftSource value): [draft_tokens, hits, tries]
    sources: dict = field(default_factory=dict)
    # where the rounds' wall time went beside V (sums of echospec.v1.RoundCost's parts, ms)
    draft_ms_total: float = 0.0
    sched_ms_total: float = 0.0
    accept_ms_total: float = 0.0
    rollback_ms_total: float = 0.0
    tree_rounds: int = 0              # rounds that verified a token tree
    expected_total: float = 0.0       # the cost model's expected accepted drafts, summed over the
    expected_rounds: int = 0          # draft rounds whose shape it chose (and their count)

    def add_round(self, k: int, accepted: int, v_ms: float, wall_ms: float, t_ms: float,
                  source: int = 0) -> None:
        """Record one verify round.

        Args:
            k: drafts verified (K >= 0). accepted: R, 0 <= R <= K.
            v_ms: the verifier's forward + rollback time. wall_ms: the round's
                wall time in the verifier's generation loop (draft wait included).
            t_ms: the verifier's current T estimate.
            source: the draft's echospec.v1.DraftSource (0: none or unknown).
        Raises:
            ValueError: R outside [0, K].
        """
        if not (0 <= accepted <= k):
            raise ValueError(f"accepted R={accepted} outside [0, K={k}]")
        if k >= 1:
            per = self.sources.setdefault(source, [0, 0, 0])
            per[0] += k
            per[1] += accepted
            per[2] += 1
        self.rounds += 1
        if k >= 1:
            self.tries += 1
        self.hits += accepted
        self.kv_rolls += k - accepted
        self.draft_tokens += k
        self.v_ms_total += v_ms
        self.wall_ms_total += wall_ms
        if t_ms > 0:
            self.t_ms = t_ms

    def add_cost(self, cost) -> None:
        """Add a round's echospec.v1.RoundCost (draft_ms, sched_ms, accept_ms, rollback_ms) to
        the sums; the round itself is counted by ``add_round``."""
        self.draft_ms_total += cost.draft_ms
        self.sched_ms_total += cost.sched_ms
        self.accept_ms_total += cost.accept_ms
        self.rollback_ms_total += cost.rollback_ms

    def add_shape(self, tree_nodes: int, expected: float) -> None:
        """A round's shape (StepResult.tree_nodes: a tree round when >= 1) and the accepted drafts
        the cost model expected of it (StepResult.expected_accepted; 0: not chosen by it)."""
        if tree_nodes > 0:
            self.tree_rounds += 1
        if expected > 0:
            self.expected_total += expected
            self.expected_rounds += 1

    @property
    def expected_accepted(self) -> float:
        """Mean expected accepted drafts over the draft rounds whose shape the cost model chose."""
        return self.expected_total / self.expected_rounds if self.expected_rounds else 0.0

    def round_cost(self) -> dict:
        """Means per round (ms) of the round's wall time, V, the parts beside V and the rest
        (wall - V - draft - sched - accept), as echospec.v1.RoundCost's fields."""
        n = self.rounds
        if not n:
            return {}
        out = {"wall_ms": self.wall_ms_total / n, "v_ms": self.v_ms_total / n,
               "draft_ms": self.draft_ms_total / n, "sched_ms": self.sched_ms_total / n,
               "accept_ms": self.accept_ms_total / n, "rollback_ms": self.rollback_ms_total / n}
        out["rest_ms"] = (out["wall_ms"] - out["v_ms"] - out["draft_ms"] - out["sched_ms"]
                          - out["accept_ms"])
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.hits / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def accepted_prediction_tokens(self) -> int:
        """Drafts taken from the request's prediction that were accepted."""
        return self.sources.get(SOURCE_PREDICTION, [0, 0, 0])[1]

    @property
    def rejected_prediction_tokens(self) -> int:
        """Drafts taken from the request's prediction that were rejected (rolled back)."""
        d, h, _ = self.sources.get(SOURCE_PREDICTION, [0, 0, 0])
        return d - h

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.hits / self.tries if self.tries else 1.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.hits / self.rounds if self.rounds else 0.0

    @property
    def v_ms(self) -> float:
        """Mean verifier forward ms per round."""
        return self.v_ms_total / self.rounds if self.rounds else 0.0

    @property
    def overhead_ms(self) -> float:
        """Mean per-round wall ms beyond the verifier's forward (>= 0)."""
        if not self.rounds:
            return 0.0
        return max(0.0, (self.wall_ms_total - self.v_ms_total) / self.rounds)

    @property
    def overhead_share(self) -> float:
        return self.overhead_ms / self.t_ms if self.t_ms > 0 else 0.0

    def gain(self) -> tuple[bool, str]:
        """`gain_condition` over this generation's means, and its text."""
        if self.tries == 0:
            return False, "no drafts were verified: every round was a plain decode step"
        ok, lhs, rhs = gain_condition(self.mean_accepted_per_round, self.v_ms, self.overhead_ms,
                                      self.t_ms)
        ok = ok and self.rounds > 0
        text = (f"V {self.v_ms:.3f} + overhead {self.overhead_ms:.3f} = {lhs:.3f} ms "
                f"{'<' if ok else '>='} (mean accepted {self.mean_accepted_per_round:.3f} + 1)"
                f" * T {self.t_ms:.3f} = {rhs:.3f} ms: "
                f"{'gain' if ok else 'no gain'}")
        return ok, text

    def check(self) -> None:
        """Self-check of the counter algebra; raises AssertionError when broken."""
        assert self.hits + self.kv_rolls == self.draft_tokens, self
        assert self.tries <= self.rounds, self
        assert self.hits >= 0 and self.kv_rolls >= 0, self
        assert sum(v[0] for v in self.sources.values()) == self.draft_tokens, self
        assert sum(v[1] for v in self.sources.values()) == self.hits, self
        assert sum(v[2] for v in self.sources.values()) == self.tries, self
