"""The draft -> verify -> accept loop of one generation, with streaming output.

No gRPC here: the loop talks to a verifier link (prefill, step) and an
optional draft link (append, propose) that clients.py implements over
long-lived bidi streams.

Per round (after prefill, which yields the first token):
    k_cap = min(k, remaining max_tokens - 1, n_ctx - n_past - 1)
    draft = controller's choice: cached tail | one ProposeStream round trip | none
    step  = verifier.step(draft)  -> R accepted drafts + the bonus token
Tokens are then taken one by one, exactly as plain decoding would take them:
an EOS token ends the output (not emitted), the stop matcher may end it
(the stop string is not emitted), max_tokens ends it; whatever follows in the
same round is dropped. So the output does not depend on the drafts.
Hops on a round's critical path: one (verifier) for cached or no drafts, two
when the draft service is asked. A round's delta is handed to the caller
(streamed to the client) after the next round's step has been sent, while
the verifier computes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from echospec.v1.common_pb2 import FinishReason
from echospec.services.common.metrics import SpecCounters
from echospec.services.coordinator.clients import DraftUnavailable
from echospec.services.coordinator.controller import CostModel, SpecController

FINISH_EOS = FinishReason.Value("FINISH_REASON_EOS")
FINISH_STOP = FinishReason.Value("FINISH_REASON_STOP")
FINISH_LENGTH = FinishReason.Value("FINISH_REASON_LENGTH")
FINISH_CONTEXT = FinishReason.Value("FINISH_REASON_CONTEXT")


@dataclass
class GenerationParams:
    """What one generation needs besides the prompt."""

    max_tokens: int
    stop: list[str]
    sampling: Any                 # echospec.v1.SamplingParams
    spec: bool                    # gating passed
    spec_reason: str
    k: int


@dataclass
class Delta:
    """A streamed piece: text never splits a UTF-8 character."""

    text: str
    token_ids: list[int]


@dataclass
class Outcome:
    """The final result of a generation."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: int
    spec_enabled: bool
    spec_reason: str
    counters: SpecCounters = field(default_factory=SpecCounters)


class _Output:
    """Token-by-token output state: decoder, stop matcher, EOS and max_tokens."""

    def __init__(self, tokenizer: Any, stop: list[str], max_tokens: int):
        from echospec.services.common.tokenizer import StopMatcher
        self.dec = tokenizer.incremental_decoder()
        self.stop = StopMatcher(stop)
        self.eos = set(tokenizer.eos_ids)
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish = 0

    def take(self, tokens: list[int]) -> Delta:
        """Consume tokens in order until one ends the output; return the delta."""
        emitted: list[str] = []
        new: list[int] = []
        for t in tokens:
            if t in self.eos:
                self.finish = FINISH_EOS
                break
            self.token_ids.append(t)
            new.append(t)
            text, stopped = self.stop.push(self.dec.feed(t))
            emitted.append(text)
            if stopped:
                self.finish = FINISH_STOP
                break
            if len(self.token_ids) >= self.max_tokens:
                self.finish = FINISH_LENGTH
                break
        if self.finish and self.finish != FINISH_STOP:
            emitted.append(self._flush())
        d = Delta("".join(emitted), new)
        self.text_parts.append(d.text)
        return d

    def end(self, finish: int) -> Delta:
        """End the output for a reason found outside the tokens (context full)."""
        self.finish = finish
        d = Delta(self._flush(), [])
        self.text_parts.append(d.text)
        return d

    def _flush(self) -> str:
        tail = self.dec.flush()
        text, stopped = self.stop.push(tail) if tail else ("", False)
        if stopped:
            self.finish = FINISH_STOP
            return text
        return text + self.stop.flush()

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def generate(prompt: list[int], params: GenerationParams, tokenizer: Any, verifier: Any,
             draft: Any | None, draft_reason: str = "", cost: CostModel | None = None
             ) -> Iterator[Delta | Outcome]:
    """Run one generation; yield Deltas as tokens are accepted, then the Outcome.

    Args:
        prompt: prompt token ids (validated by the caller).
        params: limits, stop strings, sampling, gating verdict, k.
        tokenizer: Tokenizer (incremental_decoder, eos_ids).
        verifier: VerifierLink (prefill, send_step, recv_step). Its failures propagate
            (VerifierFailure) and end the generation.
        draft: DraftLink or None (spec off, or the draft service unreachable).
        draft_reason: why ``draft`` is None although spec is on.
        cost: the coordinator's live cost model (T, V(K), overhead); it picks
            each round's draft length. None: always draft up to k.
    Yields:
        Delta (non-empty ones only), then one Outcome.
    """
    counters = SpecCounters()
    out = _Output(tokenizer, params.stop, params.max_tokens)
    spec, reason = params.spec, params.spec_reason
    if spec and draft is None:
        reason = draft_reason or "draft service unavailable; decoded plainly"
    ctl = SpecController(k=params.k, cost=cost)
    history = list(prompt)
    synced = 0
    if spec and draft is not None:
        draft.append(history)  # index the prompt while the verifier prefills
        synced = len(history)

    first = verifier.prefill(prompt, params.sampling)
    counters.prefill_ms = first.v_ms
    counters.t_ms = first.t_ms
    n_past, n_ctx = first.n_past, first.n_ctx
    d = out.take(list(first.tokens))
    history.extend(first.tokens)
    # d is the latest delta, not yet yielded: it is yielded after the next
    # step has been sent, so streaming it overlaps the verifier's forward
    # instead of adding to the round (the tokens and their order are unchanged).
    while not out.finish:
        if n_past + 1 > n_ctx:
            if d.text or d.token_ids:
                yield d
            d = out.end(FINISH_CONTEXT)
            break
        t0 = time.perf_counter()
        k_cap = min(params.k, params.max_tokens - len(out.token_ids) - 1, n_ctx - n_past - 1)
        drf: list[int] = []
        hop_ms = None
        if spec and draft is not None:
            kind, arg = ctl.plan(k_cap)
            if kind == "cached":
                drf = arg
            elif kind == "propose":
                n_fetch = max(1, min(arg, params.max_tokens - len(out.token_ids) - 1))
                try:
                    h0 = time.perf_counter()
                    proposal = draft.propose(history[synced:], n_fetch)
                    hop_ms = (time.perf_counter() - h0) * 1e3
                    synced = len(history)
                    counters.proposals += 1
                    drf = ctl.on_proposal(proposal, k_cap)
                except DraftUnavailable as exc:
                    reason = f"{exc}; decoded plainly from here on"
                    draft.cancel()
                    draft = None
                    ctl.drop()
        verifier.send_step(drf)
        if d.text or d.token_ids:
            yield d
        res = verifier.recv_step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        tokens = list(res.tokens)
        counters.add_round(len(drf), res.accepted, res.v_ms, wall_ms, res.t_ms)
        if spec:
            ctl.on_result(drf, tokens)
            if cost is not None:
                cost.observe(len(drf), res.v_ms, wall_ms - (hop_ms or 0.0), res.t_ms, hop_ms)
        n_past = res.n_past
        history.extend(tokens)
        d = out.take(tokens)
    if d.text or d.token_ids:
        yield d
    if draft is not None:
        draft.close()
    yield Outcome(out.text, out.token_ids, len(prompt), out.finish, spec, reason, counters)
