"""CoordinatorService servicer: requests -> prompt + params, gating, one
GenerateTokens call to the verifier per generation (the loop runs there and
consults the draft service itself), text and results (generation.py).

Each generation goes to one verifier of the pool (pool.py, balancer.py: the
least-loaded healthy one, or its draft_namespace's own while healthy). A
verifier that fails before the generation's first token (unreachable, no free
session, an internal error) is marked failed when unreachable and the
generation is retried on another (each verifier once, at most max(1, max_moves)
retries). A verifier that fails or misses its
progress deadline (progress.py) after the first token is reported to the pool
and the generation resumes on another (``_ResumingLink``: prompt + output so
far prefilled there, the stream continuing without a seam), at most
``max_moves`` times (a verifier it failed on is taken again once a health poll
found it SERVING since: a restarted one); past that, or with no verifier left,
UNAVAILABLE naming the moves. The result names the verifier that finished it and each move.

Status codes: malformed requests INVALID_ARGUMENT (one prompt form, token ids
in the vocabulary, non-empty prompt, max_tokens / k / stop limits, chat
message shape); the verifier's own status is passed through (e.g.
INVALID_ARGUMENT for a prompt longer than the context, RESOURCE_EXHAUSTED when
no verifier has a free session); UNAVAILABLE when no verifier can be reached, or
when a generation whose verifier failed mid-way cannot move on. An unreachable draft service is not an error: the
generation decodes plainly and says so in spec_reason.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
import weakref
from typing import Any, Callable, Iterator

import grpc
import numpy as np

from echospec_client.limits import (MAX_REPEAT_PENALTY, MAX_REQUEST_ID, MAX_TOP_LOGPROBS,
                                    MAX_TREE_DRAFT_NODES, MIN_REPEAT_PENALTY)
from echospec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, verifier_pb2
from echospec.services.rpc import grpc_util
from echospec.services.text.chat_template import (ChatTemplate, ChatTemplateError,
                                                   MissingChatTemplateError, TemplateRenderError)
from echospec.services.common.config import CoordinatorConfig, model_name
from echospec.services.common.floats import f32_str
from echospec.services.common.penalties import Penalties, PenaltyError
from echospec.services.common.economics import SOURCE_NAMES, SpecCounters
from echospec.services.text import grammar, tool_calls
from echospec.services.common.metrics import PromMetrics, RequestRecord
from echospec.services.text.clip import clip
from echospec.services.text.tokenizer import Tokenizer
from echospec.services.coordinator.clients import GenerationLink, VerifierFailure
from echospec.services.coordinator.gating import VerifierCaps, decide_spec
from echospec.services.coordinator.generation import (Delta, GenerationError, GenerationParams, Move,
                                                      Outcome, generate, with_tool_calls)
from echospec.services.coordinator.pool import NoVerifier, VerifierPool
from echospec.services.coordinator.image_parts import (IMAGE_PAD, ImagePartError, ImageParts,
                                                       image_spans, image_tokens)
from echospec.services.coordinator.progress import ProgressClock, StallWatch, move_cap_text
from echospec.services.common.auth import metadata_authorization
from echospec.services.draft.memory import MAX_NAMESPACE_CHARS, namespace_problem

log = logging.getLogger("echospec.coordinator")


class RequestError(Exception):
    """A request the coordinator refuses; ``code`` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = clip(message)   # it may quote a client's value of any size
        super().__init__(message)
        self.code = code
        self.message = message


def _request_id(context: grpc.ServicerContext) -> str:
    """The client's ``x-request-id`` metadata (up to MAX_REQUEST_ID printable characters), else a
    new id."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID and \
                value.isprintable():
            return value
    return uuid.uuid4().hex[:16]


def _finish_name(reason: int) -> str:
    """echospec.v1.FinishReason value -> "eos", "stop", "length", ... (the proto's own names)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def digit_tokens(tokenizer: Any) -> list[int]:
    """Token ids of "0".."9" when the tokenizer writes every digit as its own token (numbered-list
    drafts need it: "10" is then the ids of "1" and "0"); [] otherwise (those drafts stay off)."""
    ids = [tokenizer.token_to_id(str(d)) for d in range(10)]
    if any(i is None for i in ids):
        return []
    probe = "1234567890"
    if tokenizer.encode(probe) != [ids[int(c)] for c in probe]:
        return []
    return ids


def line_break_tokens(tokenizer: Any) -> list[int]:
    """Ids of the tokens whose text ends with a line feed (a numbered-list number starts a line)."""
    out = []
    for i in range(tokenizer.n_vocab):
        try:
            if tokenizer.token_bytes(i).endswith(b"\n"):
                out.append(i)
        except (ValueError, KeyError):
            continue
    return out


class PromptIds(list):
    """A prompt's token ids with its images: (images.Image, offset of its first image pad)."""

    images: tuple | list = ()


def _bad(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def request_penalties(req: Any) -> Penalties:
    """A request's repetition penalties (all off when none is set).

    Raises:
        RequestError: INVALID_ARGUMENT naming the field: frequency_penalty or presence_penalty
            outside [-2, 2], repeat_penalty set and outside
            [MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY], repeat_last_n outside
            [-1, MAX_LAST_N].
    """
    repeat = req.repeat_penalty if req.HasField("repeat_penalty") else 1.0
    if not (math.isfinite(repeat) and repeat > 0):   # 0 would read as off below: refused here
        raise _bad(f"repeat_penalty must be in [{MIN_REPEAT_PENALTY:g}, {MAX_REPEAT_PENALTY:g}] "
                   f"(1: off), got {f32_str(repeat)}")
    pen = Penalties(frequency=req.frequency_penalty, presence=req.presence_penalty, repeat=repeat,
                    last_n=req.repeat_last_n)
    try:
        pen.check()
    except PenaltyError as exc:
        raise _bad(str(exc)) from None
    return pen if pen.active else Penalties()


def stats_to_proto(c) -> common_pb2.SpecStats:
    gain, verdict = c.gain()
    sources = [common_pb2.DraftSourceStats(source=SOURCE_NAMES.get(src, "unknown"), draft_tokens=d,
                                           hits=h, tries=t)
               for src, (d, h, t) in sorted(c.sources.items())]
    return common_pb2.SpecStats(
        tries=c.tries, hits=c.hits, kv_rolls=c.kv_rolls, draft_tokens=c.draft_tokens,
        rounds=c.rounds, proposals=c.proposals, acceptance_rate=c.acceptance_rate,
        mean_acceptance_length=c.mean_acceptance_length,
        mean_accepted_per_round=c.mean_accepted_per_round, t_ms=c.t_ms, v_ms=c.v_ms,
        overhead_ms=c.overhead_ms, overhead_share=c.overhead_share, prefill_ms=c.prefill_ms,
        gain=gain, gain_verdict=verdict, cached_prompt_tokens=c.cached_prompt_tokens,
        accepted_prediction_tokens=c.accepted_prediction_tokens,
        rejected_prediction_tokens=c.rejected_prediction_tokens, sources=sources, k_choice=c.k_choice,
        round_cost=common_pb2.RoundCost(**c.round_cost()), tree_rounds=c.tree_rounds,
        expected_accepted=c.expected_accepted)

# A verifier's failure before a generation's first token with one of these codes moves the
# generation to another verifier (once); the others (a bad prompt, a deadline) would fail there too.
RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})
# ... and these mean the verifier itself is gone: it leaves the candidates until its health returns.
DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def result_to_proto(o: Outcome) -> coordinator_pb2.GenerationResult:
    moves = [coordinator_pb2.VerifierMove(
        from_verifier=m.from_verifier, to_verifier=m.to_verifier, at_token=m.at_token,
        reason=m.reason, resume_ms=m.resume_ms, prefill_ms=m.prefill_ms,
        cached_prompt_tokens=m.cached_prompt_tokens) for m in o.moves]
    return coordinator_pb2.GenerationResult(
        text=o.text, token_ids=o.token_ids, prompt_tokens=o.prompt_tokens,
        completion_tokens=len(o.token_ids), finish_reason=o.finish_reason,
        spec_enabled=o.spec_enabled, spec_reason=o.spec_reason, stats=stats_to_proto(o.counters),
        verifier=o.verifier, moves=moves, logprobs=o.logprobs,
        tool_calls=[coordinator_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                    for c in o.tool_calls])


def _message_dict(m: coordinator_pb2.ChatMessage, content: str) -> dict:
    """A ChatMessage as the chat template receives it (transformers' shape for tool calls), with
    ``content`` its text (its text parts joined when it has parts)."""
    d: dict = {"role": m.role, "content": content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name,
                                         "arguments": tool_calls.template_arguments(c.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


class _Attempt:
    """One GenerateTokens call on one verifier whose first message has arrived (``first`` None:
    the verifier ended the stream at once, which generate() reports)."""

    def __init__(self, lease: Any, link: GenerationLink, events: Iterator[Any], first: Any,
                 clock: ProgressClock):
        self.lease, self.link, self.events, self.first, self.clock = lease, link, events, first, clock
        self.params: Any = None          # the GenerationParams resolved for this verifier
        self.exclude: list[str] = []     # verifiers this generation cannot move to
        self.namespace = ""              # the draft namespace as the draft service names it
        self.movable: Any = None         # () -> bool: could the generation move now (None: the pool's view)


def _weak_call(method: Callable[[], bool]) -> Callable[[], bool]:
    """``method()`` through a weak reference (False once its object is gone): an attempt that
    holds its generation's check would otherwise form a cycle with it, and a cycle keeps the
    verifier call of a cancelled generation open until the cyclic collector runs."""
    ref = weakref.WeakMethod(method)

    def call() -> bool:
        m = ref()
        return m is not None and m()
    return call


class _CallFailed(Exception):
    """A GenerateTokens call failed before its first message (the call is cancelled).

    ``ours``: the caller's cancel (the client left, its deadline passed); ``stalled``: why the
    verifier missed its progress deadline ("" when it did not)."""

    def __init__(self, failure: VerifierFailure, ours: bool, stalled: str):
        super().__init__(str(failure))
        self.failure, self.ours, self.stalled = failure, ours, stalled


class _ResumingLink:
    """The generation's stream across verifiers: the first verifier's messages, and when that
    verifier fails or stalls after the first token, the messages of another one that prefilled
    the prompt plus the output so far and decodes on (a generation.Move marks each move).

    Every message re-arms the progress deadline (progress.py); a verifier that misses it is
    cancelled and reported to the pool (unhealthy until a health poll passes). At most
    ``config.max_moves`` moves are tried per generation; past that, or with no verifier left,
    the generation fails with UNAVAILABLE naming the moves.
    """

    def __init__(self, svc: "CoordinatorServicer", req: Any, prompt: list[int], params: Any,
                 context: grpc.ServicerContext, attempt: _Attempt):
        self._svc, self._req, self._prompt, self._params = svc, req, prompt, params
        self._context = context
        self.attempt = attempt
        self.tokens: list[int] = []          # the verifiers' tokens handed on so far
        self._eos = set(svc.tokenizer.eos_ids)
        self._tried = 0                      # moves tried (those that failed too)
        # the verifiers this generation failed on, not tried again until a health poll found
        # them SERVING since (a restarted verifier takes generations again): address -> the
        # pool's count of its recoveries at the failure
        self._failed: list[str] = []
        self._failed_at: dict[str, int] = {}
        self._note_failed(attempt.lease.address)
        attempt.exclude = self._failed
        attempt.movable = self._movable = _weak_call(self.can_move)
        self.history: list[str] = []         # "a -> b at token n" of each move made

    def can_move(self) -> bool:
        """Whether a stall could move the generation now (the stall watch asks, on its thread):
        moves left under the cap, and a healthy verifier other than the current one that it
        has not failed on, or that recovered since (as _readmit will find)."""
        if self._tried >= self._svc.config.max_moves:
            return False
        pool = self._svc.pool
        blocked = [a for a in list(self._failed) if pool.recoveries(a) <= self._failed_at.get(a, -1)]
        return pool.has_other(self.attempt.lease.address, blocked)

    def _note_failed(self, address: str) -> None:
        self._failed_at[address] = self._svc.pool.recoveries(address)
        if address not in self._failed:
            self._failed.append(address)

    def _readmit(self) -> None:
        """Drop from the failed list (in place: attempts share it) every verifier that recovered."""
        back = [a for a in self._failed if self._svc.pool.recoveries(a) > self._failed_at[a]]
        for a in back:
            self._failed.remove(a)
            del self._failed_at[a]

    def _took(self, msg: Any) -> None:
        wall, t_ms = 0.0, 0.0
        prefill = msg is self.attempt.first   # its first round is the prefill: not a round's cost
        for i, rnd in enumerate(msg.rounds):
            self.tokens.extend(rnd.result.tokens)
            if not (prefill and i == 0):
                wall += rnd.wall_ms
            t_ms = rnd.result.t_ms or t_ms
        self.attempt.clock.observe(wall, t_ms)

    def _complete(self) -> bool:
        """The output is whole (EOS or max_tokens): a failure from here on changes nothing."""
        return any(t in self._eos for t in self.tokens) or len(self.tokens) >= self._params.max_tokens

    def events(self) -> Iterator[Any]:
        while True:
            a = self.attempt
            if a.first is None:
                return
            msg = a.first
            try:
                while True:
                    self._took(msg)
                    yield msg
                    # the deadline covers the wait for the verifier only, not the time the
                    # caller took (a slow client holds the coordinator, not the verifier)
                    self._svc.arm(a, self._svc.pool.others(a.lease.address))
                    msg = next(a.events)
                    self._svc.watch.disarm(a.link)
            except StopIteration:
                self._svc.watch.disarm(a.link)
                return
            except VerifierFailure as exc:
                self._svc.watch.disarm(a.link)
                stalled = a.link.stalled
                if not stalled and (exc.code == grpc.StatusCode.DEADLINE_EXCEEDED or a.link.cancelled
                                    or not self._context.is_active()):
                    raise
                if not stalled and exc.code == grpc.StatusCode.INTERNAL:
                    # a failure of the generation itself (the engine's ES_ERR_BAD_WEIGHTS: a NaN
                    # logits row), which another verifier would repeat: not moved
                    raise VerifierFailure(
                        grpc.StatusCode.INTERNAL,
                        f"verifier {a.lease.address} failed after {len(self.tokens)} output "
                        f"token(s) ({exc.code.name}: {exc.details}); the generation is not "
                        f"moved: another verifier would compute the same") from None
                if not stalled and exc.code not in RETRY_CODES:
                    # the verifier refused the generation as it went on (a grammar its matcher
                    # could not follow: INVALID_ARGUMENT): another would refuse it too
                    raise VerifierFailure(
                        exc.code, f"{exc.details} (verifier {a.lease.address}, after "
                        f"{len(self.tokens)} output token(s); the generation is not moved: "
                        f"another verifier would refuse it too)") from None
                why = stalled or f"{exc.code.name}: {exc.details}"
                if stalled or exc.code in DOWN_CODES:
                    self._svc.pool.report_failure(a.lease.address, why)
                self._note_failed(a.lease.address)   # not tried again until it recovers
                if self._complete():
                    raise
                move = self._move(why)
                if move is None:   # the call ended meanwhile (client gone, deadline)
                    raise
                yield move

    def _move(self, why: str) -> Move | None:
        """Continue the generation on another verifier: a Move once its first message arrived,
        None when the RPC ended meanwhile.

        Raises:
            VerifierFailure: UNAVAILABLE past max_moves or with no verifier left, naming the moves.
        """
        svc, old = self._svc, self.attempt
        t0 = time.perf_counter()
        n = len(self.tokens)
        what = "stalled" if old.link.stalled else "failed"
        head = f"verifier {old.lease.address} {what} after {n} output token(s) ({why})"
        fails: list[str] = []
        old.link.cancel()
        old.lease.release()
        cap = svc.config.max_moves
        while True:
            done = "; ".join([f"moves: {', '.join(self.history)}" if self.history else "no move made"]
                             + fails)
            if self._tried >= cap:
                raise VerifierFailure(grpc.StatusCode.UNAVAILABLE,
                                      f"{head}; the generation cannot move on: "
                                      f"{move_cap_text(self._tried, cap)} ({done})")
            self._readmit()
            try:
                lease = svc.pool.acquire(old.namespace, exclude=self._failed,
                                        prompt=self._prompt + self.tokens)
            except NoVerifier as exc:
                raise VerifierFailure(grpc.StatusCode.UNAVAILABLE,
                                      f"{head}; no verifier left to move the generation to ({exc}); "
                                      f"{move_cap_text(self._tried, cap)} ({done})") from None
            self._tried += 1
            svc.metrics.v_moves.labels(verifier=old.lease.address).inc()
            try:
                attempt = svc.call(self._req, self._prompt, self.tokens, lease, self._context,
                                   old.namespace, exclude=self._failed, movable=self._movable)
            except RequestError as exc:
                lease.release()
                raise VerifierFailure(exc.code, f"{head}; moving the generation to "
                                      f"{lease.address} was refused: {exc.message}") from None
            except _CallFailed as failed:
                exc = failed.failure
                lease.release()
                if failed.ours or not self._context.is_active():
                    return None
                w = failed.stalled or f"{exc.code.name}: {exc.details}"
                if not failed.stalled and exc.code not in RETRY_CODES:
                    # a refusal every verifier would repeat (a prompt plus output that fills
                    # the context): the generation ends with it
                    raise VerifierFailure(exc.code, f"{head}; {lease.address} refused to continue "
                                          f"it ({w})") from None
                if failed.stalled or exc.code in DOWN_CODES:
                    svc.pool.report_failure(lease.address, w)
                self._note_failed(lease.address)
                fails.append(f"{lease.address} failed before its first token ({w})")
                log.warning("%s; moving to %s failed (%s)", head, lease.address, w)
                continue
            self.attempt = attempt
            ms = (time.perf_counter() - t0) * 1e3
            self.history.append(f"{old.lease.address} -> {lease.address} at token {n}")
            log.warning("%s; moved to %s (resumed in %.0f ms)", head, lease.address, ms)
            return Move(old.lease.address, lease.address, n, why, resume_ms=ms)

    def cancel(self) -> None:
        self._svc.watch.disarm(self.attempt.link)
        self.attempt.link.cancel()


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The public API.

    Args:
        config: defaults and limits (spec, k, max_tokens, ...).
        tokenizer, template: built from the GGUF.
        pool: the verifiers (started: polled in the background); generations reach
            the draft service of each board through its verifier.
    """

    def __init__(self, config: CoordinatorConfig, tokenizer: Tokenizer, template: ChatTemplate,
                 pool: VerifierPool, metrics: PromMetrics | None = None, tenants: Any = None):
        self.config = config
        self.tenants = tenants   # tenants.Tenants: namespaces are scoped to the caller's tenant
        self.tokenizer = tokenizer
        self.template = template
        self.pool = pool
        self.image_parts = ImageParts(config, model_name(config.model), pool.any_config)
        self.metrics = metrics if metrics is not None else PromMetrics()
        self.digit_tokens = digit_tokens(tokenizer)
        self.line_break_tokens = line_break_tokens(tokenizer) if self.digit_tokens else []
        # the most bytes of text one token covers (a normalizer may shrink text before it is
        # split, by at most 3 bytes to 1: a Hangul syllable composed from its jamo)
        self.max_token_bytes = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab)) \
            * (3 if getattr(getattr(tokenizer, "hf", None), "normalizer", None) is not None else 1)
        self.shutdown = grpc_util.Shutdown()   # the server's (start() sets it)
        self.watch = StallWatch()                # progress deadlines of the generations' calls

    # -- downstream configuration ------------------------------------------------------------
    def verifier_config(self) -> verifier_pb2.GetConfigResponse:
        """A healthy verifier's last GetConfig (every verifier serves the same model).

        Raises:
            RequestError: UNAVAILABLE when no verifier has answered yet.
        """
        cfg = self.pool.any_config()
        if cfg is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"no verifier has answered yet: {self.pool.state_text()}")
        return cfg

    # -- request -> prompt and parameters ----------------------------------------------------
    def resolve_prompt(self, req: Any) -> list[int]:
        """The prompt token ids of a Generate/Complete request.

        Raises:
            RequestError: INVALID_ARGUMENT for zero or several prompt forms, an
                empty prompt, ids outside the vocabulary, malformed chat messages, or a
                message part that cannot be used (image_parts.py: a bad image, or any image
                while the served model takes none).
        """
        forms = [name for name, present in (("text", bool(req.text)),
                                            ("messages", len(req.messages) > 0),
                                            ("token_ids", len(req.token_ids) > 0)) if present]
        if not forms:   # proto3 cannot tell an empty text from none
            raise _bad("the prompt is empty: text is empty and no messages or token_ids are set "
                       "(set exactly one of them)")
        if len(forms) != 1:
            raise _bad(f"set exactly one of text, messages, token_ids (got {', '.join(forms)})")
        if req.HasField("enable_thinking") and forms[0] != "messages":
            raise _bad(f"enable_thinking applies to messages (it is passed to the chat template), "
                       f"not to a prompt given as {forms[0]}")
        if forms[0] == "token_ids":
            n_vocab = self.tokenizer.n_vocab
            ids = list(req.token_ids)
            for i, t in enumerate(ids):
                if not 0 <= t < n_vocab:
                    raise _bad(f"token_ids[{i}] = {t} is outside the vocabulary [0, {n_vocab})")
            return ids
        tools = self.tool_request(req)
        if (tools is not None or req.tool_choice) and forms[0] != "messages":
            raise _bad(f"tools apply to messages (they are rendered by the chat template), not to "
                       f"a prompt given as {forms[0]}")
        if forms[0] == "messages":
            try:
                contents, imgs = self.image_parts.contents_and_images(req.messages)
            except ImagePartError as exc:
                raise _bad(str(exc)) from None
            self.check_images_fit(req.messages, imgs)
            msgs = [_message_dict(m, c) for m, c in zip(req.messages, contents)]
            try:
                extra = {"enable_thinking": req.enable_thinking} if req.HasField("enable_thinking") else {}
                if tools is not None and tools.rendered:
                    extra["tools"] = tools.tools
                text = self.template.render(msgs, add_generation_prompt=True, **extra)
            except MissingChatTemplateError as exc:
                raise _bad(f"messages cannot be used: {exc}") from None
            except TemplateRenderError as exc:   # the messages were fine; the template failed
                raise _bad(f"messages: {exc}") from None
            except ChatTemplateError as exc:
                raise _bad(f"malformed chat messages: {exc}") from None
        else:
            text, imgs = req.text, []
        self.check_fits("prompt", text)
        ids = self.tokenizer.prompt_ids(text)
        if not ids:
            raise _bad("the prompt encodes to no tokens")
        if imgs:
            pad = self.tokenizer.token_to_id(IMAGE_PAD)
            if pad is None:
                raise _bad(f"the model's tokenizer has no {IMAGE_PAD} token: it takes no images")
            try:
                offsets = image_spans(ids, pad, imgs)
            except ImagePartError as exc:
                raise _bad(str(exc)) from None
            ids = PromptIds(ids)
            ids.images = list(zip(imgs, offsets))
        return ids

    def tool_request(self, req: Any) -> tool_calls.ToolRequest | None:
        """The request's checked tools and tool_choice (None: no tools).

        Raises:
            RequestError: INVALID_ARGUMENT naming the field: bad tools or tool_choice, a tool's
                parameters the matcher cannot take, tools for a chat template that does not
                render them, an assistant message with tool calls for such a template.
        """
        try:
            tools = tool_calls.parse_tools(req.tools, req.tool_choice)
            if tools is not None:
                tool_calls.check_schemas(tools)
        except tool_calls.ToolError as exc:
            raise _bad(str(exc)) from None
        if self.template.missing is None and tool_calls.tool_format(self.template.source) is None:
            why = ("the model's chat template does not render tools (it never reads `tools` or does "
                   "not write calls as <tool_call> blocks), so the model cannot be shown them; "
                   "start the server with --chat-template FILE of a template that does "
                   "(Qwen2.5 / Qwen3 / Hermes style)")
            if tools is not None and tools.rendered:
                raise _bad(f"tools: {why}")
            for i, m in enumerate(req.messages):
                if m.tool_calls:
                    raise _bad(f"messages[{i}].tool_calls: {why}")
        return tools

    def check_fits(self, field: str, text: str) -> None:
        """Refuse text that cannot fit a verifier's context before it is tokenized: tokenizing
        holds the GIL (microseconds per token), so megabytes of text stalled every other call of
        the coordinator for seconds, its verifier health polls included.

        Raises:
            RequestError: INVALID_ARGUMENT naming ``field``.
        """
        known = self.pool.any_config()
        if known is None or known.n_ctx <= 0:
            return      # the verifier refuses a prompt too long for it after tokenizing
        most = known.n_ctx * self.max_token_bytes
        if len(text) > most // 4:   # 4 UTF-8 bytes per character at most: count only then
            n = len(text.encode("utf-8", "surrogatepass"))
            if n > most:
                raise _bad(f"{field} of {n} bytes cannot fit the context of {known.n_ctx} tokens "
                           f"(at most {most} bytes: a token covers at most "
                           f"{self.max_token_bytes} bytes of text)")

    def check_images_fit(self, messages: Any, imgs: list) -> None:
        """Refuse images whose tokens alone cannot fit a verifier's context, naming the image
        that crosses it (check_fits would count their placeholders as bytes of text).

        Raises:
            RequestError: INVALID_ARGUMENT naming the part, messages[i].parts[j].
        """
        known = self.pool.any_config()
        if not imgs or known is None or known.n_ctx <= 0:
            return
        wheres = [f"messages[{i}].parts[{j}]" for i, m in enumerate(messages)
                  for j, p in enumerate(m.parts) if p.image]
        total = 0
        for where, img in zip(wheres, imgs):
            n = image_tokens(img) + 2   # its pads, <|vision_start|> and <|vision_end|>
            total += n
            if total >= known.n_ctx:   # one position is kept for generation
                before = f" and the images before it {total - n}" if total > n else ""
                raise _bad(f"{where}: the image takes {n} tokens ({img.resized_width}x"
                           f"{img.resized_height} after resizing){before}, which cannot fit the "
                           f"context of {known.n_ctx} tokens: send a smaller image, or serve "
                           f"with a lower --image-max-pixels")

    def resolve_params(self, req: Any, caps: VerifierCaps) -> GenerationParams:
        """Limits, sampling and the gating verdict of a request.

        Raises:
            RequestError: INVALID_ARGUMENT naming the bad field.
        """
        cfg = self.config
        max_tokens = req.max_tokens or cfg.max_tokens
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise _bad(f"max_tokens must be in [1, {cfg.max_tokens_limit}], got {req.max_tokens}")
        k = cfg.k if req.k == 0 else req.k
        if not 1 <= k <= cfg.k_max:
            raise _bad(f"k must be in [1, {cfg.k_max}] (0: server default {cfg.k}), got {req.k}")
        stops = list(req.stop)
        if len(stops) > cfg.max_stop:
            raise _bad(f"at most {cfg.max_stop} stop strings, got {len(stops)}")
        for i, s in enumerate(stops):
            if not s:
                raise _bad(f"stop[{i}] is empty")
        if req.tools and req.tool_choice not in ("", "auto", "none"):
            # tool_choice required or a named function: the grammar makes the whole output the
            # calls and ends it after them, so a stop string could only cut a call in two
            stops = []
        top_p = req.top_p if req.HasField("top_p") else 1.0
        for name, v in (("temperature", req.temperature), ("top_p", top_p), ("min_p", req.min_p)):
            if math.isnan(v) or math.isinf(v):
                raise _bad(f"{name} must be finite, got {f32_str(v)}")
        if req.top_k < 0:
            raise _bad(f"top_k must be >= 0, got {req.top_k}")
        if not 0.0 < top_p <= 1.0:
            raise _bad(f"top_p must be in (0, 1] (leave it unset or 1 for off), got {f32_str(top_p)}")
        if not 0.0 <= req.min_p <= 1.0:
            raise _bad(f"min_p must be in [0, 1], got {f32_str(req.min_p)}")
        if req.spec not in (common_pb2.SPEC_MODE_UNSPECIFIED, common_pb2.SPEC_MODE_OFF,
                            common_pb2.SPEC_MODE_ON):
            raise _bad(f"unknown spec mode {req.spec}")
        pen = request_penalties(req)
        decision = decide_spec(req.spec, cfg.spec, req.temperature, top_p, req.min_p, caps)
        sampling = common_pb2.SamplingParams(temperature=max(0.0, req.temperature), top_k=req.top_k,
                                             top_p=top_p, min_p=req.min_p, seed=req.seed,
                                             frequency_penalty=pen.frequency,
                                             presence_penalty=pen.presence,
                                             repeat_penalty=pen.repeat if pen.active else 0.0,
                                             repeat_last_n=pen.window if pen.active else 0)
        ns = req.draft_namespace
        if namespace_problem(ns):
            raise _bad(namespace_problem(ns))
        # the prediction is tokenized like the output: on its own, no BOS; the output (and so
        # the part of a prediction it can follow) fits the context. The size is checked whether
        # or not this request speculates (it is only tokenized when it does), so whether a
        # request is valid does not depend on the server's default --spec.
        if req.prediction:
            self.check_fits("prediction", req.prediction)
        prediction = self.tokenizer.encode(req.prediction) if decision.enabled and req.prediction \
            else []
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
        if req.top_logprobs and not req.logprobs:
            raise _bad(f"top_logprobs ({req.top_logprobs}) needs logprobs to be true")
        if not -1 <= req.tree_nodes <= MAX_TREE_DRAFT_NODES:
            raise _bad(f"tree_nodes must be in [-1, {MAX_TREE_DRAFT_NODES}] (0: the verifier's "
                       f"default, -1: chains), got {req.tree_nodes}")
        gram = None
        if req.HasField("grammar"):
            try:   # checked without the vocabulary; the verifier compiles it against the model's
                if grammar.spec_of(req.grammar) is not None:
                    grammar.check_grammar(grammar.spec_of(req.grammar))
                    gram = req.grammar
            except grammar.GrammarError as exc:
                raise _bad(str(exc)) from None
        tools = self.tool_request(req)
        if tools is not None and tools.forced:
            if gram is not None:
                raise _bad(f"tool_choice {tools.choice!r} forces tool calls, so grammar (or "
                           f"response_format) cannot be set too")
            gram = common_pb2.Grammar(lark=tool_calls.call_grammar(tools))
            try:
                grammar.check_grammar(grammar.spec_of(gram))
            except grammar.GrammarError as exc:
                raise _bad(f"tools: the grammar of tool_choice {tools.choice!r}: {exc}") from None
        return GenerationParams(max_tokens=max_tokens, stop=stops, sampling=sampling,
                                spec=decision.enabled, spec_reason=decision.reason, k=k,
                                prediction=prediction, draft_namespace=ns, grammar=gram,
                                logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                                tree_nodes=req.tree_nodes)

    def scoped_namespace(self, namespace: str, context: grpc.ServicerContext) -> str:
        """The draft service's name of the request's ``draft_namespace``: the name itself without
        tenants; with them (--api-keys-file) ``<tenant>/<name>`` for the tenant of the caller's
        key, so one tenant never reads another's memory (services/common/tenants.py). Aborts
        with INVALID_ARGUMENT when the scoped name is too long."""
        if self.tenants is None or not namespace:
            return namespace
        header = metadata_authorization(context.invocation_metadata())
        tenant = self.tenants.tenant_of(header) or ""   # the --api-key key: tenant ""
        scoped = self.tenants.scope(tenant, namespace)
        if len(scoped) > MAX_NAMESPACE_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"draft_namespace must be at most {MAX_NAMESPACE_CHARS - len(tenant) - 1} "
                          f"characters for tenant {tenant!r}, got {len(namespace)}")
        return scoped

    # -- the generation ------------------------------------------------------------------------
    def _run(self, req: Any, context: grpc.ServicerContext, rpc: str) -> Iterator[Delta | Outcome]:
        """One generation with its request record: logged (one INFO line) and counted in the
        metrics when it ends, whatever ends it (success, refusal, failure, cancel, deadline)."""
        rec = RequestRecord(request_id=_request_id(context), rpc=rpc, t0=time.perf_counter())
        self.metrics.request_started()
        error = True
        try:
            for ev in self._generate(req, context, rec):
                if rec.ttft_s is None and ev.token_ids:
                    rec.ttft_s = time.perf_counter() - rec.t0
                if isinstance(ev, Outcome):
                    rec.tokens_out = len(ev.token_ids)
                    rec.finish_reason = _finish_name(ev.finish_reason)
                    rec.spec = ev.spec_enabled
                    rec.counters = ev.counters
                    rec.cached_tokens = ev.counters.cached_prompt_tokens
                else:
                    # past the server's grace period at shutdown: UNAVAILABLE saying so (Complete
                    # too, whose unary handler the server's stream check does not see)
                    self.shutdown.check(context)
                    # counted as they go out, after that check (a message it refuses is not
                    # sent), so a cancelled, failed or shut-down stream reports them too
                    rec.tokens_out += len(ev.token_ids)
                yield ev
            error = False
        finally:
            rec.e2e_s = time.perf_counter() - rec.t0
            if rec.counters is not None:
                rec.cached_tokens = rec.counters.cached_prompt_tokens
            rec.code = grpc_util.status_name(context, error)
            if rec.code != "OK":
                rec.finish_reason = ""
            self.metrics.request_finished(rec)
            log.info("request", extra={"fields": rec.fields()})

    def _generate(self, req: Any, context: grpc.ServicerContext,
                  rec: RequestRecord) -> Iterator[Delta | Outcome]:
        try:
            prompt = self.resolve_prompt(req)
            rec.prompt_tokens = len(prompt)
        except RequestError as exc:
            context.abort(exc.code, exc.message)
        begun = self._start(req, prompt, context)
        if begun is None:       # the client went away or its deadline passed meanwhile
            return
        attempt, params = begun
        rec.verifier = attempt.lease.address
        rec.route = attempt.lease.route
        # the record holds the gating verdict and the stats so far from here on, so a generation
        # that ends without an Outcome (cancelled, deadline, verifier lost) logs what it did
        rec.spec = params.spec
        rec.counters = SpecCounters()
        started = _ResumingLink(self, req, prompt, params, context, attempt)
        try:
            events = generate(prompt, params, self.tokenizer, started, rec.counters)
            tools = self.tool_request(req)
            if tools is not None and tools.rendered:
                events = with_tool_calls(events, tool_calls.ContentFilter(names=tools.names))
            for ev in events:
                if isinstance(ev, Outcome):
                    ev.verifier = started.attempt.lease.address
                yield ev
        except VerifierFailure as exc:
            if context.is_active():
                context.abort(exc.code, str(exc))
        except GenerationError as exc:
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            started.cancel()
            # the last verifier's KV holds prompt + its tokens less the last (prefix routing)
            self.pool.remember(started.attempt.lease.address, prompt + started.tokens[:-1])
            started.attempt.lease.release()
            rec.verifier = started.attempt.lease.address
            rec.moves = len(started.history)

    def arm(self, attempt: _Attempt, others: int) -> None:
        """(Re)start the progress deadline of the attempt's next message. A missed deadline
        ends the call only while another healthy verifier could take the generation: a lone
        verifier that is slow is still the best there is (the client's deadline bounds the
        wait), and one that froze is left when another is back (StallWatch's movable)."""
        d = attempt.clock.deadline_s(others)
        if d is None:
            self.watch.disarm(attempt.link)
            return
        c = attempt.clock
        work = f"a prefill of {c.prompt_tokens} tokens" if c.first else f"round {c.round_ms:.1f} ms"
        address, exclude = attempt.lease.address, attempt.exclude
        self.watch.arm(attempt.link, d, f"no message within its progress deadline of {d:.2f} s "
                       f"(T {c.t_ms:.1f} ms, {work}, {others} other session(s); "
                       f"--stall-floor-s {c.floor_s:g})",
                       movable=attempt.movable or (lambda: self.pool.has_other(address, exclude)))

    def call(self, req: Any, prompt: list[int], output: list[int], lease: Any,
             context: grpc.ServicerContext, namespace: str,
             exclude: list[str] | None = None, movable: Any = None) -> _Attempt:
        """Start the generation on ``lease``'s verifier (resumed after ``output`` when it is
        not empty: prompt + output prefilled, max_tokens less the output) and wait for its
        first message within the progress deadline. ``namespace``: the draft namespace as the
        draft service names it (scoped_namespace); ``exclude``: the verifiers the generation
        cannot move to (the list is read as it grows); ``movable``: () -> bool, whether a stall
        could move the generation (None: another healthy verifier outside ``exclude``).

        Raises:
            RequestError: the request does not suit this verifier (its caps, its max_k).
            _CallFailed: the call failed or stalled before its first message.
        """
        vcfg = lease.config
        params = self.resolve_params(req, VerifierCaps(vcfg.kv_eviction, vcfg.sparse_attention,
                                                       vcfg.batch_max))
        if params.k > vcfg.max_k:
            if req.k:   # asked for: refused; the server's default is the server's to fit
                raise _bad(f"k {params.k} exceeds the verifier's max_k {vcfg.max_k}")
            params.k = vcfg.max_k
        if params.grammar is not None and not vcfg.grammar:
            # an older verifier would drop the field and answer with free text
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"grammar: the verifier {lease.address} does not take a grammar (its "
                               f"GetConfig has no grammar capability: a version without constrained "
                               f"output); upgrade it")
        images = getattr(prompt, "images", ())
        if images:
            if not vcfg.images:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"the verifier {lease.address} takes no images (no --mmproj)")
            if output:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   "a generation with images cannot move to another verifier yet")
        timeout = context.time_remaining()
        if timeout is not None and timeout > 1e6:  # no client deadline: gRPC reports ~infinity
            timeout = None
        link = GenerationLink(lease.stub, verifier_pb2.GenerateTokensRequest(
            prompt=prompt + output, max_tokens=params.max_tokens - len(output),
            eos_ids=sorted(self.tokenizer.eos_ids), sampling=params.sampling, spec=params.spec,
            k=params.k, fixed_k=not self.config.adaptive_k, prediction=params.prediction,
            digit_tokens=self.digit_tokens if params.spec else [],
            line_break_tokens=self.line_break_tokens if params.spec else [],
            draft_namespace=namespace if params.spec else "",
            resumed_tokens=len(output), grammar=params.grammar, logprobs=params.logprobs,
            top_logprobs=params.top_logprobs, tree_nodes=params.tree_nodes,
            images=[verifier_pb2.Image(pixels=np.ascontiguousarray(im.pixels, dtype="<f4").tobytes(),
                                       height=im.resized_height, width=im.resized_width, offset=off,
                                       pixel_hash=im.pixel_hash) for im, off in images]), timeout)
        if not context.add_callback(link.cancel):
            # the RPC ended already (e.g. cancelled while its images were preprocessed): gRPC
            # runs no callback for it, so the verifier would generate every token for nobody
            link.cancel()
        attempt = _Attempt(lease, link, iter(()), None,
                           ProgressClock(self.config.stall_floor_s, vcfg.t_ms, vcfg.prefill_chunk,
                                         len(prompt) + len(output)))
        attempt.exclude = exclude if exclude is not None else []
        attempt.movable = movable
        attempt.namespace = namespace
        self.arm(attempt, self.pool.others(lease.address))
        events = link.events()
        try:
            attempt.first = next(events)
            attempt.events = events
            self.watch.disarm(link)
        except StopIteration:
            self.watch.disarm(link)
        except VerifierFailure as exc:
            ours, stalled = link.cancelled, link.stalled
            self.watch.disarm(link)
            link.cancel()
            raise _CallFailed(exc, ours, stalled) from None
        attempt.params = params
        return attempt

    def _start(self, req: Any, prompt: list[int], context: grpc.ServicerContext):
        """Start the generation on a verifier and wait for its first message.

        A verifier that fails (or misses its progress deadline) before the first message with
        a RETRY_CODES status is left for another (once); one that is unreachable or stalled is
        also reported to the pool, which avoids it until its health returns.

        Returns:
            (attempt, params), or None when the RPC ended meanwhile (cancelled, past its
            deadline). Aborts the RPC on a bad request, with no verifier left, or on a
            verifier's refusal that another verifier would repeat.
        """
        known = self.pool.any_config()
        if known is not None:   # a bad request is INVALID_ARGUMENT even while no verifier is up
            try:
                self.resolve_params(req, VerifierCaps(known.kv_eviction, known.sparse_attention,
                                                      known.batch_max))
            except RequestError as exc:
                context.abort(exc.code, exc.message)
        namespace = self.scoped_namespace(req.draft_namespace, context)
        tried: list[str] = []
        failures: list[str] = []
        code = grpc.StatusCode.UNAVAILABLE   # a lone verifier's refusal keeps its own code
        while True:
            try:
                lease = self.pool.acquire(namespace, exclude=tried, prompt=prompt)
            except NoVerifier as exc:
                context.abort(code, "; ".join(failures + [str(exc)]))
            try:
                attempt = self.call(req, prompt, [], lease, context, namespace)
                return attempt, attempt.params
            except RequestError as exc:
                lease.release()
                context.abort(exc.code, exc.message)
            except _CallFailed as failed:
                exc = failed.failure
                lease.release()
                if failed.ours or not context.is_active():
                    return None   # the RPC's own status (CANCELLED, DEADLINE_EXCEEDED) stands
                if failed.stalled:
                    exc = VerifierFailure(grpc.StatusCode.UNAVAILABLE, failed.stalled)
                if failed.stalled or exc.code in DOWN_CODES:
                    self.pool.report_failure(lease.address, f"{exc.code.name}: {exc.details}")
                if exc.code not in RETRY_CODES:
                    context.abort(exc.code, str(exc))
                failures.append(f"verifier {lease.address} failed before the first token "
                                f"({exc.code.name}: {exc.details})")
                code = exc.code
                # each verifier is tried once, and at most max(1, max_moves) retries in all: the
                # same budget as the moves after the first token (nothing has been streamed)
                if len(tried) >= max(1, self.config.max_moves):
                    context.abort(exc.code, "; ".join(failures))
                tried.append(lease.address)
                self.metrics.v_retries.labels(verifier=lease.address).inc()
                log.warning("%s; retrying on another verifier", failures[-1])

    def Generate(self, request: coordinator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[coordinator_pb2.GenerateResponse]:
        for ev in self._run(request, context, "Generate"):
            if isinstance(ev, Delta):
                yield coordinator_pb2.GenerateResponse(text=ev.text, token_ids=ev.token_ids,
                                                       logprobs=ev.logprobs)
            else:
                yield coordinator_pb2.GenerateResponse(result=result_to_proto(ev))

    def Complete(self, request: coordinator_pb2.CompleteRequest,
                 context: grpc.ServicerContext) -> coordinator_pb2.CompleteResponse:
        outcome = None
        for ev in self._run(request, context, "Complete"):
            if isinstance(ev, Outcome):
                outcome = ev
        if outcome is None:
            # a generation ends without a result when the call ended first (the client left, its
            # deadline passed): the status is the call's own, and no one reads the response
            name = grpc_util.status_name(context)
            if name == "OK":
                context.abort(grpc.StatusCode.INTERNAL, "the generation ended without a result")
            context.abort(grpc.StatusCode[name], "the call ended before its generation")
        return coordinator_pb2.CompleteResponse(result=result_to_proto(outcome))

    def Tokenize(self, request, context):
        try:
            self.check_fits("text", request.text)
        except RequestError as exc:
            context.abort(exc.code, exc.message)
        resp = coordinator_pb2.TokenizeResponse(token_ids=self.tokenizer.encode(request.text))
        size, limit = resp.ByteSize(), self.config.max_message_bytes
        if size > limit:   # grpc would end the call with "SERVER: Sent message larger than max"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"text is {len(resp.token_ids)} tokens, a response of {size} bytes: more "
                          f"than the server's message limit of {limit} bytes; tokenize it in parts")
        return resp

    def Detokenize(self, request, context):
        known = self.pool.any_config()
        n = len(request.token_ids)
        if known is not None and 0 < known.n_ctx < n:
            # no generation holds more tokens than the context; millions of ids would be
            # checked and decoded for a second with the GIL held, into a reply over the limit
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token_ids of {n} tokens cannot fit the context of {known.n_ctx} "
                          f"tokens (at most {known.n_ctx} ids)")
        n_vocab = self.tokenizer.n_vocab
        for i, t in enumerate(request.token_ids):
            if not 0 <= t < n_vocab:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids[{i}] = {t} is outside the vocabulary [0, {n_vocab})")
        return coordinator_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))

    def GetInfo(self, request, context):
        cfg = self.config
        try:
            v = self.verifier_config()
        except RequestError as exc:
            context.abort(exc.code, exc.message)
        statuses = [coordinator_pb2.VerifierStatus(
            address=b.address, healthy=b.healthy, active_sessions=b.reported_active,
            max_sessions=b.max_sessions, free_kv_tokens=b.free_kv_tokens, in_flight=b.in_flight,
            last_error=b.last_error, kv_eviction=b.kv_eviction, sparse_attention=b.sparse_attention,
            kv_type=b.kv_type) for b in self.pool.backends()]
        k_max = min(cfg.k_max, v.max_k)   # what a verifier takes (GetConfig's max_k) too
        return coordinator_pb2.GetInfoResponse(
            model=model_name(cfg.model), spec_default=cfg.spec, k_default=min(cfg.k, k_max),
            k_max=k_max,
            max_tokens_default=cfg.max_tokens, max_tokens_limit=cfg.max_tokens_limit,
            verifier_target=",".join(s.address for s in statuses),
            draft_target=cfg.draft_target, n_ctx=v.n_ctx, n_vocab=v.n_vocab, verifiers=statuses,
            arch=v.arch, n_expert=v.n_expert, n_expert_used=v.n_expert_used,
            chat_template_missing=self.template.missing or "", kv_eviction=v.kv_eviction,
            sparse_attention=v.sparse_attention, kv_type=v.kv_type or "f16",
            images=not self.image_parts.missing, images_missing=self.image_parts.missing)
