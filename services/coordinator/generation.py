"""One generation at the coordinator: the verifier's token stream -> text, stop strings, stats.

No gRPC here: ``link`` yields the verifier's GenerateTokens messages (the
engine steps finished since the previous message: the prefill's first token,
then R accepted drafts + the bonus token per round) and can be cancelled. The loop itself (drafts, verify,
accept, K by cost) runs in the verifier, beside the engine
(services/verifier/generation_loop.py): no round trip per token.

Tokens are taken one by one, exactly as plain decoding would take them: an
EOS token ends the output (not emitted), the stop matcher may end it (the stop
string is not emitted), max_tokens ends it; whatever follows in the same
round is dropped. So the output does not depend on the drafts. The verifier
stops by itself after an EOS token or max_tokens; a stop string ends the
generation here, and the call is cancelled so the verifier stops at once.

Logprobs (params.logprobs): the verifier sends one TokenLogprob per token (ids and values); each
output token's goes out with it, in its Delta and the Outcome, with the text of the token and of
its alternatives filled in here (``token_piece``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from echospec.v1.common_pb2 import FinishReason
from echospec.services.common.economics import SpecCounters

FINISH_EOS = FinishReason.Value("FINISH_REASON_EOS")
FINISH_STOP = FinishReason.Value("FINISH_REASON_STOP")
FINISH_LENGTH = FinishReason.Value("FINISH_REASON_LENGTH")
FINISH_CONTEXT = FinishReason.Value("FINISH_REASON_CONTEXT")


class GenerationError(Exception):
    """The verifier's stream broke the protocol (an internal error)."""


@dataclass
class GenerationParams:
    """What one generation needs besides the prompt."""

    max_tokens: int
    stop: list[str]
    sampling: Any                 # echospec.v1.SamplingParams
    spec: bool                    # gating passed
    spec_reason: str
    k: int
    prediction: list[int] = field(default_factory=list)   # the request's prediction, tokenized
    draft_namespace: str = ""
    grammar: Any = None           # echospec.v1.Grammar (checked), or None: free text
    logprobs: bool = False        # report each output token's logprob
    top_logprobs: int = 0         # ... and this many alternatives (0..20)
    tree_nodes: int = 0           # token-tree rounds' draft nodes (0: the verifier's default, -1: chains)


@dataclass
class Delta:
    """A streamed piece: text never splits a UTF-8 character."""

    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)   # echospec.v1.TokenLogprob per token (logprobs)


@dataclass
class Move:
    """The generation moved to another verifier after ``at_token`` output tokens. A resuming
    link yields it just before the new verifier's first message (its prefill round);
    ``generate`` fills in that prefill's ms and cached tokens."""

    from_verifier: str
    to_verifier: str
    at_token: int
    reason: str
    resume_ms: float = 0.0
    prefill_ms: float = 0.0
    cached_prompt_tokens: int = 0


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
    verifier: str = ""                 # host:port of the verifier that finished it
    moves: list[Move] = field(default_factory=list)   # each move to another verifier, in order
    tool_calls: list = field(default_factory=list)     # services.text.tool_calls.ToolCall, parsed
    logprobs: list = field(default_factory=list)      # echospec.v1.TokenLogprob per output token


def token_piece(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    """A token's text and raw bytes as a TokenLogprob gives them: the bytes decoded when they are
    whole UTF-8, else ``bytes:`` and their escapes (``bytes:\\xe2\\x80``: a piece of a
    character, as OpenAI writes it)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class _Output:
    """Token-by-token output state: decoder, stop matcher, EOS and max_tokens."""

    def __init__(self, tokenizer: Any, stop: list[str], max_tokens: int):
        from echospec.services.text.tokenizer import StopMatcher
        self.dec = tokenizer.incremental_decoder()
        self.stop = StopMatcher(stop)
        self.eos = set(tokenizer.eos_ids)
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish = 0
        self.tokenizer = tokenizer
        self.logprobs: list = []          # TokenLogprob per output token (when asked for)
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def _named(self, lp: Any) -> Any:
        """``lp`` (a TokenLogprob from the verifier) with its tokens' text and bytes filled in."""
        for x in (lp, *lp.top_logprobs):
            piece = self._pieces.get(x.token_id)
            if piece is None:
                piece = self._pieces[x.token_id] = token_piece(self.tokenizer, x.token_id)
            x.token, x.bytes = piece
        return lp

    def take(self, tokens: list[int], logprobs: list | None = None) -> Delta:
        """Consume tokens in order until one ends the output; return the delta. ``logprobs``:
        the tokens' TokenLogprobs (one each), or None."""
        emitted: list[str] = []
        new: list[int] = []
        new_lps: list = []
        for i, t in enumerate(tokens):
            if t in self.eos:
                self.finish = FINISH_EOS
                break
            self.token_ids.append(t)
            new.append(t)
            if logprobs is not None:
                new_lps.append(self._named(logprobs[i]))
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
        d = Delta("".join(emitted), new, new_lps)
        self.text_parts.append(d.text)
        self.logprobs.extend(new_lps)
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


def generate(prompt: list[int], params: GenerationParams, tokenizer: Any, link: Any,
             counters: SpecCounters | None = None) -> Iterator[Delta | Outcome]:
    """Consume one generation's token stream; yield a Delta per message, then the Outcome.

    Args:
        prompt: prompt token ids (validated by the caller).
        params: limits, stop strings, sampling, gating verdict, k.
        tokenizer: Tokenizer (incremental_decoder, eos_ids).
        link: GenerationLink (events(), cancel()). Its failures propagate
            (VerifierFailure) and end the generation. A link that resumes the generation on
            another verifier yields a Move before that verifier's first message: its first
            round is the prefill of prompt + output so far (not a round of the stats), and its
            tokens continue the output.
        counters: where the stats go as messages arrive (default: a new SpecCounters); the
            caller's object holds the figures so far when the generation ends without an
            Outcome (cancelled, past its deadline, the verifier lost).
    Yields:
        Delta (non-empty ones only), then one Outcome.
    """
    counters = SpecCounters() if counters is None else counters
    out = _Output(tokenizer, params.stop, params.max_tokens)
    spec, reason = params.spec, params.spec_reason
    first = True
    moves: list[Move] = []
    resumed: Move | None = None      # the next round is this move's prefill
    events = link.events()
    for msg in events:
        if isinstance(msg, Move):
            moves.append(msg)
            resumed = msg
            continue
        if resumed is not None:
            resumed.cached_prompt_tokens = msg.cached_prompt_tokens
        if msg.spec_reason:
            reason = msg.spec_reason
        if first:
            counters.cached_prompt_tokens = msg.cached_prompt_tokens
        tokens: list[int] = []
        lps: list | None = [] if params.logprobs else None
        for rnd in msg.rounds:
            res = rnd.result
            counters.proposals += rnd.proposals
            if first:
                first = False
                counters.prefill_ms = res.v_ms
                counters.t_ms = res.t_ms
            elif resumed is not None:
                resumed.prefill_ms = res.v_ms
                resumed = None
                counters.t_ms = res.t_ms
            else:
                counters.add_round(res.k, res.accepted, res.v_ms, rnd.wall_ms, res.t_ms, rnd.source)
                if res.HasField("cost"):
                    counters.add_cost(res.cost)
                counters.add_shape(res.tree_nodes, res.expected_accepted if res.k else 0.0)
            if rnd.k_choice:
                counters.k_choice = rnd.k_choice
            tokens.extend(res.tokens)
            if lps is not None:
                if len(res.logprobs) != len(res.tokens):
                    raise GenerationError(
                        f"the verifier sent {len(res.logprobs)} logprobs for a round of {len(res.tokens)} "
                        f"token(s) (a version without logprobs?)")
                lps.extend(res.logprobs)
        d = out.take(tokens, lps) if tokens else Delta("", [])
        if msg.finish and not out.finish:
            e = out.end(msg.finish)
            d = Delta(d.text + e.text, d.token_ids, d.logprobs)
        if d.text or d.token_ids:
            yield d
        if out.finish:
            break
    if out.finish in (FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT):
        # the verifier stops at the same EOS ids, max_tokens and context: one more read lets its
        # call end by itself, with status OK (an in-process call ends only when read to its end)
        try:
            next(events, None)
        except Exception:  # noqa: BLE001 - the output is complete; a failure after it changes nothing
            pass
    link.cancel()   # a no-op after the verifier ended the stream; stops it after a stop string
    if not out.finish:
        raise GenerationError("the verifier ended the generation without EOS, max_tokens or a full context")
    yield Outcome(out.text, out.token_ids, len(prompt), out.finish, spec, reason, counters,
                  moves=moves, logprobs=out.logprobs)


def with_tool_calls(events: Iterator[Delta | Outcome], content: Any) -> Iterator[Delta | Outcome]:
    """A generation's events with its tool calls taken out of the text (the request has tools):
    each Delta's text is what ``content`` (a services.text.tool_calls.ContentFilter) passes on
    (its token ids unchanged, so a Delta may carry ids and no text), and the Outcome's text is
    the content, its ``tool_calls`` the calls parsed from the whole output."""
    for ev in events:
        if isinstance(ev, Outcome):
            rest, ev.text, ev.tool_calls = content.finish()
            if rest:
                yield Delta(rest, [])
            yield ev
        else:
            yield Delta(content.feed(ev.text), ev.token_ids, ev.logprobs)
