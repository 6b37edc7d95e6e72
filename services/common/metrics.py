"""Prometheus metrics of the services and the coordinator's per-request record.

The counters and formulas they export (tries, hits, kv_rolls, acceptance rate, the gain
condition) are defined in economics.py; this module only records and serves them.
"""
from __future__ import annotations

from dataclasses import dataclass

from echospec.services.common.economics import SOURCE_NAMES, SpecCounters

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
    route: str = ""                  # why the balancer picked it (balancer.route's reason)
    moves: int = 0                   # moves to another verifier mid-generation (resumed there)

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
            "verifier": self.verifier or None, "moves": self.moves, "route": self.route or None,
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
    By draft source (label ``source``: suffix, shared, numbered, prediction, grammar, prior):
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
        self.v_moves = Counter("echospec_verifier_moves_total", "Generations moved to another "
                               "verifier after this one failed or stalled past their first token "
                               "(each move tried)", ["verifier"], registry=r)
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
