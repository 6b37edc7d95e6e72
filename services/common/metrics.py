"""Speculative-decoding counters and the formulas over them (one vocabulary).

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
Gain condition, as measured over the generation's rounds:
    V + overhead < (mean_accepted_per_round + 1) * T
where V is the mean verifier forward ms per round and T the ms of one plain
decode step (measured by the verifier).
"""
from __future__ import annotations

from dataclasses import dataclass


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

    def add_round(self, k: int, accepted: int, v_ms: float, wall_ms: float, t_ms: float) -> None:
        """Record one verify round.

        Args:
            k: drafts verified (K >= 0). accepted: R, 0 <= R <= K.
            v_ms: the verifier's forward + rollback time. wall_ms: the round's
                wall time in the verifier's generation loop (draft wait included).
            t_ms: the verifier's current T estimate.
        Raises:
            ValueError: R outside [0, K].
        """
        if not (0 <= accepted <= k):
            raise ValueError(f"accepted R={accepted} outside [0, K={k}]")
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

    @property
    def acceptance_rate(self) -> float:
        return self.hits / self.draft_tokens if self.draft_tokens else 0.0

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
        """The gain condition V + overhead < (mean accepted + 1) * T, and its text."""
        if self.tries == 0:
            return False, "no drafts were verified: every round was a plain decode step"
        lhs = self.v_ms + self.overhead_ms
        rhs = (self.mean_accepted_per_round + 1.0) * self.t_ms
        ok = self.rounds > 0 and self.t_ms > 0 and lhs < rhs
        text = (f"V {self.v_ms:.3f} + overhead {self.overhead_ms:.3f} = {lhs:.3f} ms "
                f"{'<' if ok else '>='} (mean accepted {self.mean_accepted_per_round:.3f} + 1)"
                f" * T {self.t_ms:.3f} = {rhs:.3f} ms: {'gain' if ok else 'no gain'}")
        return ok, text

    def check(self) -> None:
        """Self-check of the counter algebra; raises AssertionError when broken."""
        assert self.hits + self.kv_rolls == self.draft_tokens, self
        assert self.tries <= self.rounds, self
        assert self.hits >= 0 and self.kv_rolls >= 0, self


class PromMetrics:
    """Prometheus export of the coordinator's speculative-decoding counters.

    One registry per coordinator (no module globals); ``serve(host, port)``
    exposes it over HTTP with prometheus-client's own server. Names follow
    the counters above (``echospec_spec_tries_total`` etc.); the per-round
    timings are histograms in milliseconds.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        c = lambda name, doc: Counter(name, doc, registry=self.registry)  # noqa: E731
        self.generations = Counter("echospec_generations_total", "Finished generations",
                                   ["finish_reason", "spec"], registry=self.registry)
        self.tokens = c("echospec_generated_tokens_total", "Output tokens")
        self.rounds = c("echospec_spec_rounds_total", "Verifier rounds after prefill (K = 0 included)")
        self.tries = c("echospec_spec_tries_total", "Verify rounds with K >= 1 drafts (num_drafts)")
        self.hits = c("echospec_spec_hits_total", "Accepted draft tokens (num_accepted_tokens)")
        self.kv_rolls = c("echospec_spec_kv_rolls_total", "Draft positions written to the KV cache, then rolled back")
        self.draft_tokens = c("echospec_spec_draft_tokens_total", "Draft tokens verified (num_draft_tokens)")
        buckets = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.t_ms = Histogram("echospec_decode_step_ms", "T: ms of one plain decode step (per generation)",
                              buckets=buckets, registry=self.registry)
        self.overhead_ms = Histogram("echospec_round_overhead_ms", "Mean per-round overhead of a generation, ms",
                                     buckets=buckets, registry=self.registry)

    def record(self, finish_reason: str, spec: bool, completion_tokens: int, c: SpecCounters) -> None:
        """Add one finished generation."""
        self.generations.labels(finish_reason=finish_reason, spec="on" if spec else "off").inc()
        self.tokens.inc(completion_tokens)
        self.rounds.inc(c.rounds)
        self.tries.inc(c.tries)
        self.hits.inc(c.hits)
        self.kv_rolls.inc(c.kv_rolls)
        self.draft_tokens.inc(c.draft_tokens)
        if c.t_ms > 0:
            self.t_ms.observe(c.t_ms)
        if c.rounds:
            self.overhead_ms.observe(c.overhead_ms)

    def serve(self, host: str, port: int):
        """Expose /metrics on host:port (0: a free port). Returns (server, bound port)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
