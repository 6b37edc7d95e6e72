"""One generation's loop beside the engine: prefill, then decode or draft -> verify rounds.

No gRPC here (the draft link is handed in). The coordinator starts a
generation (GenerateTokens) and receives one RoundEvent per engine step; it
detokenizes, matches stop strings and streams, and ends the generation early
by cancelling (``cancel`` event). Per generation:

    session = VerifierCore.acquire(prompt)   # prefix cache: KV of a shared prefix kept
    prefill the rest of the prompt in chunks of prefill_chunk tokens (one
        scheduler step each; the head runs on each chunk's last position)
        -> the first token
    per round (until an EOS token, max_tokens output tokens or a full context):
        k_cap = min(k, max_tokens - produced - 1, n_ctx - n_past - 1)
        draft = the controller's choice: cached tail | a proposal waited for | none
        [an in-flight proposal for the current history, collected after the forward]
        one scheduler step over [pending] + draft -> argmax a[0..K]
        R = longest prefix with draft[i] == a[i]; roll back the K - R rejected
        positions; the round yields draft[:R] + [a[R]]
    VerifierCore.release(session, tokens in its KV)    # back to the prefix cache

A speculative round's event says where its wall time went beside the forward (RoundEvent.cost,
echospec.v1.RoundCost): the draft link (before and after), the scheduler step beyond its forward,
the accept step and its KV rollback, timed with perf_counter around those calls (a few per round).

The accept rule and its counters are those of sessions.py (tries, hits,
kv_rolls per round); the rounds' tokens are exactly the tokens plain greedy
decoding produces, so the output does not depend on the drafts or on the
prefix cache. A round stops at the first EOS token or at max_tokens: the
caller's cut-off (stop strings) applies to tokens it already has. The draft
service failing mid-run ends speculation for this generation (spec_reason
says why); decoding carries on plainly.

Constrained output (a request's grammar, services/text/grammar.py): every
token is chosen under the grammar's mask from the logits rows (the masked
argmax, or a draw from the masked row), one forward per round, never an
in-engine run. The masks of a round's positions (after each draft prefix) are
computed on the generation's worker thread while the forward runs. A
speculative generation drafts the tokens the grammar forces (source grammar,
up to max_k, whatever k) in place of the draft service's proposal; a draft
service proposal is cut where the grammar refuses it. R is the longest prefix
with draft[i] == the masked argmax at its position; the matcher rolls back the
K - R rejected tokens with the KV cache and takes the bonus token, so the
output is the same with speculation on or off.

Repetition penalties (Sampling.penalties, services/common/penalties.py) take the same path:
every token is chosen from its logits row penalised with the counts of the tokens before it
(prompt, output, and on a verify row the drafts before that row), then masked by a grammar if
any; no in-engine run. A drafted position's penalised argmax depends only on tokens known at
verify time, so speculation stays on and the output is still that of plain decoding.
Logprobs (``logprobs``): every token of such a generation comes from a logits row (no in-engine
greedy run; a verify takes every position's row), and its event carries the token's logprob and
the ``top_logprobs`` most likely alternatives from that row (logprobs.py: log_softmax of the raw
row, after the grammar's mask). The rows are computed on the generation's own thread, never the
scheduler's; a generation that does not ask pays nothing.

Token trees (``tree_nodes`` > 0; greedy, no grammar, penalties or logprobs, and an engine that
takes trees: VerifierCore.tree_refusal): the draft link asks for trees beside its chains. With
the cost model, the controller chooses each round's shape: a chain, a tree cut from the kept
proposal tree that continues the history (up to ``tree_nodes`` nodes, no deeper than k_cap), or
no draft (controller.best_shape); with a fixed K, a round whose chain is spelt by a kept tree
verifies tree_accept.round_tree of it: the chain, then up to ``tree_nodes`` nodes beside it. A
tree goes below the pending token as one scheduler step (Step.parents) that keeps the greedy
path at once (tree_accept.accept, keep_path). The round yields that path's drafts and the
argmax of its last node, what a chain verify of the path gives; K counts the nodes, so
kv_rolls = the nodes not kept. A round whose path left the chain drafts next from the tree's rest
of that path.

Verify runs (``runs``: a greedy chain generation, no grammar, penalties, logprobs or trees, and
the verifier's verify_runs setting): the controller asks for run_fetch_factor x k tokens, and a
round that drafts all the K it may take (min(k, k_cap): a cost model that chose fewer would take
more after the hits that let a run go on, and a run keeps its first round's K) from the head of a
cache that holds at least two more rounds hands the scheduler the cache but its last k + 1 tokens
(Step.verify_run). Run alone, the engine verifies round after
round of it while every draft is kept, the bonus is the next cached token and k drafts are left
(Session.verify_run); the
loop then replays each round through the controller and yields each as its own event, as if it
had run by itself (the first carries the round's Python in its wall and cost; the others their
engine time). A run leaves the cache's last k + 1 tokens to the loop and asks no proposal in
flight; the round after it drafts those k tokens and asks the next proposal beside its forward, as
any round whose cache runs low does, so proposals go out as they would without runs. (A proposal
asked beside every run, as long as the cache plus a fetch, let runs use the whole cache but cost
more than it saved: on a 2-thread forward the draft service took a core from the engine, and a
proposal still in flight when a short run ended held the next proposal back.)

The draft prior (core.prior, services/draft/prior.py; a greedy speculative generation without a
grammar, penalties or logprobs): a round for which the controller has no draft verifies one token,
the one the model most often wrote after the history's last 1-4 tokens, while the generation's own
acceptance of these drafts (PriorStats) is at least its floor and passes the gain condition with
the live V(1), T and overhead (``_prior_draft``). Its event has source DRAFT_SOURCE_PRIOR and
counts as any draft (tries, hits, kv_rolls); for the controller the round is a plain step that
moved the output on by its tokens (SpecController.on_other), so its cache, back-off and
per-source acceptance are the draft service's alone. Never a tree round or a verify run.

Plain decoding (no draft link, from the start or once the draft service is
lost) is a stream of the scheduler (``_PlainStream``): the scheduler's own
thread takes each step's token and queues the next step right after the
forward, and this generator only reads the tokens, so a batch of decoding
sessions never waits for the generations' threads between iterations. The
rounds and their events are those of the step-by-step loop.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from echospec.v1.common_pb2 import DraftSource, FinishReason
from echospec_client.limits import MAX_TOP_LOGPROBS
from echospec.services.verifier.engine import (ES_ERR_BAD_WEIGHTS, MAX_TREE_NODES, EngineError,
                                              rng_advance, sample)
from echospec.services.common.floats import f32_str
from echospec.services.common.penalties import Penalties, PenaltyError
from echospec.services.text.grammar import Constraint, GrammarError, GrammarSpec, masked, masked_argmax
from echospec.services.verifier.controller import CostModel, SpecController, best_k
from echospec.services.draft.prior import PriorStats
from echospec.services.verifier.logprobs import TokenLogprob, token_logprob
from echospec.services.draft.memory import namespace_problem
from echospec.services.verifier.scheduler import Cancelled, Step
from echospec.services.verifier.tree_accept import (first_branch, reroot, reroot_nodes, round_tree,
                                                    verify_tree)
from echospec.services.verifier.sessions import (FailedPrecondition, InvalidArgument, Sampling,
                                                 engine_error, longest_accepted_prefix)

FINISH_CONTEXT = FinishReason.Value("FINISH_REASON_CONTEXT")
SOURCE_GRAMMAR = DraftSource.Value("DRAFT_SOURCE_GRAMMAR")
SOURCE_PRIOR = DraftSource.Value("DRAFT_SOURCE_PRIOR")
# An in-engine decode run (Scheduler decode_steps) takes at most about this long at the current T,
# so a stream's tokens still reach its client at least this often on a slow model.
DECODE_RUN_MS = 50.0


class DraftUnavailable(Exception):
    """The draft service cannot be reached or failed; the reason is the message."""


@dataclass(frozen=True)
class GenerationRequest:
    """What a generation needs (validated by ``check``)."""

    prompt: list[int]
    max_tokens: int
    eos_ids: frozenset
    sampling: Sampling
    spec: bool = False
    k: int = 4
    fixed_k: bool = False
    eager: bool = False               # back-off rounds still ask in flight: the draft session has a
                                      # prediction, or the engine leaves a CPU free (controller.eager)
    prediction: tuple = ()            # the draft session's prediction, digit and line-break tokens
    digit_tokens: tuple = ()          # (ids checked: the draft service drafts them)
    line_break_tokens: tuple = ()
    draft_namespace: str = ""
    resumed: int = 0                  # the prompt's last tokens that are output already (a resume)
    grammar: GrammarSpec | None = None   # constrained output (None: free text)
    logprobs: bool = False            # each event carries its tokens' logprobs
    top_logprobs: int = 0             # alternatives per token (0..MAX_TOP_LOGPROBS, logprobs only)
    tree_nodes: int = 0               # draft nodes of a token-tree round (0: chains; spec only)


@dataclass
class RoundEvent:
    """One engine step of a generation (times in ms); the first is the prefill's."""

    tokens: list[int]                 # R accepted drafts then the bonus token (prefill: the first token)
    k: int = 0                        # drafts verified
    accepted: int = 0                 # R
    v_ms: float = 0.0                 # forward (+ rollback) time; the prefill's: all its chunks
    t_ms: float = 0.0                 # the verifier's T estimate
    wall_ms: float = 0.0              # the round's wall time in this loop
    n_past: int = 0
    n_ctx: int = 0
    proposals: int = 0                # draft round trips in this round
    cached_prompt_tokens: int = 0     # prefill only
    spec_reason: str = ""             # set when speculation stops
    source: int = 0                   # echospec.v1.DraftSource of the draft (0: none)
    k_choice: str = ""                # the cost model's choice of K and why, when it changed
    finish: int = 0                   # FINISH_CONTEXT on a last event without tokens
    prefill: bool = False
    logprobs: list = field(default_factory=list)   # TokenLogprob per token (request.logprobs)
    tree_nodes: int = 0               # a token-tree round: its draft nodes (= k); 0: a chain round
    chain_accepted: int = 0           # a token-tree round: R of a verify of its draft chain alone
    # a round whose shape the cost model chose: (expected accepted drafts, expected ms V + o [+ hop]);
    # the rounds of a verify run carry its first round's
    expected: tuple | None = None
    # a round of the speculative loop: where its wall time went beside the forward (ms), as
    # (draft, sched, accept, rollback): echospec.v1.RoundCost's draft_ms .. rollback_ms
    cost: tuple | None = None


def check(core: Any, req: GenerationRequest) -> None:
    """Refuse a request the loop cannot run.

    Raises:
        InvalidArgument: empty prompt, prompt that leaves no room in the
            context, id outside the vocabulary (prompt, prediction, digit and line-break tokens,
            EOS ids), a draft_namespace the draft service would not take, digit tokens other than
            0 or 10, max_tokens < 1, k outside
            [1, max_k] on a speculative request.
        FailedPrecondition: speculation asked for a sampling request.
    """
    n_ctx, n_vocab = core.config.n_ctx, core.n_vocab
    if not req.prompt:
        raise InvalidArgument("empty prompt: a generation needs at least one token")
    # n_ctx bounds the prompt; with KV eviction a resumed generation's output so far (the
    # prompt's resumed part) may run past it, as it did on the verifier it moved from
    own = len(req.prompt) - req.resumed if 0 <= req.resumed < len(req.prompt) else len(req.prompt)
    if own >= n_ctx or len(req.prompt) >= core.context_limit:
        raise InvalidArgument(
            f"prompt of {len(req.prompt)} tokens does not fit the context of {n_ctx} tokens"
            f" (at most {n_ctx - 1}, one position is kept for generation)")
    for i, t in enumerate(req.prompt):
        if not 0 <= t < n_vocab:
            raise InvalidArgument(f"prompt[{i}] = {t} is outside the vocabulary [0, {n_vocab})")
    if req.max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be >= 1, got {req.max_tokens}")
    if not 0 <= req.resumed < len(req.prompt):
        raise InvalidArgument(f"resumed_tokens must be in [0, {len(req.prompt)}) (the prompt's "
                              f"output part; the prompt keeps >= 1 token of its own), got {req.resumed}")
    for name, ids in (("prediction", req.prediction), ("digit_tokens", req.digit_tokens),
                      ("line_break_tokens", req.line_break_tokens)):
        for i, t in enumerate(ids):
            if not 0 <= t < n_vocab:
                raise InvalidArgument(f"{name}[{i}] = {t} is outside the vocabulary [0, {n_vocab})")
    for t in sorted(req.eos_ids):
        if not 0 <= t < n_vocab:
            raise InvalidArgument(f"eos_ids holds {t}, outside the vocabulary [0, {n_vocab})")
    if namespace_problem(req.draft_namespace):
        raise InvalidArgument(namespace_problem(req.draft_namespace))
    if len(req.digit_tokens) not in (0, 10):
        raise InvalidArgument(f"digit_tokens must hold 0 or 10 ids, got {len(req.digit_tokens)}")
    if req.spec:
        if not 1 <= req.k <= core.config.max_k:
            raise InvalidArgument(f"k must be in [1, max_k = {core.config.max_k}], got {req.k}")
        if not req.sampling.greedy:
            raise FailedPrecondition(
                f"speculation needs greedy decoding (temperature {f32_str(req.sampling.temperature)})")
    check_sampling(req.sampling)
    if not 0 <= req.tree_nodes < MAX_TREE_NODES:
        raise InvalidArgument(f"tree_nodes must be in [0, {MAX_TREE_NODES - 1}] (-1 in a request: "
                              f"chains), got {req.tree_nodes}")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgument(f"top_logprobs ({req.top_logprobs}) needs logprobs to be true")


def check_sampling(s: Sampling) -> None:
    """Refuse sampling parameters the engine's sampler rejects mid-generation (the coordinator
    checks them too; this guards direct callers of the verifier).

    Raises:
        InvalidArgument: a non-finite temperature, top_p or min_p, min_p outside [0, 1],
            top_k < 0, or a penalty out of its range (Penalties.check).
    """
    import math
    for name, v in (("temperature", s.temperature), ("top_p", s.top_p), ("min_p", s.min_p)):
        if not math.isfinite(v):
            raise InvalidArgument(f"sampling.{name} must be finite, got {f32_str(v)}")
    if not 0.0 <= s.min_p <= 1.0:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1], got {f32_str(s.min_p)}")
    if s.top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0, got {s.top_k}")
    try:
        s.penalties.check("sampling.")
    except PenaltyError as exc:
        raise InvalidArgument(str(exc)) from None


class _Run:
    """State of one generation (one thread drives it)."""

    def __init__(self, core: Any, req: GenerationRequest, session: Any, cached: int,
                 cancel: threading.Event):
        self.core, self.req, self.session, self.cancel = core, req, session, cancel
        self.cached = cached
        self.kv_tokens: list[int] = list(req.prompt[:cached])  # tokens whose KV the session holds
        # the conversation's own prompt (the prefix cache's Worth it rule): a resumed
        # generation's output so far is output, which the next turn may tokenize otherwise
        self.prompt_len = len(req.prompt) - (req.resumed if 0 <= req.resumed < len(req.prompt) else 0)
        self.n_ctx = core.context_limit   # with KV eviction a generation runs past n_ctx
        self.rng = int(req.sampling.seed) & 0xFFFFFFFFFFFFFFFF
        if not req.sampling.greedy:   # a resumed generation: the draws of the output so far
            self.rng = rng_advance(self.rng, req.resumed)
        self.marks = False            # yield FLUSH before waiting (run_generation's marks)
        self.drafts: Any = None       # a speculative generation's _Drafts (its counts outlive it)
        self.history: list[int] = []  # prompt + output so far (the rounds extend it)
        self.gram: Constraint | None = None   # the grammar's matcher over the output so far
        # repetition penalties (None: off): every token then comes from a penalised logits row
        self.pen: Penalties | None = req.sampling.penalties if req.sampling.penalties.active else None
        self.beside: concurrent.futures.ThreadPoolExecutor | None = None   # its worker (masks)

    def release(self) -> None:
        """Give the session back (to the prefix cache) once; called before the last event, so a
        request that follows the generation's end finds its KV."""
        if self.session is not None:
            session, self.session = self.session, None
            self.core.scheduler.leave(session)
            self.core.release(session, self.kv_tokens, self.prompt_len)

    def step_tree(self, tokens: list[int], parents: list[int]) -> Step:
        """One token-tree step (tree_accept.verify_tree's tree): the scheduler verifies it and
        keeps its greedy path (Step.path) at once; the path's tokens are then in the KV cache."""
        st = self.core.scheduler.run(Step(self.session, tokens, "all", "none", parents=parents),
                                     self.cancel)
        self.kv_tokens.extend(tokens[i] for i in st.path)
        return st

    def step(self, tokens: list[int], head: str, logits: str, decode: int = 0,
             stop_ids: tuple = (), verify_run: tuple | None = None) -> Step:
        """One engine step; with decode > 1 (one greedy token, no logits) the scheduler may run
        up to ``decode`` steps in one call (Step.decode): argmax is then every step's token. With
        ``verify_run`` (Step.verify_run) it may run a verify run: its result is then ``st.run``."""
        st = self.core.scheduler.run(Step(self.session, tokens, head, logits, decode=decode,
                                          stop_ids=stop_ids, verify_run=verify_run), self.cancel)
        if st.run is not None:   # the KV holds the pending token and every run token but the last
            self.kv_tokens.append(tokens[0])
            self.kv_tokens.extend(st.run.tokens[:-1])
            return st
        self.kv_tokens.extend(tokens)
        if st.step_ms is not None:   # the run fed each token but the last
            self.kv_tokens.extend(int(t) for t in st.argmax[:-1])
        return st

    @property
    def rows(self) -> bool:
        """Every token is chosen from a logits row here (a grammar or penalties), never by the
        engine's argmax alone."""
        return self.gram is not None or self.pen is not None

    def choose(self, greedy_token: int, logits: Any, allowed: Any = None,
               context: Any = (), drafts: Any = ()) -> int:
        """The token of a logits row (the last of ``logits``): the engine's argmax when greedy,
        else a draw; with penalties the row is first penalised with the counts of ``context`` +
        ``drafts`` (the tokens before its position); under a grammar's mask ``allowed``
        (bool [n_vocab]) only allowed tokens."""
        s = self.req.sampling
        row = None if logits is None else logits[-1]
        if self.pen is not None:
            if s.greedy:
                return self.pick(row, allowed, context, drafts)
            row = self.pen.apply(row, context, drafts)
        if allowed is not None:
            if s.greedy:
                return _masked_argmax(row, allowed)
            row = masked(row, allowed)
        elif s.greedy:
            return int(greedy_token)
        tok, self.rng = sample(row, temperature=s.temperature, top_k=s.top_k,
                               top_p=s.top_p, min_p=s.min_p, rng=self.rng)
        return tok

    def pick(self, row: Any, allowed: Any, context: Any, drafts: Any = ()) -> int:
        """The greedy token of one logits row (float32 [n_vocab]) under the penalties (counts of
        ``context`` + ``drafts``) and the grammar's mask ``allowed`` (None: no grammar)."""
        if self.pen is not None:
            row = self.pen.apply(row, context, drafts)
        return _argmax(row) if allowed is None else _masked_argmax(row, allowed)

    def logprob(self, row: Any, token: int, allowed: Any = None) -> TokenLogprob:
        """The logprob of ``token`` chosen from logits ``row`` (under the mask ``allowed``)."""
        try:
            return token_logprob(row, token, self.req.top_logprobs, allowed)
        except ValueError as exc:   # a row without a finite logit: as the engine reports one
            raise EngineError(ES_ERR_BAD_WEIGHTS, str(exc)) from None

    def logprobs(self, rows: Any, tokens: list[int], masks: Any = None) -> list:
        """The logprobs of ``tokens``, token i chosen from ``rows[i]`` (under ``masks[i]``);
        [] when the request does not ask for them."""
        if not self.req.logprobs:
            return []
        return [self.logprob(rows[i], t, None if masks is None else masks[i])
                for i, t in enumerate(tokens)]

    def prefill(self) -> tuple[int, float, list]:
        """The rest of the prompt in chunks; returns (first token, forward ms, its logprobs)."""
        rest = self.req.prompt[self.cached:]
        chunk = self.core.scheduler.prefill_chunk
        want = "none" if self.req.sampling.greedy and not self.rows and not self.req.logprobs \
            else "last"
        ms = 0.0
        st = None
        for i in range(0, len(rest), chunk):
            st = self.step(rest[i:i + chunk], "last", want)
            ms += st.forward_ms
        allowed = self.gram.allowed() if self.gram is not None else None
        first = self.choose(st.argmax[0], st.logits_out, allowed, self.req.prompt)
        lps = self.logprobs(st.logits_out[-1:], [first], None if allowed is None else [allowed]) \
            if self.req.logprobs else []
        return first, ms, lps


def _argmax(row: Any) -> int:
    """The first index of the largest logit, a NaN row reported as the engine reports one."""
    if np.isnan(row).any():
        raise EngineError(ES_ERR_BAD_WEIGHTS,
                          f"the logits row holds a NaN at position {int(np.argmax(np.isnan(row)))}")
    return int(np.argmax(row))


def _masked_argmax(row: Any, allowed: Any) -> int:
    """masked_argmax with a NaN row reported as the engine reports one (ES_ERR_BAD_WEIGHTS)."""
    try:
        return masked_argmax(row, allowed)
    except GrammarError:
        raise
    except ValueError as exc:
        raise EngineError(ES_ERR_BAD_WEIGHTS, str(exc)) from None


FLUSH = object()   # run_generation(marks=True): nothing more is ready yet (the caller may send what it has)


def run_generation(core: Any, req: GenerationRequest, cancel: threading.Event,
                   open_draft: Callable[[], Any] | None = None, marks: bool = False
                   ) -> Iterator[RoundEvent]:
    """Run one generation; yield a RoundEvent per engine step.

    Args:
        core: VerifierCore (config, scheduler, acquire/release, T).
        req: the request (``check`` it first).
        cancel: set by the caller to end the generation; the scheduler gives up
            a step that has not started (call core.scheduler.wake() after setting it).
        open_draft: () -> a draft link (send_propose, recv_proposal, append,
            close, cancel) for a speculative request, or raises DraftUnavailable;
            None: no draft service configured.
        marks: also yield FLUSH where what came before may go out: after the prefill's
            event, before a plain decoding generation waits for its scheduler (so a caller
            that runs the generation on its own thread sends the events it holds then,
            several rounds per message when it lags), and right before a speculative
            round's engine call (a caller that hands the events to another thread then wakes
            it as the forward starts: that thread's Python runs beside the forward, and no
            C call between the hand-off and the forward lets it take the GIL from the loop;
            the round's events wait for the round's draft step, tens of microseconds), and
            before a round that may wait for a proposal (nothing is held while it waits).
    Yields:
        The prefill's event (tokens = [first token]), then one per round; a last
        event with finish = FINISH_CONTEXT when the KV cache fills up. Ends
        silently when cancelled.
    Raises:
        InvalidArgument, ResourceExhausted, VerifierError (INTERNAL): an engine failure
            (sessions.engine_error; the session goes back with its KV cache as before the
            failing call); a grammar refused or failing (the matcher's message).
    """
    gram = None
    if req.grammar is not None:   # before a session is taken: a bad grammar costs no KV
        gram = core.constraint(req.grammar, sorted(req.eos_ids),
                               req.prompt[len(req.prompt) - req.resumed:] if req.resumed else ())
    session, cached = core.acquire(req.prompt)
    run = _Run(core, req, session, cached, cancel)
    run.marks = marks
    run.gram = gram
    if gram is not None:
        run.beside = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
    try:
        yield from _loop(run, open_draft)
    except Cancelled:
        return
    except EngineError as exc:
        raise engine_error(exc, "generation") from None
    except GrammarError as exc:
        raise InvalidArgument(str(exc)) from None
    finally:
        run.release()
        if run.beside is not None:
            run.beside.shutdown(wait=False)


def _loop(run: _Run, open_draft: Callable[[], Any] | None) -> Iterator[RoundEvent]:
    req = run.req
    t0 = time.perf_counter()
    reason = ""
    draft = None
    if req.spec:
        if run.core.kv_eviction != "none":   # the gating rule (coordinator/gating.py), for direct callers
            reason = f"verifier KV eviction is {run.core.kv_eviction!r} (needs 'none'); decoded plainly"
        elif run.core.config.sparse_attention > 0:   # the same rule
            reason = (f"verifier uses sparse attention (--sparse-attention "
                      f"{run.core.config.sparse_attention}; needs full attention); decoded plainly")
        elif open_draft is None:
            reason = "no draft service configured at the verifier; decoded plainly"
        else:
            try:
                draft = open_draft()
            except DraftUnavailable as exc:
                reason = f"{exc}; decoded plainly"
    try:
        yield from _rounds(run, draft, reason, t0, req.spec and run.core.kv_eviction == "none")
    finally:
        if draft is not None:
            if run.drafts is not None:
                run.drafts.flush(run.history)
            draft.close()
        if run.drafts is not None and run.drafts.ctl.cost is not None:
            run.core.spec_priors.learn(req.draft_namespace, run.drafts.ctl)


# seconds the round that asked for an in-flight proposal waits past its forward for it: a fast
# model's forward can end before the draft service's answer (tens of us in one process); a
# proposal later than that is left in flight, never waited for
IN_FLIGHT_GRACE_S = 0.005


class _Drafts:
    """A speculative generation's draft source: the controller over a draft link.

    ``before`` picks the round's draft (and may start an in-flight proposal),
    ``after`` collects that proposal and updates the controller. A failing
    draft service ends speculation for the generation (``reason`` says why).
    """

    def __init__(self, link: Any, k: int, fixed_k: bool, prompt: list[int], eager: bool = False,
                 resumed: int = 0, tree_nodes: int = 0):
        self.link = link
        # token trees (tree_nodes > 0): the latest proposals' trees as (history length at their
        # root, tokens, parents), newest last; a round's chain comes from the controller as
        # ever, and the tree of the proposal it came from is verified in its place (tree_for)
        self.tree_nodes = tree_nodes if link is not None else 0
        self.trees: list[tuple[int, list[int], list[int], list[int]]] = []   # + node sources
        self._pf_base = 0            # history length when the in-flight proposal was asked
        self._pf_fresh = False       # ... in this round (after() gives it IN_FLIGHT_GRACE_S)
        if self.tree_nodes:
            link.tree_nodes = tree_nodes
        self.ctl = SpecController(k=k, cost=None if fixed_k else CostModel(), eager=eager)
        self.synced = 0              # history tokens the draft service has
        self.in_flight = False
        self.reason = ""
        self.source = 0              # DraftSource of the round's draft
        self.run_drafts: list[int] | None = None   # a verify run's drafts (``before``)
        if link is not None:
            # indexed while the prompt is prefilled; a resumed generation's output so far goes
            # in as output (the draft session's first append is its prompt)
            head = len(prompt) - resumed
            link.append(prompt[:head])
            if resumed:
                link.append(prompt[head:])
            self.synced = len(prompt)

    def _lost(self, exc: DraftUnavailable) -> None:
        self.reason = f"{exc}; decoded plainly from here on"
        self.link.cancel()
        self.link = None
        self.in_flight = False
        self.ctl.drop()

    def before(self, history: list[int], k_cap: int, room: int, tree_room: int = 0, runs: bool = False
               ) -> tuple[list[int], float | None, int]:
        """The round's draft, the blocking draft hop's ms (None: none) and the proposals made;
        the draft's source is then in ``self.source``, the controller's shape in ``self.ctl.shape``
        (a tree: ``self.ctl.round_tree()``), and with ``runs`` the drafts of a verify run in
        ``self.run_drafts`` (None: a round of its own).

        Args:
            history: prompt + output so far (the pending token last).
            k_cap: the most drafts this round may verify. room: output tokens still allowed.
            tree_room: the most nodes a tree round may verify (KV room and tree budget).
            runs: the round may be a verify run (a greedy chain round the engine verifies alone):
                when the controller's cache holds drafts past the round's and its bonus token,
                the run goes on over them while every draft is kept and k of them are left, all
                but the cache's last k + 1 tokens. The proposal in flight is asked as for a round
                of its own (when the cache would not cover the next round): a run has none beside
                it, so the draft service does not take a core from the forwards; the round after
                the run, which drafts the last k tokens, asks it.
        """
        self.run_drafts = None
        if self.link is None:
            return [], None, 0
        drf: list[int] = []
        hop_ms, proposals = None, 0
        self.source = 0
        pending = self.in_flight   # an earlier round's proposal, not come yet: the one at a time
        self._tree_at_hand(history, k_cap, tree_room)
        try:
            kind, arg = self.ctl.plan(k_cap)
            if kind == "propose" and pending:
                kind = "none"
            if kind == "cached":
                drf = arg
                self.source = self.ctl.cache_source
            elif kind == "propose":
                h0 = time.perf_counter()
                self.link.send_propose(history[self.synced:], max(1, min(arg, room - 1)))
                self.synced = len(history)
                proposal = self.link.recv_proposal()
                if self._keep_tree(len(history)):
                    self._tree_at_hand(history, k_cap, tree_room)
                hop_ms = (time.perf_counter() - h0) * 1e3
                proposals = 1
                drf = self.ctl.on_proposal(proposal, k_cap, getattr(self.link, "last_source", 0))
                self.source = self.ctl.cache_source
            # a run leaves the cache's last round (k drafts and its bonus) to the loop, whose round
            # then asks the next proposal in flight beside its forward; it goes on only while k
            # drafts follow a bonus (es_verify_run), so it needs 2 k + 1 to run two rounds
            # Only a round of as many drafts as it may take runs on: a run keeps its first round's
            # K, and a cost model that chose fewer (a low acceptance so far) would take more after
            # the hits that let a run go on.
            cache, k = self.ctl.cache, len(drf)
            if (runs and k and k == min(self.ctl.k, k_cap) and len(cache) - (k + 1) >= 2 * k + 1
                    and cache[:k] == drf):
                self.run_drafts = cache[:len(cache) - (k + 1)]
            if kind != "propose" and k_cap > 0 and not pending:
                n_pf = self.ctl.prefetch_size(len(drf))
                if n_pf:   # in flight while the forward runs
                    self.link.send_propose(history[self.synced:], n_pf)
                    self.synced = len(history)
                    self._pf_base = len(history)
                    self.in_flight = True
                    self._pf_fresh = True
        except DraftUnavailable as exc:
            self._lost(exc)
        return drf, hop_ms, proposals

    def flush(self, history: list[int]) -> None:
        """Send the draft session the history it has not had (the output after the last
        proposal), so that its namespace's shared memory keeps the whole output."""
        if self.link is not None and len(history) > self.synced:
            self.link.append(history[self.synced:])
            self.synced = len(history)

    def quiet_rounds(self) -> int:
        """Rounds from this one on that are plain steps with no draft traffic, after ``before``
        chose no draft: the back-off's skipped rounds (the controller neither proposes nor asks
        in flight until its skip count runs out), unbounded with K = 0, else 1. A greedy
        generation may run them in one engine call (``skipped`` then counts the rest)."""
        ctl = self.ctl
        if self.link is None or self.in_flight or ctl.cache:
            return 1
        if ctl.k <= 0:
            return 1 << 30
        return max(1, ctl.skip)

    def skipped(self, n: int) -> None:
        """n more plain rounds ran inside this one (at most quiet_rounds() - 1)."""
        if self.ctl.k > 0:
            self.ctl.skip = max(0, self.ctl.skip - n)

    def after(self, drf: list[int], tokens: list[int], history: list[int] | None = None,
              tree: bool = False, path: list[int] | None = None, prior: bool = False) -> int:
        """Update after the round verified ``drf`` (or a tree whose chain it is: ``tree``) and
        yielded ``tokens`` after ``history``; returns the proposals collected. ``path``: a tree
        round of the controller's choice (ctl.round_tree): its accepted nodes, counted per node.
        ``prior``: ``drf`` came from the draft prior, not the controller (SpecController.on_other)."""
        if self.link is None:
            return 0
        if prior:
            self.ctl.on_other(tokens)
            drf, path = [], None
        if path is not None:
            self.ctl.on_tree_result(path)
        ready = getattr(self.link, "ready", None)
        fresh, self._pf_fresh = self._pf_fresh, False
        if not self.in_flight or (ready is not None and not ready(IN_FLIGHT_GRACE_S if fresh else 0.0)):
            # nothing in flight, or the proposal has not come (a draft service slower than the
            # forward, even after a short grace in the round that asked): it stays in flight,
            # collected in a later round, never waited for
            if not prior:
                self.ctl.on_result(drf, tokens, count=path is None)
            self._follow_tree(drf, tokens, history, tree)
            return 0
        self.in_flight = False
        try:
            p = self.link.recv_proposal()
        except DraftUnavailable as exc:
            self._lost(exc)
            return 0
        if not prior:
            self.ctl.on_result(drf, tokens, count=path is None)
        self._follow_tree(drf, tokens, history, tree)
        # the tokens produced since the proposal was asked: this round's, or several rounds'
        # when it came late
        since = list(tokens) if history is None else list(history[self._pf_base:]) + list(tokens)
        if self.tree_nodes and self._keep_tree(self._pf_base):
            # the proposal as the chain it holds after those tokens (any branch)
            sub = reroot(self.trees[-1][1], self.trees[-1][2], since)
            rest = first_branch(*sub) if sub is not None else []
            if rest:
                p = since + rest
        self.ctl.on_prefetch(p, since, getattr(self.link, "last_source", 0))
        return 1

    def _keep_tree(self, base: int) -> bool:
        """Keep the proposal just received's tree (its root after ``base`` history tokens)."""
        t = getattr(self.link, "last_tree", None) if self.tree_nodes else None
        if t is None:
            return False
        # (tokens, parents[, node sources]): without sources every node is the proposal's source
        srcs = list(t[2]) if len(t) > 2 else [getattr(self.link, "last_source", 0)] * len(t[0])
        self.trees = self.trees[-1:] + [(base, t[0], t[1], srcs)]
        return True

    def _tree_at_hand(self, history: list[int], k_cap: int, tree_room: int) -> None:
        """Give the controller the newest kept tree continuing ``history`` (rerooted there, with
        its nodes' sources) for its choice of shape; None when there is none."""
        self.ctl.tree = None
        self.ctl.tree_budget = tree_room
        self.ctl.tree_depth = k_cap
        if not self.tree_nodes or tree_room <= 0 or self.ctl.cost is None:
            return
        for base, toks, par, srcs in reversed(self.trees):
            if base > len(history):
                continue
            sub = reroot_nodes(toks, par, history[base:])
            if sub is not None and sub[0]:
                self.ctl.tree = (sub[0], sub[1], [srcs[i] for i in sub[2]])
                return

    def _follow_tree(self, drf: list[int], tokens: list[int], history: list[int] | None,
                     tree: bool) -> None:
        """After a tree round that left ``drf`` for another branch, the controller's cache (the
        chain it drafts from next) is that branch's rest in the tree, where there is one."""
        if not tree or history is None or list(tokens[:-1]) == list(drf[:len(tokens) - 1]):
            return
        walk = list(history) + list(tokens)
        for base, toks, par, _ in reversed(self.trees):
            sub = reroot(toks, par, walk[base:])
            if sub is not None and sub[0]:
                self.ctl.cache = first_branch(*sub)
                return

    def tree_for(self, history: list[int], drf: list[int], budget: int, depth: int
                 ) -> tuple[list[int], list[int]] | None:
        """The round's tree: ``drf`` (the controller's chain) and the other branches of the
        proposal tree it comes from, at most ``budget`` nodes and ``depth`` deep
        (tree_accept.round_tree); None when no kept tree holds drf or the result is a chain."""
        for base, toks, par, _ in reversed(self.trees):
            if base > len(history):
                continue
            sub = reroot(toks, par, history[base:])
            if sub is None:
                continue
            t = round_tree(sub[0], sub[1], drf, budget, depth)
            if t is not None:
                return t
        return None


_CONTEXT = object()   # a stream's mark: the KV cache is full


def _paced_steps(t_ms: float) -> int:
    """Steps of an in-engine run that last about DECODE_RUN_MS at T = t_ms (unbounded while T
    is unknown), so a slow model still hands tokens out that often."""
    return int(DECODE_RUN_MS / t_ms) if t_ms > 0 else 1 << 30


def _run_walls(wall_ms: float, step_ms: list) -> list:
    """Per-step wall times of an in-engine run whose whole round took wall_ms: the first step
    carries the round's Python and hand-off, the others their own engine time."""
    return [wall_ms - sum(step_ms[1:])] + list(step_ms[1:])


class _PlainStream:
    """A plain decoding generation driven by the scheduler (Scheduler.start): ``advance`` runs in
    the scheduler's iteration right after each forward; the reader takes ``out``.

    ``out`` entries: (token, forward ms, T ms, wall ms, n_past, last, logits row or None) per round
    (the row when the request asks for logprobs: the reader computes them), then _CONTEXT when
    the KV cache is full. ``ended``: no further round (set after its last entry); ``error``: why the
    stream failed (Cancelled when it was dropped on cancel).

    A greedy stream lets the engine run several steps in one call when nothing else waits
    (``decode_max``: the steps left before max_tokens or a full KV cache, and no more than
    DECODE_RUN_MS of them at the current T; the EOS ids stop the run): a step's result is
    then several tokens, each taken as its own round. A generation that asks for logprobs takes
    a logits row every step (``rows``) and no such runs.
    """

    def __init__(self, run: _Run, produced: int, r0: float):
        self.run = run
        self.produced = produced
        self.r0 = r0
        self.greedy = run.req.sampling.greedy
        self.rows = not self.greedy or run.req.logprobs   # a logits row per step
        self.out: collections.deque = collections.deque()
        self.ended = False
        self.stopped = False
        self.error: BaseException | None = None
        self.stop_ids = tuple(run.req.eos_ids) if self.greedy else ()
        self.decode_max = self._room(run.session.n_past)

    def _room(self, n_past: int) -> int:
        """Greedy steps the next call may run: none past max_tokens or the KV capacity, about
        DECODE_RUN_MS of them at the current T (0: not greedy, or logprobs asked)."""
        if not self.greedy or self.run.req.logprobs:
            return 0
        return max(1, min(self.run.req.max_tokens - self.produced, self.run.n_ctx - n_past,
                          _paced_steps(self.run.core.t_ms)))

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ended = True

    def advance(self, st: Step) -> list[int] | None:
        """Take a round's result; the next round's tokens, or None when the generation ended."""
        if st.error is not None:
            self.fail(st.error)
            return None
        run = self.run
        core, req = run.core, run.req
        now = time.perf_counter()
        wall_ms = (now - self.r0) * 1e3
        self.r0 = now
        row = None                   # the step's logits row, when logprobs are asked for
        if st.step_ms is not None:   # an in-engine run: its steps' tokens, fed one after another
            toks, step_ms = [int(t) for t in st.argmax], st.step_ms
            run.kv_tokens.extend(st.tokens + toks[:-1])
            wall = _run_walls(wall_ms, step_ms)
        else:
            toks, step_ms, wall = [run.choose(st.argmax[0], st.logits_out)], [st.forward_ms], [wall_ms]
            run.kv_tokens.extend(st.tokens)
            if req.logprobs:
                row = st.logits_out[-1]
        n_past = run.session.n_past - len(toks)
        for tok, ms, w in zip(toks, step_ms, wall):
            n_past += 1
            # T is one session's step on the one-session threads: a single step, or a step of a
            # run of this session alone (a batched run's steps are several sessions' forwards)
            if self.greedy and (st.step_ms is None or not st.shared):
                core.observe_decode(ms)
            last = tok in req.eos_ids
            if not last:
                self.produced += 1
                last = self.produced >= req.max_tokens
            full = not last and n_past + 1 > run.n_ctx
            self.out.append((tok, ms, core.t_ms, w, n_past, last, row))
            if full:
                self.out.append(_CONTEXT)
            if last or full:
                self.ended = True
                return None
        self.decode_max = self._room(n_past)
        return [toks[-1]]


def _stream(run: _Run, history: list[int], produced: int, r0: float) -> Iterator[RoundEvent]:
    """The rest of a generation as plain decoding rounds, stepped by the scheduler."""
    core, session, n_ctx = run.core, run.session, run.n_ctx
    n_past = session.n_past
    if n_past + 1 > n_ctx:
        run.release()   # may close the session (no prefix cache): n_past was read before
        yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx, finish=FINISH_CONTEXT)
        return
    sched, cancel = core.scheduler, run.cancel
    stream = _PlainStream(run, produced, r0)
    mode = "last" if stream.rows else "none"
    sched.start(Step(session, [history[-1]], "all", mode, stream=stream, cancel=cancel,
                     decode=stream.decode_max, stop_ids=stream.stop_ids))

    def ready() -> bool:
        return bool(stream.out) or stream.ended or cancel.is_set()

    try:
        while True:
            if not ready():
                if run.marks:
                    yield FLUSH
                sched.wait_for(ready, 1.0)
            ended = stream.ended
            while stream.out:
                if cancel.is_set():
                    return
                item = stream.out.popleft()
                if item is _CONTEXT:
                    sched.stop(stream)
                    n_past = session.n_past
                    run.release()   # may close the session (no prefix cache)
                    yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx,
                                     finish=FINISH_CONTEXT)
                    return
                tok, fwd_ms, t_ms, wall_ms, n_past, last, row = item
                ev = RoundEvent([tok], 0, 0, fwd_ms, t_ms, wall_ms, n_past, n_ctx, 0)
                if row is not None:
                    ev.logprobs = [run.logprob(row, tok)]
                if last:
                    sched.stop(stream)
                    run.release()
                yield ev
                if last:
                    return
            if cancel.is_set():
                return
            if ended:
                if stream.error is not None and not isinstance(stream.error, Cancelled):
                    raise stream.error
                return
    finally:
        sched.stop(stream)


def _prior_draft(prior: Any, stats: PriorStats, history: list[int], k_cap: int, drafts: "_Drafts",
                 cost: CostModel | None) -> tuple[list[int], float]:
    """A round's draft from the draft prior (services/draft/prior.py) where the controller has
    none: [the token the model most often wrote after the history's last tokens] when there is
    one, room for a draft, a draft link, and the generation's acceptance of these drafts so far
    (``stats.p``) is at least stats.min_p and says a verify of one draft pays (best_k with the live
    V(1), T and overhead: a V(1) measured below T would pass any p); always with a fixed K; else [].
    Returns (draft, the acceptance it was chosen at)."""
    p = stats.p
    if k_cap <= 0 or drafts.link is None or (cost is not None and (p < stats.min_p or
                                                                  best_k(p, 1, cost, hop=False) < 1)):
        stats.idle()
        return [], p
    t = prior.next(history)
    if t is None:
        stats.idle()
        return [], p
    return [t], p


def _output(history: list[int], tokens: list[int], produced: int, eos: frozenset, max_tokens: int
            ) -> tuple[int, bool]:
    """Append a round's tokens to ``history``; returns the output tokens produced then and whether
    the output ended (an EOS token or max_tokens). Drafts accepted past the output's end are no
    output: they are left out of history, so the draft session (its namespace) gets the output only."""
    history.extend(tokens)
    for i, t in enumerate(tokens):
        if t in eos or produced + 1 >= max_tokens:
            del history[len(history) - len(tokens) + i + 1:]
            return produced + (t not in eos), True
        produced += 1
    return produced, False


def _rounds(run: _Run, link: Any, reason: str, t0: float, spec: bool = False) -> Iterator[RoundEvent]:
    """The rounds after the prefill. With a grammar (run.gram) every token is chosen under its
    mask from logits rows (never an in-engine run), and a speculative generation (``spec``)
    drafts the tokens the grammar forces (source grammar), up to max_k of them, in place of
    the draft service's; the draft service's drafts are cut where the grammar refuses them."""
    core, req, session = run.core, run.req, run.session
    gram = run.gram
    eos, max_tokens, n_ctx = req.eos_ids, req.max_tokens, run.n_ctx
    history = list(req.prompt)
    # token trees: greedy speculation without rows or logprobs, where the engine takes them
    trees = req.tree_nodes if (spec and req.sampling.greedy and not run.rows and not req.logprobs
                               and req.tree_nodes > 0 and not core.tree_refusal) else 0
    drafts = _Drafts(link, req.k, req.fixed_k, history, eager=req.eager, resumed=req.resumed,
                     tree_nodes=trees)
    # verify runs (Scheduler: Step.verify_run): greedy chain rounds chosen by the engine's argmax
    runs = (spec and core.config.verify_runs and req.sampling.greedy and gram is None and not run.rows
            and not req.logprobs and not trees)
    drafts.ctl.runs = runs
    # the draft prior: one token for a greedy chain round with no other draft, while it pays
    prior = core.prior if (spec and link is not None and req.sampling.greedy and gram is None
                           and not run.rows and not req.logprobs) else None
    prior_stats = PriorStats() if prior is not None else None
    run.history = history
    if link is not None:
        run.drafts = drafts
        if drafts.ctl.cost is not None:
            # the namespace's acceptance so far seeds this generation's (NamespacePriors)
            core.spec_priors.seed(req.draft_namespace, drafts.ctl)
    first, prefill_ms, first_lps = run.prefill()
    history.append(first)
    produced = 0                     # output tokens so far (EOS excluded)
    done = first in eos
    if not done:
        produced = 1
        done = produced >= max_tokens
    ev = RoundEvent([first], v_ms=prefill_ms, t_ms=core.t_ms, wall_ms=(time.perf_counter() - t0) * 1e3,
                    n_past=session.n_past, n_ctx=n_ctx, cached_prompt_tokens=run.cached,
                    spec_reason=reason, prefill=True, logprobs=first_lps)
    if gram is not None and not done:
        gram.consume([first])
    if done:
        run.release()
    yield ev
    if run.marks:
        yield FLUSH
    greedy = req.sampling.greedy
    mode = "none" if greedy else "last"
    if run.rows or req.logprobs:
        mode = "all"                 # the mask, penalties or logprobs of every row's token
    cost = drafts.ctl.cost
    k_choice = ""
    r0 = time.perf_counter()         # a round's wall time runs from the previous round's hand-off
    while not done:
        if run.cancel.is_set():
            return
        if drafts.link is None and not run.rows:
            yield from _stream(run, history, produced, r0)
            return
        n_past = session.n_past
        if n_past + 1 > n_ctx:
            run.release()
            yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx, finish=FINISH_CONTEXT)
            return
        k_cap = min(req.k, max_tokens - produced - 1, n_ctx - n_past - 1)
        # forced tokens are certain under the mask (but for a tokenization the model prefers):
        # drafted up to max_k, past the request's k
        forced = gram.forced(min(core.config.max_k, max_tokens - produced - 1, n_ctx - n_past - 1)) \
            if gram is not None and spec and greedy else []
        c0 = c1 = time.perf_counter()
        if forced:
            drf, hop_ms, proposals, source = forced, None, 0, SOURCE_GRAMMAR
        else:
            if run.marks and drafts.link is not None and not drafts.in_flight and not drafts.ctl.cache:
                yield FLUSH   # before() may wait for a proposal: nothing is held meanwhile
            drf, hop_ms, proposals = drafts.before(history, k_cap, max_tokens - produced,
                                                   min(req.tree_nodes, n_ctx - n_past - 1), runs)
            source = drafts.source
            if gram is not None and drf:
                drf = drf[:gram.valid_prefix(drf)]
            if prior is not None and not drf:
                drf, prior_p = _prior_draft(prior, prior_stats, history, k_cap, drafts, cost)
                source = SOURCE_PRIOR if drf else source
            c1 = time.perf_counter()
        # the masks of the round's positions are computed beside its forward (llguidance
        # releases the GIL), not after it
        masks_job = run.beside.submit(gram.masks_along, drf) if gram is not None else None
        n_run = 1
        if greedy and not drf and not run.rows and not req.logprobs:
            # the back-off's plain rounds as one in-engine run, paced like a plain stream's
            n_run = max(1, min(drafts.quiet_rounds(), max_tokens - produced, n_ctx - n_past,
                               _paced_steps(core.t_ms)))
        # a token tree: the chain drf and other continuations the draft service proposed beside it
        # (with a cost model, the tree the controller chose over chains, if it did; fixed_k: every
        # branch the budget takes)
        tree = None
        from_prior = source == SOURCE_PRIOR and bool(drf)
        shape = drafts.ctl.shape if drf and not forced and not from_prior else None
        if drafts.tree_nodes and drf and not forced and not from_prior:
            tree = (drafts.ctl.round_tree() if cost is not None else
                    drafts.tree_for(history, drf, max(len(drf), min(req.tree_nodes, n_ctx - n_past - 1)),
                                    k_cap))
        if tree is not None:
            vt, vp = verify_tree(history[-1], *tree)
            if run.marks:
                yield FLUSH
            c2 = time.perf_counter()
            st = run.step_tree(vt, vp)
        else:
            run_d = drafts.run_drafts if tree is None and not forced else None
            if run.marks:
                yield FLUSH
            c2 = time.perf_counter()
            st = run.step([history[-1]] + drf, "all", mode, decode=n_run if n_run > 1 else 0,
                          stop_ids=tuple(eos) if n_run > 1 else (),
                          verify_run=(run_d, len(drf), max_tokens - produced, tuple(eos), DECODE_RUN_MS)
                          if run_d else None)
        c3 = time.perf_counter()
        masks = masks_job.result() if masks_job is not None else None
        c4 = time.perf_counter()
        if st.run is not None:   # a verify run: its rounds, each its own event
            vr = st.run
            rounds, pos, i0 = [], 0, 0
            for j, (kj, rj) in enumerate(zip(vr.k, vr.r)):
                toks = vr.tokens[i0:i0 + rj + 1]
                rounds.append((run_d[pos:pos + kj], toks, kj, rj, vr.ms[j], vr.rollback_ms[j]))
                pos, i0 = pos + kj + 1, i0 + rj + 1
            c5 = time.perf_counter()
            for drf_j, toks, *_ in rounds[:-1]:
                drafts.ctl.on_result(drf_j, toks)
            before_last = history + vr.tokens[:i0 - len(rounds[-1][1])]
            collected = drafts.after(rounds[-1][0], rounds[-1][1], before_last)
            r1 = time.perf_counter()
            walls = _run_walls((r1 - r0) * 1e3, [v + b for v, b in zip(vr.ms, vr.rollback_ms)])
            for j, (drf_j, toks, kj, rj, ms, rb) in enumerate(rounds):
                first = j == 0
                if cost is not None and drafts.link is not None:
                    cost.observe(kj, ms, walls[j] - (st.queued_ms + (hop_ms or 0.0) if first else 0.0),
                                 core.t_ms, hop_ms if first else None)
                n_past += rj + 1
                produced, done = _output(history, toks, produced, eos, max_tokens)
                ev = RoundEvent(toks, kj, rj, ms, core.t_ms, walls[j], n_past, n_ctx,
                                (proposals if first else 0) + (collected if j == len(rounds) - 1 else 0),
                                source=source,   # each round is the first one's shape again
                                expected=(shape.e, shape.ms) if shape is not None and cost is not None else None,
                                cost=(((c1 - c0) + (r1 - c5)) * 1e3 if first else 0.0,
                                      max(0.0, (c3 - c2) * 1e3 - st.forward_ms) if first else 0.0,
                                      ((c5 - c4) * 1e3 if first else 0.0) + rb, rb))
                if first and drafts.reason and drafts.reason != reason:
                    ev.spec_reason = reason = drafts.reason
                if first and drafts.ctl.k_choice != k_choice:
                    ev.k_choice = k_choice = drafts.ctl.k_choice
                if done:
                    run.release()
                yield ev
                if done:
                    return
            r0 = r1
            continue
        if st.step_ms is not None:   # an in-engine run: its steps' tokens, each its own round
            toks = [int(t) for t in st.argmax]
            drafts.skipped(len(toks) - 1)
            r1 = time.perf_counter()
            walls = _run_walls((r1 - r0) * 1e3, st.step_ms)
            n_past = session.n_past - len(toks)
            for tok, ms, w in zip(toks, st.step_ms, walls):
                n_past += 1
                if not st.shared:   # a step of this session alone: a sample of T
                    core.observe_decode(ms)
                produced, done = _output(history, [tok], produced, eos, max_tokens)
                ev = RoundEvent([tok], 0, 0, ms, core.t_ms, w, n_past, n_ctx, 0)
                if done:
                    run.release()
                yield ev
                if done:
                    return
            r0 = r1
            continue
        k = len(drf)
        acc = drf
        if tree is not None:   # the greedy path the scheduler kept (tree_accept.accept)
            acc = [vt[i] for i in st.path[1:]]
            k, r = len(vt) - 1, len(acc)
            bonus = int(st.argmax[st.path[-1]])
        elif not run.rows:
            r = longest_accepted_prefix(drf, st.argmax)
            bonus = None
        else:   # the (penalised, masked) argmax at every drafted position, up to the first
            # disagreement: row i is penalised with the counts of history + drf[:i]
            def allowed(i: int) -> Any:
                return None if masks is None else masks[i]
            r = 0
            while r < k and run.pick(st.logits_out[r], allowed(r), history, drf[:r]) == drf[r]:
                r += 1
            bonus = run.choose(None, st.logits_out[r:r + 1], allowed(r), history, drf[:r])
        rb0 = rb1 = 0.0
        if r < k and tree is None:
            # k - r <= max_k positions back: within a sliding-window ring's reach (core.swa_slack)
            rb0 = time.perf_counter()
            session.rollback(n_past + 1 + r)
            rb1 = time.perf_counter()
            del run.kv_tokens[n_past + 1 + r:]
        if bonus is None:
            bonus = run.choose(st.argmax[r], st.logits_out)
        tokens = acc[:r] + [bonus]
        lps = run.logprobs(st.logits_out, tokens, masks)   # row i chose token i
        if gram is not None:   # the matcher follows the KV cache: rejected drafts out, bonus in
            gram.rollback(k - r)
            if bonus not in eos:
                gram.consume([bonus])
        if k == 0 and greedy:
            core.observe_decode(st.forward_ms)
        c5 = time.perf_counter()
        if forced:
            drafts.ctl.advance(tokens)
        else:
            path = [i - 1 for i in st.path[1:]] if tree is not None and cost is not None else None
            proposals += drafts.after(drf, tokens, history, tree is not None, path, prior=from_prior)
            if from_prior:
                prior_stats.record(r == 1)
        r1 = time.perf_counter()
        wall_ms = (r1 - r0) * 1e3
        if cost is not None and drafts.link is not None:
            # queue time is the other sessions' forwards, not this loop's overhead
            cost.observe(k, st.forward_ms, wall_ms - st.queued_ms - (hop_ms or 0.0), core.t_ms, hop_ms,
                         tree=tree is not None)
        produced, done = _output(history, tokens, produced, eos, max_tokens)
        ev = RoundEvent(tokens, k, r, st.forward_ms, core.t_ms, wall_ms, session.n_past, n_ctx,
                        proposals, source=source if k else 0, logprobs=lps,
                        tree_nodes=k if tree is not None else 0,
                        chain_accepted=longest_accepted_prefix(drf, tokens) if tree is not None else 0,
                        expected=((shape.e, shape.ms) if shape is not None and cost is not None else
                                  (prior_p, cost.v_est(1) + cost.overhead_ms) if from_prior and cost is not None
                                  else None),
                        cost=(((c1 - c0) + (r1 - c5)) * 1e3, max(0.0, (c3 - c2) * 1e3 - st.forward_ms),
                              (c5 - c4) * 1e3, (rb1 - rb0) * 1e3))
        if drafts.reason and drafts.reason != reason:
            ev.spec_reason = reason = drafts.reason
        if drafts.ctl.k_choice != k_choice:
            ev.k_choice = k_choice = drafts.ctl.k_choice
        if done:
            run.release()
        yield ev
        r0 = r1
