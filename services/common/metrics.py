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

SOURCE_PREDICTION = 4   # echospec.v1.DraftSource
SOURCE_NAMES = {0: "unknown", 1: "suffix", 2: "shared", 3: "numbered", 4: "prediction"}


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
    # per draft source (echospec.v1.DraftSource value): [draft_tokens, hits, tries]
    sources: dict = field(default_factory=dict)

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


BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40,
             80, 160)


@dataclass
class RequestRecord:
    """What one coordinator request did: the per-request log line and the request metrics.

    Times are seconds from the request's arrival; ``ttft_s`` is None until a token is out.
    ``cached_tokens`` counts prompt tokens whose KV the verifier's prefix cache supplied.
    """

    request_id: str
    rpc: str
    t0: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens_out: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    finish_reason: str = ""
    spec: bool = False
    code: str = "OK"
    counters: SpecCounters | None = None
    verifier: str = ""               # host:port of the verifier that served it ("" : none did)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_out / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's time_per_output_token)."""
        if self.ttft_s is None or self.tokens_out < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens_out - 1)

    def fields(self) -> dict:
        """The log line's fields, in order (ms for durations, as the stats report them)."""
        c = self.counters or SpecCounters()
        return {
            "request_id": self.request_id, "rpc": self.rpc, "code": self.code,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "prefill_ms": round(c.prefill_ms, 3), "tokens_out": self.tokens_out,
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 3),
            "e2e_ms": round(self.e2e_s * 1e3, 3), "tokens_per_s": round(self.tokens_per_s, 2),
            "finish_reason": self.finish_reason or None, "spec": self.spec,
            "tries": c.tries, "hits": c.hits, "kv_rolls": c.kv_rolls,
            "draft_tokens": c.draft_tokens, "acceptance_rate": round(c.acceptance_rate, 4),
            "verifier": self.verifier or None,
        }


class _Registry:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry
        self.registry = CollectorRegistry()


class RpcMetrics(_Registry):
    """Every service's RPC metrics (recorded by grpc_util.ConcurrencyLimit), in seconds.

        echospec_rpc_in_flight{method}              service RPCs running now
        echospec_rpc_finished_total{method,code}    finished RPCs by status code (CANCELLED,
                                                    DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...)
        echospec_rpc_duration_seconds{method}       wall time of each RPC (streams: whole stream)
    """

    def __init__(self, registry=None) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        super().__init__()
        if registry is not None:
            self.registry = registry
        r = self.registry
        self.in_flight = Gauge("echospec_rpc_in_flight", "Service RPCs in progress", ["method"],
                               registry=r)
        self.finished = Counter("echospec_rpc_finished_total", "Finished service RPCs by status code",
                                ["method", "code"], registry=r)
        self.duration = Histogram("echospec_rpc_duration_seconds", "Service RPC wall time, seconds",
                                  ["method"], buckets=BUCKETS_S, registry=r)

    def started(self, method: str) -> None:
        self.in_flight.labels(method=method).inc()

    def finished_rpc(self, method: str, code: str, seconds: float | None) -> None:
        """One RPC ended with `code`; seconds is None for a refused call (never started)."""
        if seconds is not None:
            self.in_flight.labels(method=method).dec()
            self.duration.labels(method=method).observe(seconds)
        self.finished.labels(method=method, code=code).inc()


class PromMetrics(_Registry):
    """The coordinator's request and speculative-decoding metrics, in seconds.

    vLLM's names where vLLM has the quantity (``vllm:x`` here is ``echospec_x``):
        echospec_time_to_first_token_seconds       histogram, per request with a token out
        echospec_e2e_request_latency_seconds       histogram, every finished request
        echospec_time_per_output_token_seconds     histogram, (e2e - ttft) / (tokens - 1)
        echospec_prompt_tokens_total               counter
        echospec_generation_tokens_total           counter
        echospec_num_requests_running              gauge: generations in progress
        echospec_request_success_total{finished_reason}
        echospec_request_errors_total{code}        failed, cancelled (CANCELLED) and timed out
                                                   (DEADLINE_EXCEEDED) requests by status code
        echospec_spec_decode_num_drafts_total          = tries
        echospec_spec_decode_num_draft_tokens_total    = draft_tokens
        echospec_spec_decode_num_accepted_tokens_total = hits
    The project's own counters (README): ``echospec_spec_{tries,hits,kv_rolls,draft_tokens,rounds}
    _total``, ``echospec_generations_total{finish_reason,spec}``, ``echospec_generated_tokens_total``
    and the histograms ``echospec_decode_step_seconds`` (T) and ``echospec_round_overhead_seconds``.
    Per verifier (label ``verifier``, its host:port; services/coordinator/pool.py):
        echospec_verifier_healthy                  gauge: 1 while a candidate for new generations
        echospec_verifier_active_sessions          gauge: the verifier's last reported active sessions
        echospec_verifier_max_sessions             gauge: its reported session limit
        echospec_verifier_free_kv_tokens           gauge: its reported free KV positions
        echospec_verifier_in_flight                gauge: this coordinator's generations on it
        echospec_verifier_generations_total{code}  counter: generations it served, by final status
        echospec_verifier_retries_total            counter: generations moved away from it after it
                                                   failed before their first token
    By draft source (label ``source``: suffix, shared, numbered, prediction):
    ``echospec_spec_source_{draft_tokens,hits,tries}_total``.
    """

    def __init__(self, registry=None) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        super().__init__()
        if registry is not None:
            self.registry = registry
        r = self.registry
        c = lambda name, doc: Counter(name, doc, registry=r)  # noqa: E731
        h = lambda name, doc: Histogram(name, doc, buckets=BUCKETS_S, registry=r)  # noqa: E731
        self.ttft = h("echospec_time_to_first_token_seconds", "Time to first token, seconds")
        self.e2e = h("echospec_e2e_request_latency_seconds", "End-to-end request latency, seconds")
        self.tpot = h("echospec_time_per_output_token_seconds", "Time per output token after the "
                      "first, seconds")
        self.prompt_tokens = c("echospec_prompt_tokens_total", "Prompt tokens")
        self.generation_tokens = c("echospec_generation_tokens_total", "Generated tokens")
        self.running = Gauge("echospec_num_requests_running", "Generations in progress", registry=r)
        self.success = Counter("echospec_request_success_total", "Finished generations",
                               ["finished_reason"], registry=r)
        self.errors = Counter("echospec_request_errors_total", "Generations ended by an error, a "
                              "cancel or a deadline, by status code", ["code"], registry=r)
        self.num_drafts = c("echospec_spec_decode_num_drafts_total", "Verify rounds with K >= 1 "
                            "drafts (tries)")
        self.num_draft_tokens = c("echospec_spec_decode_num_draft_tokens_total", "Draft tokens "
                                  "verified (draft_tokens)")
        self.num_accepted = c("echospec_spec_decode_num_accepted_tokens_total", "Accepted draft "
                              "tokens (hits)")
        self.generations = Counter("echospec_generations_total", "Finished generations",
                                   ["finish_reason", "spec"], registry=r)
        self.tokens = c("echospec_generated_tokens_total", "Output tokens")
        self.rounds = c("echospec_spec_rounds_total", "Verifier rounds after prefill (K = 0 included)")
        self.tries = c("echospec_spec_tries_total", "Verify rounds with K >= 1 drafts (num_drafts)")
        self.hits = c("echospec_spec_hits_total", "Accepted draft tokens (num_accepted_tokens)")
        self.kv_rolls = c("echospec_spec_kv_rolls_total", "Draft positions written to the KV cache, "
                          "then rolled back")
        self.draft_tokens = c("echospec_spec_draft_tokens_total", "Draft tokens verified "
                              "(num_draft_tokens)")
        self.t_s = h("echospec_decode_step_seconds", "T: one plain decode step, seconds (per "
                     "generation)")
        self.overhead_s = h("echospec_round_overhead_seconds", "Mean per-round overhead of a "
                            "generation, seconds")
        g = lambda name, doc: Gauge(name, doc, ["verifier"], registry=r)  # noqa: E731
        self.v_healthy = g("echospec_verifier_healthy", "1 while the verifier is a candidate for "
                           "new generations")
        self.v_active = g("echospec_verifier_active_sessions", "The verifier's last reported "
                          "active sessions")
        self.v_max = g("echospec_verifier_max_sessions", "The verifier's reported max_sessions")
        self.v_free_kv = g("echospec_verifier_free_kv_tokens", "The verifier's reported free KV "
                           "positions")
        self.v_in_flight = g("echospec_verifier_in_flight", "This coordinator's generations on "
                             "the verifier")
        self.v_generations = Counter("echospec_verifier_generations_total", "Generations the "
                                     "verifier served, by final status code", ["verifier", "code"],
                                     registry=r)
        self.v_retries = Counter("echospec_verifier_retries_total", "Generations moved to another "
                                 "verifier after this one failed before their first token",
                                 ["verifier"], registry=r)
        self.source_draft_tokens = Counter("echospec_spec_source_draft_tokens_total", "Draft tokens "
                                           "verified, by draft source", ["source"], registry=r)
        self.source_hits = Counter("echospec_spec_source_hits_total", "Accepted draft tokens, by "
                                   "draft source", ["source"], registry=r)
        self.source_tries = Counter("echospec_spec_source_tries_total", "Verify rounds with K >= 1, "
                                    "by draft source", ["source"], registry=r)

    def verifier_state(self, address: str, healthy: bool, active: int, max_sessions: int,
                       free_kv_tokens: int, in_flight: int) -> None:
        """Set one verifier's gauges (the pool calls it after each poll and lease)."""
        self.v_healthy.labels(verifier=address).set(1 if healthy else 0)
        self.v_active.labels(verifier=address).set(active)
        self.v_max.labels(verifier=address).set(max_sessions)
        self.v_free_kv.labels(verifier=address).set(free_kv_tokens)
        self.v_in_flight.labels(verifier=address).set(in_flight)

    def verifier_forget(self, address: str) -> None:
        """Drop the gauges of a verifier that left the pool (its counters stay)."""
        for gauge in (self.v_healthy, self.v_active, self.v_max, self.v_free_kv, self.v_in_flight):
            try:
                gauge.remove(address)
            except KeyError:
                pass

    def request_started(self) -> None:
        self.running.inc()

    def request_finished(self, rec: RequestRecord) -> None:
        """Add one finished request (success or not); balances request_started."""
        self.running.dec()
        self.e2e.observe(rec.e2e_s)
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.tokens_out)
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
        if rec.tpot_s is not None:
            self.tpot.observe(rec.tpot_s)
        if rec.verifier:
            self.v_generations.labels(verifier=rec.verifier, code=rec.code).inc()
        if rec.code != "OK":
            self.errors.labels(code=rec.code).inc()
        elif rec.finish_reason:
            self.success.labels(finished_reason=rec.finish_reason).inc()
            self.generations.labels(finish_reason=rec.finish_reason,
                                    spec="on" if rec.spec else "off").inc()
            self.tokens.inc(rec.tokens_out)
        c = rec.counters
        if c is None:
            return
        self.num_drafts.inc(c.tries)
        self.num_draft_tokens.inc(c.draft_tokens)
        self.num_accepted.inc(c.hits)
        self.rounds.inc(c.rounds)
        self.tries.inc(c.tries)
        self.hits.inc(c.hits)
        self.kv_rolls.inc(c.kv_rolls)
        self.draft_tokens.inc(c.draft_tokens)
        for src, (d, hits, tries) in c.sources.items():
            name = SOURCE_NAMES.get(src, "unknown")
            self.source_draft_tokens.labels(source=name).inc(d)
            self.source_hits.labels(source=name).inc(hits)
            self.source_tries.labels(source=name).inc(tries)
        if c.t_ms > 0:
            self.t_s.observe(c.t_ms / 1e3)
        if c.rounds:
            self.overhead_s.observe(c.overhead_ms / 1e3)


def serve_metrics(host: str, port: int, registries):
    """Serve GET /metrics (the text exposition of every registry in `registries`) on host:port
    (0: a free port); any other path is 404. Returns (server, bound port); stop it with
    ``server.shutdown(); server.server_close()``.

    Raises:
        OSError: the port cannot be bound.
    """
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    regs = list(registries)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path != "/metrics":
                body = b"not found: metrics are served at /metrics only\n"
                self.send_response(404)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
            else:
                body = b"".join(generate_latest(r) for r in regs)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self):  # noqa: N802
            self.send_response(200 if self.path.split("?", 1)[0] == "/metrics" else 404)
            self.end_headers()

        def log_message(self, *args):  # scrapes are not logged
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server, server.server_address[1]
