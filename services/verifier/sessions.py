"""Verifier sessions and the accept rule. Pure logic over the engine: no gRPC.

A session owns one KV sequence. Its state between calls:

    KV cache   = prompt + generated tokens, except the last generated one
    pending    = the last generated token (not yet in the KV cache)

Verify(draft of K tokens) runs ONE forward over [pending] + draft, which
appends K + 1 positions and yields argmax a[0..K] (a[i] is the greedy token
after position n_past + i). The accepted prefix is the longest R with
draft[i] == a[i] for all i < R; the bonus token is a[R]. The KV of pending and
the R accepted drafts is kept; the K - R rejected positions are rolled back
(es_session_rollback: exact). The step yields draft[:R] + [a[R]] (R + 1
tokens) and the new pending token is a[R]. Because one engine call over N
tokens is bitwise equal to N single steps, these are exactly the tokens that
R + 1 plain greedy decode steps would produce.

Counters per step: tries = 1 if K >= 1, hits = R, kv_rolls = K - R.
Sampling sessions (temperature > 0) only take K = 0 steps: one forward over
[pending] with the last logits row, and the engine's sampler with the
session's RNG state (seeded from the request seed).
Forward calls of all sessions are serialized by one engine lock: each call
uses every engine thread. Whole generations (GenerateTokens) run in
generation_loop.py; their forwards go through the scheduler
(scheduler.py), which takes the same lock, and their sessions come from and
return to the prefix cache (prefix_cache.py) through VerifierCore.acquire
and release.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from echospec.services.common.config import VerifierConfig, default_engine_threads, usable_cpus
from echospec.services.verifier.engine import MAX_THREADS, MIN_CTX, EngineError, Model, Session, sample
from echospec.services.common.floats import f32_str
from echospec.services.verifier.prefix_cache import PrefixCache
from echospec.services.verifier.scheduler import Scheduler


class VerifierError(Exception):
    """A request the verifier refuses. ``kind`` maps to a gRPC status code."""

    kind = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(VerifierError):
    kind = "INVALID_ARGUMENT"


class NotFound(VerifierError):
    kind = "NOT_FOUND"


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class StepOutcome:
    """Result of one prefill / decode / verify step (times in ms)."""

    tokens: list[int]          # accepted drafts then the bonus token (R + 1 tokens)
    k: int                     # K drafts verified
    accepted: int              # R
    v_ms: float                # this step's forward (+ rollback) time
    t_ms: float                # current T estimate
    n_past: int
    n_ctx: int

    @property
    def kv_rolls(self) -> int:
        return self.k - self.accepted


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


class VerifierSession:
    """One KV sequence plus its pending token and sampler state.

    Lifecycle: new -> prefill -> step* -> close. Illegal transitions raise
    FailedPrecondition naming the session. Methods are thread-safe (one lock
    per session); ``close`` waits for an in-flight step.
    """

    def __init__(self, core: "VerifierCore", session: Session, sampling: Sampling, sid: str):
        self.core = core
        self.sid = sid
        self.sampling = sampling
        self._session = session
        self._lock = threading.Lock()
        self._pending: int | None = None
        self._rng = int(sampling.seed) & 0xFFFFFFFFFFFFFFFF
        self.closed = False
        self.last_used = time.monotonic()

    @property
    def n_ctx(self) -> int:
        return self.core.config.n_ctx

    def _check_open(self) -> None:
        if self.closed:
            raise NotFound(f"session {self.sid} is closed")

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        n_vocab = self.core.n_vocab
        for i, t in enumerate(tokens):
            if not (0 <= t < n_vocab):
                raise InvalidArgument(f"{what}[{i}] = {t} is outside the vocabulary [0, {n_vocab})")

    def prefill(self, tokens: Sequence[int]) -> StepOutcome:
        """Run the prompt through the model; the outcome's one token is the first generated.

        Args:
            tokens: prompt ids, 1 <= len < n_ctx, each in [0, n_vocab).
        Raises:
            InvalidArgument: empty prompt, id outside the vocabulary, prompt
                that leaves no room in the context. FailedPrecondition: already
                prefilled. NotFound: closed.
        """
        toks = [int(t) for t in tokens]
        with self._lock:
            self._check_open()
            if self._pending is not None:
                raise FailedPrecondition(f"session {self.sid} is already prefilled")
            if not toks:
                raise InvalidArgument("empty prompt: prefill needs at least one token")
            if len(toks) >= self.n_ctx:
                raise InvalidArgument(
                    f"prompt of {len(toks)} tokens does not fit the context of {self.n_ctx} tokens"
                    f" (at most {self.n_ctx - 1}, one position is kept for generation)")
            self._check_tokens(toks, "tokens")
            self.last_used = time.monotonic()
            mode = "none" if self.sampling.greedy else "last"
            with self.core.engine_lock:
                t0 = time.perf_counter()
                first_greedy, logits = self._prefill(toks, mode == "last")
                first = self._choose(first_greedy, logits)
                ms = (time.perf_counter() - t0) * 1e3
            self._pending = first
            return StepOutcome([first], 0, 0, ms, self.core.t_ms, self._session.n_past, self.n_ctx)

    def step(self, draft: Sequence[int]) -> StepOutcome:
        """Verify K drafts (K = 0: one decode step) and accept the greedy prefix.

        Args:
            draft: K token ids, 0 <= K <= max_k, each in [0, n_vocab).
        Returns:
            StepOutcome with R + 1 tokens; the KV cache holds the old pending
            token and the R accepted drafts (the K - R rejected ones rolled back).
        Raises:
            InvalidArgument: K > max_k or an id outside the vocabulary.
            FailedPrecondition: not prefilled, or drafts on a sampling session.
            ResourceExhausted: n_past + 1 + K > n_ctx (the context is full).
            NotFound: closed.
        """
        drf = [int(t) for t in draft]
        k = len(drf)
        with self._lock:
            self._check_open()
            if self._pending is None:
                raise FailedPrecondition(f"session {self.sid} has no prefill yet")
            if k > self.core.config.max_k:
                raise InvalidArgument(f"draft of {k} tokens exceeds max_k = {self.core.config.max_k}")
            self._check_tokens(drf, "draft")
            if k and not self.sampling.greedy:
                raise FailedPrecondition(
                    f"session {self.sid} samples (temperature {f32_str(self.sampling.temperature)}):"
                    " drafts are verified for greedy sessions only")
            n_past = self._session.n_past
            if n_past + 1 + k > self.n_ctx:
                raise ResourceExhausted(
                    f"context full: n_past {n_past} + 1 + K {k} > n_ctx {self.n_ctx}")
            self.last_used = time.monotonic()
            mode = "none" if self.sampling.greedy else "last"
            with self.core.engine_lock:
                t0 = time.perf_counter()
                argmax, logits = self._forward([self._pending] + drf, mode)
                r = longest_accepted_prefix(drf, argmax)
                if r < k:
                    self._session.rollback(n_past + 1 + r)
                bonus = self._choose(argmax[r], logits)
                ms = (time.perf_counter() - t0) * 1e3
            if k == 0 and self.sampling.greedy:
                self.core.observe_decode(ms)
            self._pending = bonus
            return StepOutcome(drf[:r] + [bonus], k, r, ms, self.core.t_ms,
                               self._session.n_past, self.n_ctx)

    def _prefill(self, tokens: list[int], want_logits: bool):
        """The prompt's forward with the output head on its last position only."""
        return self._engine_call(self._session.prefill, tokens, logits=want_logits)

    def _forward(self, tokens: list[int], mode: str):
        return self._engine_call(self._session.forward, tokens, logits=mode)

    def _engine_call(self, fn, tokens: list[int], **kw):
        try:
            return fn(tokens, **kw)
        except EngineError as exc:
            if exc.name == "ES_ERR_CAPACITY":
                raise ResourceExhausted(f"session {self.sid}: {exc.message}") from None
            if exc.name == "ES_ERR_INVALID_ARG":
                raise InvalidArgument(f"session {self.sid}: {exc.message}") from None
            raise

    def _choose(self, argmax_token, logits) -> int:
        if self.sampling.greedy:
            return int(argmax_token)
        s = self.sampling
        tok, self._rng = sample(logits[-1], temperature=s.temperature, top_k=s.top_k,
                                top_p=s.top_p, min_p=s.min_p, rng=self._rng)
        return tok

    def close(self) -> None:
        """Free the KV cache (waits for an in-flight step). Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._session.close()
        self.core._forget(self)


def engine_error(exc: EngineError, who: str) -> Exception:
    """An engine failure as the VerifierError the client gets (others stay EngineError)."""
    if exc.name == "ES_ERR_CAPACITY":
        return ResourceExhausted(f"{who}: {exc.message}")
    if exc.name == "ES_ERR_INVALID_ARG":
        return InvalidArgument(f"{who}: {exc.message}")
    return exc


class VerifierCore:
    """The loaded model, the engine lock, T, the session registry, the
    scheduler and the prefix cache.

    Engine threads: every session's pool has max(n_threads, batch_threads)
    threads; a forward over one session (a lone generation's decode step or
    decode run, the step-by-step sessions) runs on n_threads of them, an
    iteration of the scheduler that batches >= 2 sessions or feeds one a
    prefill chunk of scheduler.MANY_TOKENS or more on batch_threads. With both
    0 that is the usable CPUs less one for one session (a core kept for the
    services' Python and anything else on the host) and every usable CPU for a
    batch or a prefill (bench/README.md, serve_bench sessions 7 and 10). The
    config kept here has both resolved.

    Args:
        config: model path, n_ctx, n_threads, batch_threads, max_k, max_sessions, idle
            timeout, batch_max, batch_tokens, prefill_chunk, prefix cache settings.
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
        self.pool_threads = max(n_threads, batch_threads)
        self.model = Model(config.model)
        info = self.model.info
        self.n_vocab = info.n_vocab
        if config.n_ctx < MIN_CTX:
            raise InvalidArgument(f"n_ctx must be >= {MIN_CTX}, got {config.n_ctx}")
        self.engine_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sessions: dict[str, VerifierSession] = {}   # every open session
        self._named: dict[str, VerifierSession] = {}      # unary (addressable) sessions
        self.t_ms = 0.0
        self._t_alpha = 0.1
        self.scheduler = Scheduler(self.engine_lock, config.batch_max, config.batch_tokens,
                                   config.prefill_chunk, threads=(n_threads, batch_threads),
                                   decode_steps=config.decode_steps)
        self.prefix_cache = PrefixCache(config.prefix_cache_sessions if config.prefix_cache else 0)
        self._gen_active = 0                              # sessions held by generations

    @property
    def active_sessions(self) -> int:
        """Sessions in use by streams, unary clients and generations (not the idle cached ones)."""
        with self._lock:
            return len(self._sessions) + self._gen_active

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
        es = self.model.new_session(n_ctx=self.config.n_ctx, n_threads=self.pool_threads)
        try:
            es.threads = self.config.n_threads
        except EngineError:
            es.close()
            raise
        return es

    def acquire(self, prompt: Sequence[int]) -> tuple[Session, int]:
        """An engine session for a generation of ``prompt``, and how many prompt tokens it already holds.

        Takes the prefix cache's session sharing the longest prefix with the
        prompt and rolls its KV back to that prefix; else, when the cache is
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
            session, n = self.prefix_cache.take(prompt)
            if session is None and 0 < self.prefix_cache.capacity <= len(self.prefix_cache):
                session, n = self.prefix_cache.evict_lru(), 0
            if session is None:
                while (len(self._sessions) + self._gen_active + len(self.prefix_cache)
                       >= self.config.max_sessions):
                    old = self.prefix_cache.evict_lru()
                    if old is None:
                        raise ResourceExhausted(
                            f"{len(self._sessions) + self._gen_active} sessions already open"
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

    def release(self, session: Session, kv_tokens: Sequence[int] | None) -> None:
        """Give back a generation's session.

        Args:
            kv_tokens: the tokens in its KV cache, in order (positions beyond
                them are rolled back first); None: free it (state unknown).
        """
        keep = kv_tokens is not None and len(kv_tokens) > 0
        try:
            if keep and session.n_past > len(kv_tokens):
                session.rollback(len(kv_tokens))
        except EngineError:   # close() freed it meanwhile: a generation that outlived a stop
            keep = False
        with self._lock:
            self._gen_active -= 1
            evicted = self.prefix_cache.put(session, kv_tokens) if keep else [session]
        for s in evicted:
            s.close()

    def observe_decode(self, ms: float) -> None:
        """Fold one plain decode step's time into T (exponential moving average)."""
        self.t_ms = ms if self.t_ms <= 0 else (1 - self._t_alpha) * self.t_ms + self._t_alpha * ms

    def warm_up(self, steps: int = 8) -> None:
        """Prefill a short prompt and time plain decode steps to seed T."""
        s = self.open(Sampling(), named=False)
        try:
            out = s.prefill([min(1, self.n_vocab - 1)] * 4)
            for _ in range(steps):
                out = s.step([])
        finally:
            s.close()

    def open(self, sampling: Sampling, named: bool) -> VerifierSession:
        """Create a session (KV cache of config.n_ctx tokens).

        Args:
            sampling: the session's sampling parameters.
            named: True for a unary session addressable by id (freed by
                close or the idle timeout); False for a stream's session.
        Raises:
            ResourceExhausted: max_sessions already open, or no memory for the KV cache.
        """
        evicted = []
        with self._lock:
            while len(self._sessions) + self._gen_active + len(self.prefix_cache) >= self.config.max_sessions:
                old = self.prefix_cache.evict_lru()
                if old is None:
                    raise ResourceExhausted(
                        f"{len(self._sessions) + self._gen_active} sessions already open"
                        f" (max_sessions {self.config.max_sessions})")
                evicted.append(old)
            sid = uuid.uuid4().hex
            # reserve the slot before the (slow) allocation
            self._sessions[sid] = None  # type: ignore[assignment]
        for old in evicted:
            old.close()
        try:
            es = self.new_engine_session()
        except EngineError as exc:
            with self._lock:
                self._sessions.pop(sid, None)
            if exc.name == "ES_ERR_NOMEM":
                raise ResourceExhausted(f"cannot allocate a session: {exc.message}") from None
            raise
        vs = VerifierSession(self, es, sampling, sid)
        with self._lock:
            self._sessions[sid] = vs
            if named:
                self._named[sid] = vs
        return vs

    def get(self, sid: str) -> VerifierSession:
        """The unary session ``sid``. Raises NotFound when unknown or closed."""
        with self._lock:
            vs = self._named.get(sid)
        if vs is None or vs.closed:
            raise NotFound(f"unknown or closed session {sid!r}")
        return vs

    def _forget(self, vs: VerifierSession) -> None:
        with self._lock:
            self._sessions.pop(vs.sid, None)
            self._named.pop(vs.sid, None)

    def reap_idle(self, now: float | None = None) -> int:
        """Close unary sessions idle for more than session_idle_s. Returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [s for s in self._named.values()
                    if now - s.last_used > self.config.session_idle_s]
        for s in idle:
            s.close()
        return len(idle)

    def close(self) -> None:
        """Close every session (the prefix cache's too), then the model.

        Holds the engine lock meanwhile, so a forward still running (a generation
        whose RPC outlived the server's grace period) finishes first; a later one
        fails with EngineError (session closed) instead of touching freed memory.
        """
        with self._lock:
            sessions = [s for s in self._sessions.values() if s is not None]
            cached = self.prefix_cache.clear()
        for s in sessions:
            s.close()
        with self.engine_lock:
            for c in cached:
                c.close()
            self.model.close()
