"""VerifierService servicer: proto <-> VerifierCore; VerifierError kinds -> status codes.

A bad request aborts only its own RPC (and frees only its own generation's
session); the service and other generations carry on.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from typing import Any, Callable, Iterator

import grpc

from echospec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from echospec.services.common.config import model_name
from echospec.services.verifier.engine import simd_name
from echospec.services.verifier.image_loop import check_images, run_image_generation
from echospec.services.verifier.generation_loop import (FLUSH, GenerationRequest, RoundEvent, check,
                                                        run_generation)
from echospec.services.common.penalties import Penalties
from echospec.services.text import grammar
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore, VerifierError

log = logging.getLogger("echospec.verifier")


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    """SamplingParams -> Sampling (top_p <= 0 or >= 1 reads as off; NaN stays NaN, which
    check_sampling refuses)."""
    top_p = p.top_p if 0.0 < p.top_p < 1.0 or math.isnan(p.top_p) else 1.0
    pen = Penalties(frequency=p.frequency_penalty, presence=p.presence_penalty,
                    repeat=p.repeat_penalty, last_n=p.repeat_last_n)
    return Sampling(temperature=p.temperature, top_k=p.top_k, top_p=top_p, min_p=p.min_p, seed=p.seed,
                    penalties=pen)


def logprob_to_proto(lp) -> common_pb2.TokenLogprob:
    """A logprobs.TokenLogprob as the wire's TokenLogprob (ids and logprobs; the coordinator adds
    the text)."""
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])


def tree_budget(asked: int, default: int) -> int:
    """A request's tree_nodes: 0 takes the verifier's --tree-nodes, -1 chains; anything else
    as asked (check() refuses one out of range)."""
    return default if asked == 0 else 0 if asked == -1 else asked


def events_to_proto(evs: list[RoundEvent]) -> verifier_pb2.GenerateTokensResponse:
    """Consecutive events of one generation as one message."""
    msg = verifier_pb2.GenerateTokensResponse()
    for ev in evs:
        rnd = msg.rounds.add(
            result=verifier_pb2.StepResult(
                tokens=ev.tokens, k=ev.k, accepted=ev.accepted, tries=1 if ev.k >= 1 else 0,
                hits=ev.accepted, kv_rolls=ev.k - ev.accepted, t_ms=ev.t_ms, v_ms=ev.v_ms,
                n_past=ev.n_past, n_ctx=ev.n_ctx, tree_nodes=ev.tree_nodes,
                chain_accepted=ev.chain_accepted,
                expected_accepted=ev.expected[0] if ev.expected else 0.0,
                expected_ms=ev.expected[1] if ev.expected else 0.0,
                logprobs=[logprob_to_proto(lp) for lp in ev.logprobs]),
            wall_ms=ev.wall_ms, proposals=ev.proposals, source=ev.source, k_choice=ev.k_choice)
        if ev.cost is not None:
            c = rnd.result.cost
            c.draft_ms, c.sched_ms, c.accept_ms, c.rollback_ms = ev.cost
        if ev.prefill:
            msg.cached_prompt_tokens = ev.cached_prompt_tokens
        if ev.spec_reason:
            msg.spec_reason = ev.spec_reason
        if ev.finish:
            msg.finish = ev.finish
            del msg.rounds[-1]          # the context-full event carries no step
    return msg


_END = object()


def _drive(events: Iterator[RoundEvent], out: "queue.SimpleQueue") -> None:
    """Run a generation on its own thread (run_generation with marks), handing ``out`` the
    events it holds at each FLUSH as a list (then _END or the error). The RPC's thread so wakes
    as the loop starts its forward, and sends them beside it, not between two forwards."""
    held: list[RoundEvent] = []
    try:
        for ev in events:
            if ev is FLUSH:
                if held:
                    out.put(held)
                    held = []
            else:
                held.append(ev)
        if held:
            out.put(held)
        out.put(_END)
    except BaseException as exc:  # noqa: BLE001 - handed to the RPC's thread, which reports it
        if held:
            out.put(held)
        out.put(exc)


def _abort(context: grpc.ServicerContext, exc: VerifierError):
    context.abort(getattr(grpc.StatusCode, exc.kind), exc.message)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    """Thin servicer over a VerifierCore (None until the model is loaded and warm)."""

    def __init__(self, core: VerifierCore | None = None,
                 open_draft: Callable[[float | None], Any] | None = None):
        self.core = core
        self.open_draft = open_draft   # (timeout s, **session setup) -> DraftLink; None: no draft service

    def _core(self, context: grpc.ServicerContext) -> VerifierCore:
        core = self.core
        if core is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        return core

    def GetConfig(self, request, context):
        core = self._core(context)
        cfg = core.config
        return verifier_pb2.GetConfigResponse(
            model=model_name(cfg.model), arch=core.model.info.arch, n_vocab=core.n_vocab, n_ctx=cfg.n_ctx,
            n_threads=cfg.n_threads, batch_max=cfg.batch_max, kv_eviction=core.kv_eviction,
            sparse_attention=cfg.sparse_attention > 0, max_k=cfg.max_k, t_ms=core.t_ms, simd=simd_name(),
            active_sessions=core.active_sessions,
            prefix_cache=cfg.prefix_cache and not cfg.sparse_attention,   # none reused under sparse attention
            cached_sessions=core.cached_sessions, prefill_chunk=cfg.prefill_chunk,
            max_sessions=cfg.max_sessions, free_kv_tokens=core.free_kv_tokens,
            batch_threads=cfg.batch_threads, decode_steps=cfg.decode_steps,
            n_expert=core.model.info.n_expert, n_expert_used=core.model.info.n_expert_used,
            grammar=True, kv_type=cfg.kv_type.lower(), images=core.vision is not None,
            tree_nodes=0 if core.tree_refusal else cfg.tree_nodes, tree_refusal=core.tree_refusal,
            verify_runs=cfg.verify_runs, draft_prior=core.prior_path if core.prior is not None else "",
            draft_prior_tokens=core.prior.n_tokens if core.prior is not None else 0)

    def GenerateTokens(self, request: verifier_pb2.GenerateTokensRequest,
                       context: grpc.ServicerContext) -> Iterator[verifier_pb2.GenerateTokensResponse]:
        """A whole generation (generation_loop.py); cancelling the call ends it and
        frees its engine step at once (a step already running finishes first)."""
        core = self._core(context)
        try:
            gram = grammar.spec_of(request.grammar)
        except grammar.GrammarError as exc:
            _abort(context, InvalidArgument(str(exc)))
        req = GenerationRequest(
            prompt=list(request.prompt), max_tokens=request.max_tokens,
            eos_ids=frozenset(request.eos_ids), sampling=sampling_from_proto(request.sampling),
            spec=request.spec, k=request.k, fixed_k=request.fixed_k, eager=len(request.prediction) > 0 or core.spare_cpu,
            prediction=tuple(request.prediction), digit_tokens=tuple(request.digit_tokens),
            line_break_tokens=tuple(request.line_break_tokens), draft_namespace=request.draft_namespace,
            resumed=request.resumed_tokens, grammar=gram, logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            tree_nodes=tree_budget(request.tree_nodes, core.config.tree_nodes))
        setup = dict(prediction=list(request.prediction), digit_tokens=list(request.digit_tokens),
                     draft_namespace=request.draft_namespace,
                     line_break_tokens=list(request.line_break_tokens), n_vocab=core.n_vocab)
        cancel = threading.Event()
        drafts: list[Any] = []

        def _on_end() -> None:
            cancel.set()
            core.scheduler.wake()
            for d in drafts:
                d.cancel()

        open_draft = None
        if self.open_draft is not None:
            timeout = context.time_remaining()
            timeout = None if timeout is None or timeout > 1e6 else timeout

            def open_draft():
                d = self.open_draft(timeout, **setup)
                drafts.append(d)
                return d
        context.add_callback(_on_end)
        try:
            check(core, req)
        except VerifierError as exc:
            _abort(context, exc)
        if request.images:
            try:
                check_images(core, req, request.images)
                for ev in run_image_generation(core, req, request.images, cancel, open_draft):
                    yield events_to_proto([ev])
            except VerifierError as exc:
                _abort(context, exc)
            return
        if not req.spec and req.grammar is None:
            # Plain decoding runs in the scheduler's thread (generation_loop._stream): this
            # thread only reads its rounds and sends what is ready at each FLUSH, several
            # rounds per message when it lags.
            held: list[RoundEvent] = []
            try:
                for ev in run_generation(core, req, cancel, open_draft, marks=True):
                    if ev is FLUSH:
                        if held:
                            yield events_to_proto(held)
                            held = []
                    else:
                        held.append(ev)
            except BaseException as exc:  # noqa: BLE001 - the rounds before it go out first
                if held and not isinstance(exc, GeneratorExit):
                    yield events_to_proto(held)
                if isinstance(exc, VerifierError):
                    _abort(context, exc)
                raise
            if held:
                yield events_to_proto(held)
            return
        # The speculative (or constrained) loop runs on its own thread, so it never waits for a message
        # to be sent; this thread sends what it finished, several rounds per message
        # when the reader is slower than the engine.
        out: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_drive, args=(run_generation(core, req, cancel, open_draft, marks=True), out),
                         name="generation", daemon=True).start()
        done = False
        while not done:
            items = [out.get()]
            while True:
                try:
                    items.append(out.get_nowait())
                except queue.Empty:
                    break
            batch = [ev for it in items if isinstance(it, list) for ev in it]
            last = items[-1]
            if last is _END:
                done = True
            elif isinstance(last, BaseException):
                if batch:
                    yield events_to_proto(batch)
                if isinstance(last, VerifierError):
                    _abort(context, last)
                raise last
            if batch:
                yield events_to_proto(batch)
