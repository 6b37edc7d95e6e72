"""The verifier's core (model, engine lock, T, prefix cache, scheduler) and the accept rule.
Pure logic over the engine: no gRPC.

A generation's engine session owns one KV sequence. Its state between rounds:

    KV cache   = prompt + generated tokens, except the last generated one
    pending    = the last generated token (not yet in the KV cache)

A round with a draft of K tokens runs ONE forward over [pending] + draft,
which appends K + 1 positions and yields argmax a[0..K] (a[i] is the greedy
token after position n_past + i). The accepted prefix is the longest R with
draft[i] == a[i] for all i < R; the bonus token is a[R]. The KV of pending and
the R accepted drafts is kept; the K - R rejected positions are rolled back
(es_session_rollback: exact). The round yields draft[:R] + [a[R]] (R + 1
tokens) and the new pending token is a[R]. Because one engine call over N
tokens is bitwise equal to N single steps, these are exactly the tokens that
R + 1 plain greedy decode steps would produce.

Counters per round: tries = 1 if K >= 1, hits = R, kv_rolls = K - R.
Forward calls are serialized by one engine lock. Whole generations
(GenerateTokens) run in generation_loop.py; their forwards go through the
scheduler (scheduler.py), which takes the lock, and their sessions come from
and return to the prefix cache (prefix_cache.py) through VerifierCore.acquire
and release.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from echospec.services.common.config import (VerifierConfig, default_engine_threads, kv_eviction_text,
                                             usable_cpus)
from echospec.services.common.penalties import Penalties
from echospec.services.draft.prior import DraftPrior, PriorError, resolve as resolve_prior, setting_kind
from echospec.services.text import grammar
from echospec.services.text.tokenizer import Tokenizer
from echospec.services.verifier.controller import NamespacePriors
from echospec.services.verifier.engine import (EVICT_MAX_POS, MAX_CTX, MAX_THREADS, MIN_CTX, SWA_SLACK,
                                               EngineError, Model, Session)
from echospec.services.verifier.prefix_cache import PrefixCache
from echospec.services.verifier.vision import Vision, load_vision
from echospec.services.verifier.scheduler import Scheduler

log = logging.getLogger("echospec.verifier")


class VerifierError(Exception):
    """A request the verifier refuses. ``kind`` maps to a gRPC status code."""

    kind = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(VerifierError):
    kind = "INVALID_ARGUMENT"


class ResourceExhausted(VerifierError):
    kind = "RESOURCE_EXHAUSTED"


class FailedPrecondition(VerifierError):
    kind = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; temperature <= 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    penalties: Penalties = Penalties()   # repetition penalties (off by default)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def longest_accepted_prefix(draft: Sequence[int], argmax: Sequence[int]) -> int:
    """R = the largest r with draft[i] == argmax[i] for every i < r.

    Args:
        draft: K draft tokens. argmax: at least K greedy tokens (argmax[i] is
            the greedy token at the position of draft[i]).
    Returns:
        R in [0, K].
    """
    r = 0
    for d, a in zip(draft, argmax):
        if int(d) != int(a):
            break
        r += 1
    return r


def engine_error(exc: EngineError, who: str) -> VerifierError:
    """An engine failure as the VerifierError the client gets, ``who`` first: ES_ERR_CAPACITY
    RESOURCE_EXHAUSTED and ES_ERR_INVALID_ARG INVALID_ARGUMENT with the engine's message;
    ES_ERR_NOMEM RESOURCE_EXHAUSTED (this host's memory: the coordinator may move the
    generation), and any other status (ES_ERR_BAD_WEIGHTS, a NaN logits row; ES_ERR_INTERNAL)
    INTERNAL, both with the status's name before the message. Never grpcio's UNKNOWN
    "Exception iterating responses" of an exception left to it."""
    if exc.name == "ES_ERR_CAPACITY":
        return ResourceExhausted(f"{who}: {exc.message}")
    if exc.name == "ES_ERR_INVALID_ARG":
        return InvalidArgument(f"{who}: {exc.message}")
    if exc.name == "ES_ERR_NOMEM":
        return ResourceExhausted(f"{who}: {exc.name}: {exc.message}")
    return VerifierError(f"{who}: {exc.name}: {exc.message}")


class VerifierCore:
    """The loaded model, the engine lock, T, the count of sessions in use, the
    scheduler and the prefix cache.

    Engine threads: every session's pool has max(n_threads, batch_threads)
    threads; a forward over one session (a lone generation's decode step or
    decode run, the warm-up) runs on n_threads of them, an
    iteration of the scheduler that batches >= 2 sessions or feeds one a
    prefill chunk of scheduler.MANY_TOKENS or more on batch_threads. With both
    0 that is the usable CPUs less one for one session (a core kept for the
    services' Python and anything else on the host) and every usable CPU for a
    batch or a prefill (bench/README.md, serve_bench, "Engine threads"). The
    config kept here has both resolved.

    KV eviction (kv_sinks, kv_window): every session keeps the sinks and a ring of the window
    plus ``swa_slack`` positions in every layer and may run past n_ctx (context_limit); a
    cached session is reused only down to a prefix it still holds (min_rollback), and
    speculation is refused (generation_loop.py; the coordinator's gating refuses it first).

    Sparse attention (sparse_attention TOPK > 0): every session is made with the engine's
    sparse_topk; a decode step then attends a choice of KV blocks made for its whole call, so a
    verify is not exact and speculation is refused as for KV eviction, and no prefix is reused
    (the prompt's rest would be a short piece that attends like a decode step: the output
    would depend on what the cache held). A kept session is still taken, rolled back to 0.

    KV cache type (kv_type): "f16" or "q8_0" for every session. Q8_0 changes the logits a
    little (README.md, "KV cache type") but not the rules: a verify reads the quantized cache as
    the decode steps it stands for do, so speculation stays exact and prefixes are reused.

    Sliding-window models (Gemma 3): each session's local layers keep a ring of
    the window plus ``swa_slack`` positions, swa_slack = max(SWA_SLACK, max_k + 1),
    so the rollback after a verify of up to max_k drafts (at most max_k positions
    back from the furthest written) is always within reach; a cached session is
    reused only down to a prefix it can still reach (prefix_cache.py, Reach).

    Args:
        config: model path, n_ctx, n_threads, batch_threads, max_k, max_sessions,
            batch_max, batch_tokens, prefill_chunk, prefix cache settings.
    Raises:
        EngineError: the model cannot be loaded (status and message from the engine).
        InvalidArgument: n_ctx < MIN_CTX (a larger n_ctx than the model's training context is
            allowed: server.start warns), or batch_threads outside [0, MAX_THREADS].
    """

    def __init__(self, config: VerifierConfig):
        if not 0 <= config.batch_threads <= MAX_THREADS:
            raise InvalidArgument(f"batch_threads must be in [0, {MAX_THREADS}], got {config.batch_threads}")
        auto = config.n_threads == 0
        n_threads = default_engine_threads() if auto else config.n_threads
        batch_threads = config.batch_threads or (usable_cpus() if auto else n_threads)
        config = dataclasses.replace(config, n_threads=n_threads, batch_threads=batch_threads)
        self.config = config
        # the spec controller's acceptance counts per draft namespace (a new generation's prior)
        self.spec_priors = NamespacePriors()
        self.pool_threads = max(n_threads, batch_threads)
        # a lone generation's forward leaves a CPU to the rest of the process: a speculative
        # generation's back-off then keeps asking the draft service in flight beside each plain
        # step (generation_loop, controller.eager), since that probe costs the forward nothing
        self.spare_cpu = n_threads < usable_cpus()
        # a verify's rollback is always within reach (the engine takes at most MAX_CTX)
        self.swa_slack = min(max(SWA_SLACK, config.max_k + 1), MAX_CTX)
        self.model = Model(config.model, check_weights=config.check_weights)
        info = self.model.info
        self.vision: Vision | None = None
        if config.mmproj:
            try:
                self.vision = load_vision(config.mmproj, info)
            except BaseException:
                self.model.close()
                raise
        self.n_vocab = info.n_vocab
        # the draft prior (one token for greedy speculative rounds with no other draft)
        self.prior: DraftPrior | None = None
        self.prior_path = ""
        try:
            self.prior_path = resolve_prior(config.draft_prior, config.model)
            if self.prior_path:
                t0 = time.perf_counter()
                self.prior = DraftPrior.load(self.prior_path, self.n_vocab)
                log.info("draft prior: %s, %d tokens of %s, %d contexts, read in %.2f s", self.prior_path,
                         self.prior.n_tokens, self.prior.model or "an unnamed model", len(self.prior),
                         time.perf_counter() - t0)
            elif setting_kind(config.draft_prior) == "auto":
                log.info("draft prior: none built for this model (`echospec prior --model %s` builds "
                         "one); free text drafts nothing", config.model)
        except PriorError as exc:
            self.model.close()
            if self.vision is not None:
                self.vision.close()
            hint = ""
            if setting_kind(config.draft_prior) == "auto":   # the cached one: say how to mend it
                hint = (f"; `echospec prior --model {config.model} --if-missing` builds it again, "
                        f"or --draft-prior off starts without one")
            raise InvalidArgument(f"draft_prior: {exc}{hint}") from None
        if config.n_ctx < MIN_CTX:
            raise InvalidArgument(f"n_ctx must be >= {MIN_CTX}, got {config.n_ctx}")
        self.engine_lock = threading.Lock()
        # one image encode at a time, outside the engine lock (image_loop.py)
        self.vision_lock = threading.Lock()
        self._lock = threading.Lock()
        self.t_ms = 0.0
        self._t_alpha = 0.1
        self.scheduler = Scheduler(self.engine_lock, config.batch_max, config.batch_tokens,
                                   config.prefill_chunk, threads=(n_threads, batch_threads),
                                   decode_steps=config.decode_steps)
        self.prefix_cache = PrefixCache(config.prefix_cache_sessions if config.prefix_cache else 0)
        self._gen_active = 0                              # sessions held by generations
        self._grammar_tokenizers: grammar.TokenizerCache | None = None   # built on first use
        self._grammar_lock = threading.Lock()
        self._grammar_eos: list[int] = []

    def _grammar_cache(self) -> grammar.TokenizerCache:
        with self._grammar_lock:
            if self._grammar_tokenizers is None:
                t0 = time.perf_counter()
                tok = Tokenizer.from_gguf(self.config.model)
                self._grammar_tokenizers = grammar.TokenizerCache(tok.hf.to_str(), self.n_vocab)
                self._grammar_eos = sorted(tok.eos_ids)
                log.info("grammar: the matcher's tokenizer of %d ids read from the GGUF in %.1f s",
                         self.n_vocab, time.perf_counter() - t0)
            return self._grammar_tokenizers

    def warm_up_grammar(self) -> None:
        """Build the grammar matcher's tokenizer for the GGUF's own EOS ids (the ones the
        coordinator sends) now, before SERVING: llguidance holds the GIL while it builds one,
        which would stall every other call of the verifier on the first constrained request. A
        vocabulary the matcher cannot take is logged, not fatal: constrained requests then fail
        with its message."""
        t0 = time.perf_counter()
        try:
            cache = self._grammar_cache()
            cache.get(self._grammar_eos)
        except Exception as exc:  # noqa: BLE001 - a model without a usable vocabulary still serves text
            log.warning("grammar: no matcher tokenizer for this model (%s); constrained requests "
                        "will be refused", exc)
            return
        log.info("grammar: matcher tokenizer ready in %.1f s", time.perf_counter() - t0)

    def constraint(self, spec: grammar.GrammarSpec, eos_ids: Sequence[int],
                   resumed: Sequence[int] = ()) -> grammar.Constraint:
        """A generation's grammar matcher over the model's vocabulary, advanced over the
        ``resumed`` output tokens. The llguidance tokenizer is built from the GGUF's own
        vocabulary once (``warm_up_grammar`` at startup, else on the first constrained request;
        SmolLM2's 49K ids: about 2 s on a 2-core host, Gemma 3's 262K: about 12 s); EOS ids other
        than the GGUF's add the llguidance part again (about 0.9 s / 5 s).

        Raises:
            InvalidArgument: the grammar is refused, or the resumed tokens break it (the
                matcher's message).
            FailedPrecondition: the matcher cannot take the model's vocabulary.
        """
        try:
            tokenizer = self._grammar_cache().get(eos_ids)
        except grammar.GrammarError as exc:
            raise InvalidArgument(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the model's vocabulary, not the request
            raise FailedPrecondition(f"grammar: the matcher cannot take this model's vocabulary "
                                     f"({type(exc).__name__}: {exc})") from None
        try:
            c = grammar.Constraint(tokenizer, spec, self.n_vocab)
            c.consume(resumed)
        except grammar.GrammarError as exc:
            raise InvalidArgument(str(exc)) from None
        return c

    @property
    def kv_eviction(self) -> str:
        """GetConfig's kv_eviction: "none", or "sinks S, window W" (speculation is refused then)."""
        return kv_eviction_text(self.config.kv_sinks, self.config.kv_window)

    @property
    def tree_refusal(self) -> str:
        """Why the engine refuses token trees here ("" when it takes them): KV eviction, sparse
        attention, a Q8_0 KV cache or a sliding-window model (es_forward_tree's ES_ERR_UNSUPPORTED)."""
        cfg = self.config
        if self.kv_eviction != "none":
            return "KV eviction"
        if cfg.sparse_attention > 0:
            return "sparse attention"
        if cfg.kv_type == "q8_0":
            return "a Q8_0 KV cache"
        if self.model.info.n_swa > 0:
            return "a sliding-window model"
        return ""

    @property
    def context_limit(self) -> int:
        """The positions a generation may reach: n_ctx, or with KV eviction the engine's
        ES_EVICT_MAX_POS (the session's memory is bounded by the sinks and the window instead;
        n_ctx still bounds the prompt)."""
        return EVICT_MAX_POS if self.config.kv_window > 0 else self.config.n_ctx

    @property
    def active_sessions(self) -> int:
        """Sessions in use by generations (not the idle cached ones)."""
        with self._lock:
            return self._gen_active

    @property
    def cached_sessions(self) -> int:
        with self._lock:
            return len(self.prefix_cache)

    @property
    def free_kv_tokens(self) -> int:
        """KV positions that new sessions can still take: each free session slot holds one
        n_ctx cache; the prefix cache's idle sessions count as free (they are evicted first)."""
        return max(0, self.config.max_sessions - self.active_sessions) * self.config.n_ctx

    def new_engine_session(self) -> Session:
        """An engine session with the verifier's pool, set to n_threads (one session's forwards).

        Raises:
            EngineError: as Model.new_session.
        """
        cfg = self.config
        evict = cfg.kv_window > 0
        es = self.model.new_session(n_ctx=cfg.n_ctx, n_threads=self.pool_threads,
                                    swa_slack=self.swa_slack, kv_sinks=cfg.kv_sinks if evict else 0,
                                    kv_window=cfg.kv_window, sparse_topk=cfg.sparse_attention,
                                    kv_type=cfg.kv_type)
        try:
            es.threads = self.config.n_threads
        except EngineError:
            es.close()
            raise
        return es

    def acquire(self, prompt: Sequence[int]) -> tuple[Session, int]:
        """An engine session for a generation of ``prompt``, and how many prompt tokens it already holds.

        Takes the prefix cache's session sharing the longest prefix with the
        prompt that it can still roll back to (Session.min_rollback) and rolls its
        KV back to that prefix; else, when the cache is
        full (its least recently used entry would be evicted when this
        generation's session comes back anyway), takes that entry rolled back
        to 0, whose KV pages are already in memory (a new session's first
        forward pays their page faults); else allocates a session (evicting
        idle cached sessions first when max_sessions are open).
        Raises:
            ResourceExhausted: max_sessions in use, or no memory for a KV cache.
        """
        evicted = []
        with self._lock:
            # under sparse attention a reused prefix would leave the prompt's rest to a short
            # piece, which attends like a decode step: the output would depend on the cache
            session, n = self.prefix_cache.take(prompt) if not self.config.sparse_attention \
                else (None, 0)
            if session is None and 0 < self.prefix_cache.capacity <= len(self.prefix_cache):
                session, n = self.prefix_cache.evict_lru(), 0
            if session is None:
                while self._gen_active + len(self.prefix_cache) >= self.config.max_sessions:
                    old = self.prefix_cache.evict_lru()
                    if old is None:
                        raise ResourceExhausted(
                            f"{self._gen_active} sessions already open"
                            f" (max_sessions {self.config.max_sessions})")
                    evicted.append(old)
            self._gen_active += 1
        for old in evicted:
            old.close()
        if session is not None:
            session.rollback(n)
            return session, n
        try:
            return self.new_engine_session(), 0
        except EngineError as exc:
            with self._lock:
                self._gen_active -= 1
            if exc.name == "ES_ERR_NOMEM":
                raise ResourceExhausted(f"cannot allocate a session: {exc.message}") from None
            raise

    def release(self, session: Session, kv_tokens: Sequence[int] | None,
                prompt_len: int = 0) -> None:
        """Give back a generation's session.

        Args:
            kv_tokens: the tokens in its KV cache, in order (positions beyond
                them are rolled back first; a session that cannot roll back that
                far is freed); None: free it (state unknown).
            prompt_len: how many of kv_tokens were the generation's prompt (the prefix
                cache's Worth it rule; 0: not said).
        """
        keep = kv_tokens is not None and len(kv_tokens) > 0
        min_past = 0
        try:
            if keep and session.n_past > len(kv_tokens):
                session.rollback(len(kv_tokens))
            if keep:
                min_past = session.min_rollback
        except EngineError:   # closed meanwhile (a generation that outlived a stop), or out of reach
            keep = False
        with self._lock:
            self._gen_active -= 1
            evicted = self.prefix_cache.put(session, kv_tokens, min_past, prompt_len) \
                if keep else [session]
        for s in evicted:
            s.close()

    def observe_decode(self, ms: float) -> None:
        """Fold one plain decode step's time into T (exponential moving average)."""
        self.t_ms = ms if self.t_ms <= 0 else (1 - self._t_alpha) * self.t_ms + self._t_alpha * ms

    def warm_up(self, steps: int = 8) -> None:
        """Prefill a short prompt and time plain greedy decode steps (one engine session of
        its own, freed after) to seed T. Steps that would not fit n_ctx are left out.

        Raises:
            EngineError: as Session.forward (the session is freed first).
        """
        prompt = [min(1, self.n_vocab - 1)] * 4
        es = self.new_engine_session()
        try:
            with self.engine_lock:
                pending, _ = es.prefill(prompt)
            for _ in range(min(steps, self.config.n_ctx - len(prompt))):
                with self.engine_lock:
                    t0 = time.perf_counter()
                    argmax, _ = es.forward([pending], logits="none")
                    ms = (time.perf_counter() - t0) * 1e3
                self.observe_decode(ms)
                pending = int(argmax[0])
        finally:
            es.close()

    def close(self) -> None:
        """Close the prefix cache's sessions, then the model.

        Holds the engine lock meanwhile, so a forward still running (a generation
        whose RPC outlived the server's grace period) finishes first; a later one
        fails with EngineError (session closed) instead of touching freed memory.
        """
        with self._lock:
            cached = self.prefix_cache.clear()
        with self.engine_lock:
            for c in cached:
                c.close()
            self.model.close()
        if self.vision is not None:
            with self.vision_lock:     # an encode still running finishes first
                self.vision.close()
