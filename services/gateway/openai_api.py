"""OpenAI's HTTP API <-> the coordinator's messages: request checks, response and chunk shapes,
error shapes. Pure: no gRPC, no HTTP framework (the proto messages are the contract).

Requests (`parse_request`): the fields of OpenAI's /v1/chat/completions and /v1/completions that
mean something here are mapped; fields that ask for what echospec does not do (logit_bias, echo,
...) are refused with a 400 naming the field, whatever the value for logit_bias, functions and
function_call; unknown fields are refused as OpenAI refuses them, at the top and in a message
(``_MESSAGE_KEYS``: each role's fields), and so are `n` over the gateway's n_limit and more than
4 `stop` sequences (OpenAI's most). Error messages name the client's values and types in JSON's
words (true, null, "text"; boolean, array, object: clip.json_value, clip.json_type). A
completion's `prompt` may be a list of up to MAX_PROMPTS prompts: one coordinator request each,
sharing the other fields. `n` choices per prompt: choice ``index = prompt_i * n + j`` (OpenAI's
order, prompt-major); a sampling request's choice j has the seed ``choice_seed(seed, j)`` (the seed
itself for j = 0, SplitMix64's j-th output from it after), a greedy request's choices are one
generation (choices.py runs them). `model` is checked by the app (app.py: the served model, or
404 model_not_found), here only for its type. Extra fields (echospec's own, documented in
README.md):
    spec             "on" | "off" | null (the server's default): speculation for this request
    k                drafts per round (0 or null: the server's default)
    tree_nodes       token-tree speculation: draft nodes a round verifies in one forward (1..63;
                     0 or null: the verifier's --tree-nodes; -1: chains)
    top_k, min_p     sampling (as in vLLM and llama-server)
    repeat_penalty, repeat_last_n  llama-server's repetition penalty and its window (0: every
                     penalty off, as in llama.cpp; -1: the whole context; null: 64)
    draft_namespace  cross-request draft memory scope ("" shares nothing)
    chat_template_kwargs  chat only, as in vLLM: {"enable_thinking": bool or null} for the model's chat
                     template (Qwen3: false answers without a reasoning block); no other key
Tools (chat): ``tools`` (function tools) and ``tool_choice`` ("auto", "none", "required",
{"type": "function", "function": {"name"}}) go to the coordinator as JSON text and a string
(services/text/tool_calls.py checks both here too, so a bad one is a 400 naming it); an
assistant message may carry ``tool_calls`` (content then null), a tool message ``tool_call_id``.
A result's tool calls are ``message.tool_calls`` with finish_reason "tool_calls"; streamed, each
call is two chunks after the content (OpenAI's shape: index, id, type and name with empty
arguments, then the arguments).
frequency_penalty and presence_penalty take OpenAI's range [-2, 2] but count, as llama-server
does, the last repeat_last_n tokens of prompt + output (README "Repetition penalties").
Logprobs: chat's ``logprobs: true`` with ``top_logprobs: 0..20`` gives ``choices[i].logprobs =
{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``;
a completion's ``logprobs: 0..20`` (OpenAI's legacy shape, its limit 5 raised to 20) gives
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, each dict the
N most likely tokens and the chosen one (as OpenAI: up to N + 1), the offsets in characters of
the completion's text (OpenAI counts the prompt's too; no ``echo`` here). A stream's chunk carries its tokens'.
The values are log_softmax of the model's raw logits at temperature 1 (after a response_format's
mask), the same with speculation on or off (services/verifier/logprobs.py).
Unlike OpenAI, an omitted temperature is 0 (greedy), the setting speculation speeds up, and
temperature follows the coordinator's rule: any finite number, <= 0 greedy (OpenAI: [0, 2]).

Responses carry OpenAI's fields plus one extra object, ``echospec``:
    {"seed": int (sampling only), "spec_enabled": bool, "spec_reason": str,
     "finish_reason": "eos"|"stop"|"length"|"context",
     "stats": {tries, hits, kv_rolls, draft_tokens, ..., accepted_prediction_tokens, ...,
               k_choice, tree_rounds, expected_accepted,
               "sources": {source: {draft_tokens, hits, tries}},
               "round_cost": {wall_ms, v_ms, draft_ms, sched_ms, accept_ms, rollback_ms, rest_ms}}}
(in a stream: on the chunk that carries a choice's finish_reason; in a whole answer of several
choices: on each choice). ``usage`` counts each prompt once and every choice's completion tokens.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from echospec.v1 import common_pb2, coordinator_pb2
from echospec.services.text.chat_template import ROLE_ALIASES, VALID_ROLES
import codecs

from echospec_client.limits import (FLOAT32_MAX, INT32_MAX, MAX_REPEAT_PENALTY, MAX_TOP_LOGPROBS,
                                    MIN_REPEAT_PENALTY, UINT64_MAX)
from echospec.services.common.floats import as_f32
from echospec.services.text.clip import clip, json_type, json_value
from echospec.services.text import tool_calls as tc
from echospec.services.text import images
from echospec.services.common.config import CoordinatorConfig, GatewayConfig


class ApiError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        message = clip(message)   # it may quote a client's value (or name an unknown key) of any size
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else clip(param, 200)
        self.type = type_
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 the gateway gives itself, coded like the coordinator's INVALID_ARGUMENT refusals."""
    return ApiError(400, message, param, code="invalid_argument")


# gRPC status (name) -> HTTP status and OpenAI error type
_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),   # no free session / RPC cap: retry later
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


# request fields the coordinator's INVALID_ARGUMENT messages start with (servicer.py and the
# verifier's context check): "k must be in ...", "stop[0] is empty", "verifier: prompt of ...",
# "messages[1].content[2]: ..." (a part: the param names it, as the gateway's own checks do)
_REFUSED = re.compile(r"(?:malformed chat messages: |verifier: )?([a-z_]+)((?:\[\d+\])?(?:\.[a-z_]+)?(?:\[\d+\])?)(?![a-z_])")
_REFUSED_FIELDS = {"max_tokens", "max_completion_tokens", "k", "temperature", "top_p", "top_k",
                   "min_p", "stop", "seed", "messages", "prompt", "token_ids", "draft_namespace",
                   "tree_nodes", "prediction", "grammar", "tools", "tool_choice", "frequency_penalty",
                   "presence_penalty", "repeat_penalty", "repeat_last_n", "top_logprobs", "logprobs"}


_GRAMMAR_NAMES = (("grammar.json_schema", "response_format.json_schema.schema"),
                  ("grammar.json_object", "response_format json_object"))


_PART = re.compile(r"(messages\[\d+\])\.parts\[")


def refused_param(message: str, chat: bool) -> str | None:
    """The request field a coordinator's INVALID_ARGUMENT message names, in OpenAI's terms (the
    prompt is ``messages`` in a chat request), or None."""
    if message.startswith("at most") and "stop strings" in message:
        return "stop"
    m = _REFUSED.match(message)
    if m is None or m.group(1) not in _REFUSED_FIELDS:
        return None
    name, rest = m.groups()
    if name in ("prompt", "token_ids"):
        return "messages" if chat else "prompt"
    if name == "grammar":   # the coordinator's grammar is the request's response_format
        return "response_format"
    return name + rest


def error_from_status(code: str, message: str, chat: bool | None = None,
                      max_tokens_name: str = "max_tokens",
                      prompt_index: int | None = None) -> ApiError:
    """The ApiError for a coordinator call that ended with gRPC status ``code`` (a name); with
    ``chat`` given, a refused request names its field in ``param``. ``max_tokens_name``: the
    field that carried the limit (a chat request's max_completion_tokens), named in its place.
    ``prompt_index``: the call was for that entry of a list of prompts, named when the prompt
    was refused (``prompt[2]``)."""
    status, kind = _STATUS.get(code, (500, "server_error"))
    if chat and _PART.match(message):   # the gateway sent content[j] as parts[j]: the client's name
        message = _PART.sub(r"\1.content[", message, count=1)
    if max_tokens_name != "max_tokens" and message.startswith("max_tokens "):
        message = max_tokens_name + message[len("max_tokens"):]
    param = refused_param(message, chat) if chat is not None and status == 400 else None
    for grpc_name, http_name in _GRAMMAR_NAMES:   # the grammar came from response_format
        for lead in ("", "verifier: "):
            if message.startswith(lead + grpc_name):
                message = lead + http_name + message[len(lead + grpc_name):]
                break
    if param == "prompt" and prompt_index is not None:
        param = f"prompt[{prompt_index}]"
        message = f"{param}: {message}"
    return ApiError(status, message, param, kind, code.lower())


# ---- requests ------------------------------------------------------------------------------

# fields accepted and ignored: they change nothing in what is generated
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls",
            "prompt_cache_key", "safety_identifier"}
_COMMON = {"stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed", "n",
           "prediction", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
           "spec", "k", "tree_nodes", "top_k", "min_p", "draft_namespace", "response_format",
           "repeat_penalty", "repeat_last_n"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "functions", "function_call", "modalities", "audio",
                   "reasoning_effort", "web_search_options", "chat_template_kwargs"}
# OpenAI chat fields for what echospec does not do: taken only as null (clients send their
# defaults) or, for modalities, text alone
_CHAT_NULL_ONLY = {"audio", "reasoning_effort", "web_search_options"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
# the roles gRPC takes (chat_template.VALID_ROLES), under the name the template renders
_ROLES = {r: ROLE_ALIASES.get(r, r) for r in VALID_ROLES}
# the keys a message of each role may carry: OpenAI's fields of that role's message (an assistant
# message's annotations too, which OpenAI's own answers hold and clients send back with them)
# and a tool message's name (it goes to the chat template); any other key is refused, as at the top
_MESSAGE_KEYS = {"system": {"role", "content", "name"},
                 "developer": {"role", "content", "name"},
                 "user": {"role", "content", "name"},
                 "assistant": {"role", "content", "name", "tool_calls", "refusal", "annotations",
                               "audio", "function_call"},
                 "tool": {"role", "content", "tool_call_id", "name"}}


MAX_STOP = 4   # stop sequences per request, as OpenAI allows
MAX_PROMPTS = 256   # prompts in one /v1/completions request: its answer is held whole in memory


@dataclass
class Parsed:
    """A checked request: the coordinator's request of each prompt and how to answer.

    Choice ``index = prompt_i * n + j`` (OpenAI's order, prompt-major) is prompt ``prompt_i``'s
    request with choice ``j``'s seed (``choice_request``).
    """

    chat: bool
    requests: list[coordinator_pb2.GenerateRequest]   # one per prompt (a chat request has one)
    n: int = 1                   # choices per prompt
    stream: bool = False
    include_usage: bool = False
    extras: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None      # the seed a sampling request used (reported), None when greedy
    max_tokens_name: str = "max_tokens"   # the field that set the limit (errors name it)
    model: str | None = None     # the model the request names (None: left out)

    @property
    def request(self) -> coordinator_pb2.GenerateRequest:
        """The first prompt's request (the only one of a chat request or a single prompt)."""
        return self.requests[0]

    @property
    def greedy(self) -> bool:
        """Greedy decoding: every choice of a prompt is the same text (it is generated once)."""
        return self.request.temperature <= 0

    @property
    def choices(self) -> int:
        return len(self.requests) * self.n

    def choice_seed(self, j: int) -> int | None:
        """The reported seed of choice ``j`` of each prompt (None when greedy)."""
        return None if self.seed is None else choice_seed(self.seed, j)

    def choice_request(self, index: int) -> coordinator_pb2.GenerateRequest:
        """The coordinator's request of choice ``index`` (prompt ``index // n``, seed of choice
        ``index % n``)."""
        req = self.requests[index // self.n]
        j = index % self.n
        if j == 0 or self.greedy:
            return req
        out = coordinator_pb2.GenerateRequest()
        out.CopyFrom(req)
        out.seed = choice_seed(req.seed, j)
        return out


_GOLDEN = 0x9E3779B97F4A7C15   # SplitMix64's increment: 2^64 / the golden ratio, odd
_U64 = (1 << 64) - 1


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice ``j`` (0-based) of a sampling request with ``seed``: choice 0 uses the
    seed itself (so n = 1 is the plain request), choice j > 0 SplitMix64's j-th output from the
    state ``seed``: ``mix((seed + j * 0x9E3779B97F4A7C15) mod 2^64)`` with SplitMix64's
    finalizer ``mix``. The same seed gives the same choices; neighbouring seeds share none (with
    ``seed + j`` request seed 5's choice 1 would be request seed 6's choice 0).

    Example: choice_seed(42, 0) == 42, choice_seed(42, 1) == 13679457532755275413.
    """
    if j == 0:
        return seed
    z = (seed + j * _GOLDEN) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bool_or_null(v: Any) -> bool:
    """A JSON boolean or null (JSON's 1 and 0 are numbers, though Python's True == 1)."""
    return v is None or isinstance(v, bool)


def _finite(v: Any) -> bool:
    """A JSON number that is a finite float (an integer too large for a float is not)."""
    try:
        return _is_num(v) and math.isfinite(v)
    except OverflowError:
        return False


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _finite(v):
        shown = json_value(v) if not isinstance(v, int) or isinstance(v, bool) else \
            f"an integer of {len(str(abs(v)))} digits"
        raise bad(f"{name} must be a number, got {shown}", name)
    if not lo <= v <= hi:
        raise bad(f"{name} must be in [{lo:g}, {hi:g}], got {json_value(v)}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int = INT32_MAX) -> int | None:
    """An integer field, >= lo and <= hi. With the default hi (the wire's int32 limit) the
    coordinator applies the server's own upper limit and names it in its message."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"{name} must be an integer, got {json_value(v)}", name)
    if v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name)
    if v > hi:
        raise bad(f"{name} must be <= {hi}" + (" (the largest value the API carries)"
                                              if hi == INT32_MAX else "") + f", got {v}", name)
    return v


class MaxTokensBelowOne(ApiError):
    """max_tokens (or max_completion_tokens) < 1: a 400 whose range's upper end is the
    coordinator's max_tokens_limit, which only the coordinator knows (``with_limit`` names it)."""

    def __init__(self, name: str, value: int):
        super().__init__(400, f"{name} must be in [1, max_tokens_limit] (the server's limit, "
                              f"{CoordinatorConfig.max_tokens_limit} by default); leave it out "
                              f"for the server's default, got {value}", name, code="invalid_argument")
        self.name, self.value = name, value

    def with_limit(self, limit: int) -> ApiError:
        """The error naming the coordinator's range, in its words for a value above it."""
        return bad(f"{self.name} must be in [1, {limit}] (leave it out for the server's default), "
                   f"got {self.value}", self.name)


def _max_tokens(body: dict, name: str) -> int | None:
    """max_tokens or max_completion_tokens: an integer >= 1. The upper limit is the coordinator's
    (it names it when refusing); 0 is refused here because the wire's 0 means "the server's default"
    (proto3 cannot tell 0 from unset), and an explicit 0 asks for no tokens, which OpenAI refuses."""
    v = _integer(body, name, -math.inf)   # type and int32 checks; the lower bound below
    if v is not None and v < 1:
        raise MaxTokensBelowOne(name, v)
    return v


def _text_content(v: Any, param: str) -> str:
    """A message or prediction content: a string or a list of {"type": "text", "text": str}."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if not v:   # as OpenAI: an empty array is not an empty string
            raise bad(f"{param}: empty array; expected a string or an array of at least one part",
                      param)
        parts = []
        for i, p in enumerate(v):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise bad(f"{param}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                          f"other content types are not supported", f"{param}[{i}]")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{param} must be a string or an array of text parts, got {json_type(v)}", param)


# Image parts: only inline base64 data URLs are taken; a remote URL is always refused (there is
# no option to fetch it, see REMOTE_IMAGE_REFUSAL).
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
REMOTE_IMAGE_REFUSAL = (
    "remote image URLs are not fetched: the gateway never downloads from the network on a "
    "client's behalf (a request could make it reach internal hosts, or wait on a slow or huge "
    "download); send the image inline as a data URL, data:image/png;base64,...")


def _b64_problem(exc: Exception) -> str:
    """binascii's complaint in the client's terms."""
    text = str(exc)
    if "Only base64 data" in text:
        return "a character outside the base64 alphabet A-Z a-z 0-9 + / ="
    if "padding" in text.lower():
        return "its length or = padding is wrong"
    return text


def image_url_bytes(url: Any, param: str) -> tuple[bytes, str]:
    """(bytes, media type) of an image_url part's ``url``: a base64 data URL of a PNG, JPEG,
    WebP or GIF image. Raises ApiError 400 naming ``param``."""
    if not isinstance(url, str):
        raise bad(f"{param}: image_url.url must be a string, got {json_type(url)}", param)
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise bad(f"{param}: {REMOTE_IMAGE_REFUSAL}", param)
    m = _DATA_URL.match(url)
    if m is None:
        raise bad(f"{param}: image_url.url must be a data URL (data:image/png;base64,...), got "
                  f"{json_value(url[:40])}", param)
    media = m.group(1).strip().lower()
    if media not in images.MEDIA_TYPES:
        raise bad(f"{param}: media type {json_value(media) if media else '(none)'} is not supported (supported: "
                  f"image/png, image/jpeg, image/webp, image/gif)", param)
    if "base64" not in [x.strip().lower() for x in m.group(2).split(";")]:
        raise bad(f"{param}: the data URL must be base64 (data:{media};base64,...)", param)
    # line breaks and spaces are left out first: MIME base64 (76-character lines) is common
    text = re.sub(r"[ \t\r\n]+", "", url[m.end():])
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{param}: the data URL's base64 is invalid ({_b64_problem(exc)})", param) from None
    return data, media


# The gateway checks what does not depend on the coordinator's image settings (the format, the
# header, the aspect ratio, Pillow's own bomb cap); the coordinator's byte cap and decoded-pixel
# limit, which a server may raise, are checked there (still a 400 naming the part).
_GATEWAY_IMAGE_LIMITS = images.ImageLimits(max_bytes=2 ** 31 - 1,
                                           max_decoded_pixels=images.MAX_DECODED_PIXELS_CAP)


def _content_parts(v: list, param: str, images_before: int = 0) -> list:
    """A message content with image parts: one ContentPart per part, in order (the same index:
    messages[i].content[j] is messages[i].parts[j] on the wire). Each image's data URL, format
    and header are checked here (images.check: no pixel is decoded in the event loop), so a bad
    one is a 400 naming it; the coordinator decodes it and refuses what only decoding finds
    (also a 400, its part renamed content[j] by error_from_status). images_before: the image
    parts of the earlier messages; the request's images.MAX_IMAGES + 1-th is refused before its
    header is read (a 4 MiB body holds thousands of tiny images, each a header parse)."""
    parts = []
    n_images = images_before
    for j, p in enumerate(v):
        pj = f"{param}[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts.append(coordinator_pb2.ContentPart(text=p["text"]))
        elif kind == "image_url":
            n_images += 1
            if n_images > images.MAX_IMAGES:   # the coordinator's message, part and limit
                raise bad(f"{pj}: more than {images.MAX_IMAGES} images in one request", pj)
            iu = p.get("image_url")
            if isinstance(iu, str):   # some clients send the URL itself
                iu = {"url": iu}
            if not isinstance(iu, dict) or "url" not in iu:
                raise bad(f"{pj}: an image part is {{\"type\": \"image_url\", \"image_url\": "
                          f"{{\"url\": \"data:image/png;base64,...\"}}}}", pj)
            detail = iu.get("detail")
            if detail is not None and detail not in ("auto", "low", "high"):
                raise bad(f"{pj}: image_url.detail must be auto, low or high, got {json_value(detail)}", pj)
            data, media = image_url_bytes(iu["url"], pj)
            try:
                images.check(data, pj, media, _GATEWAY_IMAGE_LIMITS)
            except images.ImageError as exc:
                raise bad(str(exc), pj) from None
            parts.append(coordinator_pb2.ContentPart(image=data, media_type=media))
        else:
            raise bad(f"{pj} must be a text part {{\"type\": \"text\", \"text\": ...}} or an "
                      f"image part {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}",
                      pj)
    return parts


def _refuse_unsupported(body: dict, chat: bool) -> None:
    known = (_CHAT if chat else _COMPLETION) | _IGNORED
    for name in body:
        if name not in known:
            if name in _CHAT and not chat:   # a chat field sent to /v1/completions
                raise bad(f"{name} applies to /v1/chat/completions (chat messages); a completion's "
                          f"prompt is used as it is", name)
            raise bad(f"Unrecognized request argument supplied: {name}", name)
    # refused whatever the value, null and empty ones too: the openai client sends none of them
    # unless asked, and a request that names them asks for what is not done here
    if "logit_bias" in body:
        raise bad("logit_bias is not supported", "logit_bias")
    for name in ("functions", "function_call"):   # the deprecated names of tools, tool_choice
        if name in body:
            raise bad(f"{name} is not supported: use {'tools' if name == 'functions' else 'tool_choice'}",
                      name)
    if chat:
        for name in sorted(_CHAT_NULL_ONLY):
            if body.get(name) is not None:
                raise bad(f"{name} is not supported (only null), got {json_value(body[name])}", name)
        if body.get("modalities") not in (None, ["text"]):
            raise bad(f"modalities: only [\"text\"] is supported, got {json_value(body['modalities'])}",
                      "modalities")
    if body.get("echo") is not None and body["echo"] is not False:
        raise bad("echo is not supported", "echo")
    if body.get("best_of") is not None and (type(body["best_of"]) is not int or body["best_of"] != 1):
        raise bad("best_of must be 1", "best_of")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix is not supported", "suffix")


def _lone_surrogate(v: Any, path: str) -> str | None:
    """The path of the first string in the JSON value ``v`` that is not valid Unicode (a lone
    surrogate, which JSON's \\ud800 escapes can spell but UTF-8 cannot encode), or None."""
    stack = [(v, path)]
    while stack:
        x, p = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(x, list):
            stack.extend((y, f"{p}[{i}]") for i, y in reversed(list(enumerate(x))))
        elif isinstance(x, dict):
            for k, y in reversed(list(x.items())):
                if _lone_surrogate(k, p) is not None:
                    return f"a field name in {p}" if p else "a field name"
                stack.append((y, f"{p}.{k}" if p else str(k)))
    return None


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(body: dict, req: coordinator_pb2.GenerateRequest) -> None:
    """response_format (both routes), OpenAI's shape: {"type": "text"} (free text), {"type":
    "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}} -> the coordinator's grammar (json_object, json_schema as JSON text). The
    output always follows the schema, strict or not; the schema itself is checked by the
    coordinator (a bad one is a 400 naming the problem)."""
    rf = body.get("response_format")
    if rf is None:
        return
    p = "response_format"
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        got = rf.get("type") if isinstance(rf, dict) else rf
        raise bad(f"{p}.type must be \"text\", \"json_object\" or \"json_schema\", got {json_value(got)}", p)
    kind = rf["type"]
    extra = sorted(set(rf) - {"type", "json_schema"} if kind == "json_schema" else set(rf) - {"type"})
    if extra:
        raise bad(f"{p} of type {kind} takes no field {json_value(extra[0])}", f"{p}.{extra[0]}")
    if kind == "text":
        return
    if kind == "json_object":
        req.grammar.json_object = True
        return
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad(f"{p}.json_schema must be an object {{\"name\", \"schema\", \"strict\"}}, "
                  f"got {json_type(js) if js is not None else 'nothing'}", f"{p}.json_schema")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad(f"{p}.json_schema takes no field {json_value(extra[0])}", f"{p}.json_schema.{extra[0]}")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise bad(f"{p}.json_schema.name must be 1-64 letters, digits, '_' or '-', got {json_value(name)}",
                  f"{p}.json_schema.name")
    if not _bool_or_null(js.get("strict")):
        raise bad(f"{p}.json_schema.strict must be a boolean, got {json_value(js['strict'])}",
                  f"{p}.json_schema.strict")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise bad(f"{p}.json_schema.description must be a string", f"{p}.json_schema.description")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"{p}.json_schema.schema must be a JSON schema object, got "
                  f"{json_type(schema)}", f"{p}.json_schema.schema")
    req.grammar.json_schema = json.dumps(schema, ensure_ascii=False)


def _logprobs(body: dict, req: coordinator_pb2.GenerateRequest, chat: bool) -> None:
    """Chat: logprobs (a boolean) and top_logprobs (0..20, only with logprobs true); a
    completion: logprobs, the alternatives wanted per token (0..20; null: none)."""
    if not chat:
        n = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        if n is not None:
            req.logprobs, req.top_logprobs = True, n
        return
    on = body.get("logprobs")
    if not _bool_or_null(on):
        raise bad(f"logprobs must be a boolean, got {json_value(on)}", "logprobs")
    n = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if n and not on:
        raise bad("top_logprobs needs logprobs to be true", "top_logprobs")
    req.logprobs, req.top_logprobs = bool(on), n or 0


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in p)


def _one_prompt(p: Any, param: str) -> coordinator_pb2.GenerateRequest:
    """A request holding one prompt: a non-empty string or a non-empty list of token ids."""
    req = coordinator_pb2.GenerateRequest()
    if isinstance(p, str):
        if not p:
            raise bad(f"{param} must not be empty", param)
        req.text = p
    elif _is_ids(p):
        if not all(0 <= t <= INT32_MAX for t in p):
            raise bad(f"{param} token ids must be in [0, 2^31)", param)
        req.token_ids.extend(p)
    else:
        raise bad(f"{param} must be a string or a non-empty array of token ids, got "
                  f"{json_type(p)}" + (" []" if p == [] else ""), param)
    return req


def _prompts(body: dict) -> list[coordinator_pb2.GenerateRequest]:
    """/v1/completions prompt: a string, token ids, or a list of these (one choice, or n, per
    prompt, in order), each prompt in a request of its own."""
    p = body.get("prompt")
    if p is None:
        raise bad("prompt is required", "prompt")
    if isinstance(p, str) or _is_ids(p):
        return [_one_prompt(p, "prompt")]
    if not isinstance(p, list) or not p:
        raise bad("prompt must be a string, an array of token ids, or a non-empty array of these",
                  "prompt")
    if len(p) > MAX_PROMPTS:
        raise bad(f"prompt takes at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
    return [_one_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)]


def _messages(body: dict, req: coordinator_pb2.GenerateRequest) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty array of {\"role\", \"content\"} objects", "messages")
    n_images = 0   # image parts so far (refused past images.MAX_IMAGES)
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {json_type(m)}", f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, got {json_value(role)}",
                      f"messages[{i}].role")
        _message_keys(m, i, role)
        calls = m.get("tool_calls")
        content = m.get("content")
        if content is None and not calls:
            raise bad(f"messages[{i}].content is required", f"messages[{i}].content")
        if isinstance(content, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" for p in content):
            # image parts, or a part of another type: refused by _content_parts naming both kinds
            msg = req.messages.add(role=_ROLES[role])
            msg.parts.extend(_content_parts(content, f"messages[{i}].content", n_images))
            n_images += sum(1 for part in msg.parts if part.image)
        else:
            msg = req.messages.add(role=_ROLES[role], content="" if content is None else
                                   _text_content(content, f"messages[{i}].content"))
        for j, c in enumerate(calls or []):
            msg.tool_calls.append(_tool_call(c, f"messages[{i}].tool_calls[{j}]"))
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise bad(f"messages[{i}].tool_call_id must be a string, got {json_type(tid)}",
                          f"messages[{i}].tool_call_id")
            msg.tool_call_id = tid or ""
            msg.name = m.get("name") or ""


def _message_keys(m: dict, i: int, role: str) -> None:
    """Refuse a key message ``i`` (of ``role``) may not carry and check the types of the keys
    that only need one (a 400 naming ``messages[i].key``). name, refusal and annotations are
    taken and change nothing except a tool message's name (it goes to the chat template)."""
    keys = _MESSAGE_KEYS[role]
    for key in m:
        if key in keys:
            continue
        p = f"messages[{i}].{key}"
        carriers = sorted(r for r, ks in _MESSAGE_KEYS.items() if key in ks)
        if carriers:   # another role's field: tool_calls on a user message, ...
            raise bad(f"{p}: a {role} message takes no {key} (only {' and '.join(carriers)} "
                      f"messages do)", p)
        raise bad(f"Unrecognized argument supplied in messages[{i}]: {key}", p)
    for key in ("name", "refusal"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(f"messages[{i}].{key} must be a string, got {json_type(v)}", f"messages[{i}].{key}")
    if m.get("annotations") is not None and not isinstance(m["annotations"], list):
        raise bad(f"messages[{i}].annotations must be an array, got {json_type(m['annotations'])}",
                  f"messages[{i}].annotations")
    if m.get("audio") is not None:
        raise bad(f"messages[{i}].audio is not supported (only null), got {json_value(m['audio'])}",
                  f"messages[{i}].audio")
    if m.get("function_call") is not None:
        raise bad(f"messages[{i}].function_call is not supported: use tool_calls",
                  f"messages[{i}].function_call")


def _tool_call(c: Any, p: str) -> coordinator_pb2.ToolCall:
    """An assistant message's tool call, OpenAI's shape: {"id", "type": "function", "function":
    {"name", "arguments": JSON text}}."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or c.get("type", "function") != "function" or \
            not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
        raise bad(f"{p} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\": string, "
                  f"\"arguments\": JSON text}}}}", p)
    if c.get("id") is not None and not isinstance(c["id"], str):
        raise bad(f"{p}.id must be a string", f"{p}.id")
    return coordinator_pb2.ToolCall(id=c.get("id") or "", name=fn["name"],
                                    arguments=fn.get("arguments", "") or "{}")


def _tools(body: dict, req: coordinator_pb2.GenerateRequest) -> None:
    """tools and tool_choice -> the coordinator's JSON text and choice string, checked here as
    the coordinator checks them (a 400 naming the field)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise bad(f"tools must be an array of tool objects, got {json_type(tools)}", "tools")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise bad("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice")
        choice = fn["name"]
        if choice in tc.CHOICES:   # a function may not be named like a mode
            raise bad(f"tool_choice names the function {json_value(choice)}, which no tool can be named",
                      "tool_choice")
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise bad(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                  f"\"function\": {{\"name\": ...}}}}, got {json_value(choice)}", "tool_choice")
    text = json.dumps(tools, ensure_ascii=False) if tools else ""
    try:
        tc.parse_tools(text, choice or "")
    except tc.ToolError as exc:
        msg = str(exc)
        raise bad(msg, "tool_choice" if msg.startswith("tool_choice") else msg.split(" ")[0].split(":")[0]) from None
    req.tools = text
    req.tool_choice = choice or ""


def parse_request(body: Any, chat: bool, n_limit: int = GatewayConfig.n_limit) -> Parsed:
    """Check an OpenAI request body and map it to the coordinator's GenerateRequest of each prompt.

    Args:
        body: the parsed JSON body.
        chat: /v1/chat/completions (True) or /v1/completions (False).
        n_limit: the largest ``n`` taken (the gateway's --n-limit).
    Returns:
        Parsed, whose requests also serve Complete (CompleteRequest has the same fields).
    Raises:
        ApiError: 400 naming the first bad field.
    """
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {json_type(body)}")
    where = _lone_surrogate(body, "")
    if where is not None:
        raise bad(f"{where} is not valid Unicode (a lone surrogate such as \\ud800)",
                  None if where.startswith("a field name") else where)
    _refuse_unsupported(body, chat)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model must be a string", "model")
    n = _integer(body, "n", 1, n_limit)
    if chat:
        req = coordinator_pb2.GenerateRequest()
        _messages(body, req)
        _tools(body, req)
        prompts = [req]
    else:
        prompts = _prompts(body)
        req = coordinator_pb2.GenerateRequest()   # the fields every prompt's request shares
    stream = body.get("stream")
    if not _bool_or_null(stream):
        raise bad(f"stream must be a boolean, got {json_value(stream)}", "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(so, dict) or set(so) - {"include_usage"} or \
                not _bool_or_null(so.get("include_usage")):
            raise bad("stream_options must be {\"include_usage\": bool}", "stream_options")
        include_usage = bool(so.get("include_usage"))
    max_tokens = _max_tokens(body, "max_tokens")
    max_tokens_name = "max_tokens"
    if chat:   # OpenAI's newer name of max_tokens: one limit, so two different values are refused
        mct = _max_tokens(body, "max_completion_tokens")
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise bad(f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) differ: give one of them "
                      f"(they name the same limit)", "max_completion_tokens")
        if mct is not None and max_tokens is None:
            max_tokens, max_tokens_name = mct, "max_completion_tokens"
    req.max_tokens = max_tokens or 0
    # the coordinator's rule (coordinator.proto): any finite float32, <= 0 greedy; wider than
    # OpenAI's [0, 2], so every request OpenAI takes means the same here
    t = _number(body, "temperature", -math.inf, math.inf)
    if t is not None and abs(t) > FLOAT32_MAX:
        raise bad(f"temperature must be a finite float32 (within about ±3.4e38; <= 0 is greedy), "
                  f"got {json_value(body['temperature'])}", "temperature")
    req.temperature = t or 0.0
    top_p = _number(body, "top_p", -math.inf, math.inf)
    if top_p is not None:
        if not 0 < top_p <= 1:   # the coordinator's rule and wording: a nucleus keeps some probability
            raise bad(f"top_p must be in (0, 1] (leave it unset or 1 for off), got {json_value(body['top_p'])}", "top_p")
        if as_f32(top_p) == 0:
            raise bad(f"top_p {json_value(body['top_p'])} rounds to 0 as the float32 the coordinator takes: the "
                      f"smallest top_p is about 1.4e-45", "top_p")
        req.top_p = top_p
    seed = _integer(body, "seed", 0, UINT64_MAX)
    if seed is None and req.temperature > 0:
        # OpenAI's calls without a seed vary; the coordinator's seed 0 is a fixed constant
        seed = secrets.randbelow(UINT64_MAX) + 1
    req.seed = seed or 0
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop must be a non-empty string or an array of them", "stop")
        if len(stop) > MAX_STOP:
            raise bad(f"stop takes at most {MAX_STOP} sequences (as OpenAI's API), got {len(stop)}",
                      "stop")
        req.stop.extend(stop)
    pred = body.get("prediction")
    if pred is not None:
        if not isinstance(pred, dict) or pred.get("type") != "content" or "content" not in pred:
            raise bad("prediction must be {\"type\": \"content\", \"content\": ...}", "prediction")
        req.prediction = _text_content(pred["content"], "prediction.content")
    spec = body.get("spec")
    modes = {None: common_pb2.SPEC_MODE_UNSPECIFIED, "on": common_pb2.SPEC_MODE_ON,
             "off": common_pb2.SPEC_MODE_OFF}
    if not isinstance(spec, (str, type(None))) or spec not in modes:
        raise bad(f"spec must be \"on\", \"off\" or null (the server's default), got {json_value(spec)}", "spec")
    req.spec = modes[spec]
    _response_format(body, req)
    _logprobs(body, req, chat)
    req.k = _integer(body, "k", 0) or 0
    req.tree_nodes = _integer(body, "tree_nodes", -1) or 0
    req.top_k = _integer(body, "top_k", 0) or 0
    req.min_p = _number(body, "min_p", 0.0, 1.0) or 0.0
    _penalties(body, req)
    ns = body.get("draft_namespace")
    if ns is not None:
        if not isinstance(ns, str):
            raise bad("draft_namespace must be a string", "draft_namespace")
        req.draft_namespace = ns
    kw = body.get("chat_template_kwargs") if chat else None
    if kw is not None:
        if not isinstance(kw, dict) or set(kw) - {"enable_thinking"}:
            extra = sorted(set(kw) - {"enable_thinking"}) if isinstance(kw, dict) else None
            raise bad("chat_template_kwargs must be an object whose only key is enable_thinking"
                      + (f" (got {', '.join(map(json_value, extra))})" if extra else ""), "chat_template_kwargs")
        if kw.get("enable_thinking") is not None:   # null: the template's default, as when absent
            if not isinstance(kw["enable_thinking"], bool):
                raise bad("chat_template_kwargs.enable_thinking must be true, false or null",
                          "chat_template_kwargs.enable_thinking")
            req.enable_thinking = kw["enable_thinking"]
    if not chat:   # each prompt's request: its prompt and the shared fields
        for p in prompts:
            prompt = p.SerializeToString()
            p.CopyFrom(req)
            p.MergeFromString(prompt)
    return Parsed(chat=chat, requests=prompts, n=n or 1, stream=bool(stream),
                  include_usage=include_usage, seed=req.seed if req.temperature > 0 else None,
                  max_tokens_name=max_tokens_name, model=body.get("model"))


def _penalties(body: dict, req: coordinator_pb2.GenerateRequest) -> None:
    """frequency_penalty, presence_penalty (OpenAI's, in [-2, 2]), repeat_penalty (> 0, 1 off)
    and repeat_last_n (-1: the whole context; 0: every penalty off, as llama-server reads it)."""
    freq = _number(body, "frequency_penalty", -2.0, 2.0)
    pres = _number(body, "presence_penalty", -2.0, 2.0)
    rep = _number(body, "repeat_penalty", -math.inf, math.inf)
    if rep is not None and not MIN_REPEAT_PENALTY <= rep <= MAX_REPEAT_PENALTY:
        raise bad(f"repeat_penalty must be in [{MIN_REPEAT_PENALTY:g}, {MAX_REPEAT_PENALTY:g}] (1: off), "
                  f"got {json_value(body['repeat_penalty'])}", "repeat_penalty")
    last_n = _integer(body, "repeat_last_n", -1)
    if last_n == 0:   # llama.cpp: a window of no tokens penalises nothing
        return
    req.frequency_penalty = freq or 0.0
    req.presence_penalty = pres or 0.0
    if rep is not None:
        req.repeat_penalty = rep
    req.repeat_last_n = last_n or 0


def complete_request(req: coordinator_pb2.GenerateRequest) -> coordinator_pb2.CompleteRequest:
    """The same request as CompleteRequest (field for field: the proto says so)."""
    return coordinator_pb2.CompleteRequest.FromString(req.SerializeToString())


# ---- responses -----------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def finish_reason(result: coordinator_pb2.GenerationResult) -> str:
    """OpenAI's finish_reason: "length" for max_tokens or a full context, else "tool_calls" when
    the output held tool calls, else "stop"."""
    if result.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_CONTEXT):
        return "length"
    return "tool_calls" if result.tool_calls else "stop"


def tool_calls_json(result: coordinator_pb2.GenerationResult) -> list[dict]:
    """A message's ``tool_calls``, OpenAI's shape."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls]


def usage(result: coordinator_pb2.GenerationResult) -> dict:
    """OpenAI's usage, with the prediction counts and the prefix cache's reused prompt tokens."""
    s = result.stats
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
        },
    }


_STAT_FIELDS = [f.name for f in common_pb2.SpecStats.DESCRIPTOR.fields]


def extras(result: coordinator_pb2.GenerationResult, seed: int | None = None) -> dict:
    """The ``echospec`` object: speculation verdict, native finish reason and SpecStats, and the
    seed of a sampling request (the one it gave, or the one drawn for it)."""
    s = result.stats
    seed_field = {} if seed is None else {"seed": seed}
    return {**seed_field,
        "spec_enabled": result.spec_enabled,
        "spec_reason": result.spec_reason,
        "finish_reason": common_pb2.FinishReason.Name(result.finish_reason)
        .removeprefix("FINISH_REASON_").lower(),
        "stats": {**{name: getattr(s, name) for name in _STAT_FIELDS
                     if name not in ("sources", "round_cost")},
                  "sources": {x.source: {"draft_tokens": x.draft_tokens, "hits": x.hits,
                                         "tries": x.tries} for x in s.sources},
                  "round_cost": {f.name: getattr(s.round_cost, f.name)
                                 for f in s.round_cost.DESCRIPTOR.fields}},
    }


def usage_of(results: list[coordinator_pb2.GenerationResult], n: int = 1) -> dict:
    """The usage of a request's choices (``results`` in index order, ``n`` per prompt), as
    OpenAI counts it: each prompt once (its first choice's prompt and cached tokens), the
    completion and prediction tokens of every choice."""
    out = usage(results[0])
    for k, r in enumerate(results[1:], 1):
        u = usage(r)
        if k % n == 0:
            out["prompt_tokens"] += u["prompt_tokens"]
            out["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
        out["completion_tokens"] += u["completion_tokens"]
        for name, v in u["completion_tokens_details"].items():
            out["completion_tokens_details"][name] += v
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def _alt(x: Any) -> dict:
    return {"token": x.token, "logprob": x.logprob, "bytes": list(x.bytes)}


def chat_logprobs(lps: Any) -> dict:
    """A chat choice's (or chunk's) ``logprobs`` for the TokenLogprobs ``lps``."""
    return {"content": [{**_alt(lp), "top_logprobs": [_alt(t) for t in lp.top_logprobs]}
                        for lp in lps], "refusal": None}


class TextOffsets:
    """The characters of a completion's text before each of its tokens (legacy ``text_offset``):
    the tokens' bytes decoded in order, a piece of a character counting once it is whole."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def take(self, raw: bytes) -> int:
        """The offset of the token of bytes ``raw``, then it is added to the text."""
        at = self.chars
        self.chars += len(self._dec.decode(raw))
        return at


def completion_logprobs(lps: Any, offsets: TextOffsets) -> dict:
    """A completion choice's (or chunk's) legacy ``logprobs`` for the TokenLogprobs ``lps``;
    ``offsets`` holds the text before them (a stream's chunks share one)."""
    tops = []
    for lp in lps:
        d: dict = {}
        for t in lp.top_logprobs:   # two ids of one text: the more likely one's logprob
            d.setdefault(t.token, t.logprob)
        d.setdefault(lp.token, lp.logprob)   # as OpenAI: the chosen token too (up to N + 1)
        tops.append(d)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": tops, "text_offset": [offsets.take(lp.bytes) for lp in lps]}


def response(chat: bool, rid: str, model: str, result: coordinator_pb2.GenerationResult,
             seed: int | None = None) -> dict:
    """A whole (non-streamed) chat.completion or text_completion of one choice."""
    return responses(chat, rid, model, [result], [seed])


def responses(chat: bool, rid: str, model: str, results: list[coordinator_pb2.GenerationResult],
              seeds: list[int | None], n: int = 1, logprobs: bool = False) -> dict:
    """A whole (non-streamed) chat.completion or text_completion: choice ``index`` is
    ``results[index]`` (``n`` choices per prompt, prompt-major), generated with ``seeds[index]``.
    The ``echospec`` object is the response's own with one choice, each choice's with more.
    ``logprobs``: the request asked for them (each choice's ``logprobs``, else null)."""
    choices = []
    for index, result in enumerate(results):
        fr = finish_reason(result)
        lp = None
        if logprobs:
            lp = chat_logprobs(result.logprobs) if chat else \
                completion_logprobs(result.logprobs, TextOffsets())
        if chat:
            message: dict = {"role": "assistant", "content": result.text}
            if result.tool_calls:
                message["content"] = result.text or None
                message["tool_calls"] = tool_calls_json(result)
            choice = {"index": index, "message": message, "logprobs": lp, "finish_reason": fr}
        else:
            choice = {"index": index, "text": result.text, "logprobs": lp, "finish_reason": fr}
        if len(results) > 1:
            choice["echospec"] = extras(result, seeds[index])
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices,
           "usage": usage_of(results, n)}
    if len(results) == 1:
        out["echospec"] = extras(results[0], seeds[0])
    return out


def chunk(chat: bool, rid: str, created: int, model: str, text: str | None,
          result: coordinator_pb2.GenerationResult | None = None, role: bool = False,
          seed: int | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice ``index``: a text delta (with its tokens' ``logprobs``, from
    chat_logprobs or completion_logprobs, when asked for), the opening role delta (chat), or
    the closing chunk with finish_reason and the ``echospec`` object (``result`` given)."""
    fr = finish_reason(result) if result is not None else None
    if chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": fr}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": fr}
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": [choice]}
    if result is not None:
        out["echospec"] = extras(result, seed)
    return out


def tool_call_chunks(rid: str, created: int, model: str, result: coordinator_pb2.GenerationResult,
                     index: int = 0) -> list[dict]:
    """The streamed tool calls of a chat choice, as OpenAI streams them: per call, a chunk with
    its index, id, type and name (arguments ""), then one with its arguments."""
    out = []
    for i, c in enumerate(result.tool_calls):
        for delta in ({"index": i, "id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": ""}},
                      {"index": i, "function": {"arguments": c.arguments}}):
            out.append({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [{"index": index, "delta": {"tool_calls": [delta]},
                                                     "logprobs": None, "finish_reason": None}]})
    return out


def usage_chunk(chat: bool, rid: str, created: int, model: str,
                results: list[coordinator_pb2.GenerationResult], n: int = 1) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage (``usage_of``)."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_of(results, n)}
