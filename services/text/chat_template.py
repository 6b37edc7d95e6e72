"""Chat template rendering: chat messages -> prompt text, with the model's own template.

The template is the GGUF key ``tokenizer.chat_template`` (Jinja2), rendered the way Hugging Face
transformers' ``apply_chat_template`` does: ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, and these names in scope:

* ``messages``               -- the validated list of ``{"role": str, "content": str}`` dicts
  (an assistant's may also hold ``tool_calls``: ``[{"id", "type": "function", "function":
  {"name", "arguments"}}]``, arguments a mapping when they are a JSON object; a tool's
  ``tool_call_id`` and ``name``), as transformers passes them;
* ``tools``                  -- only when a request has tools: OpenAI's tool objects;
* ``add_generation_prompt``  -- bool: end with the header of an assistant turn;
* ``bos_token``, ``eos_token`` -- the text of the BOS / EOS tokens (``""`` if the model has none);
* ``raise_exception(msg)``   -- lets a template refuse input (-> `ChatTemplateError`);
* ``strftime_now(fmt)``      -- the current local time formatted with ``time.strftime``;
* the ``tojson`` filter (``ensure_ascii=False``, as transformers does).

The sandbox forbids access to unsafe attributes and mutation of the inputs; a template that tries
gets a `ChatTemplateError`, like every other render failure. One render also has a work budget, so
that a hostile template (a ``--chat-template`` file, or a GGUF's) cannot hold a request's thread,
the server's memory or its shutdown: it runs for at most `RENDER_SECONDS` (a trace on the rendering
thread checks the clock at each line of template code); ``range`` yields at most `RENDER_BUDGET`
items in all; a ``*`` or ``+`` that would build a string or list longer than that, a ``**`` with a
result of more than that many bits, a call or filter given a number past it (``ljust``,
``center``, a format's width) and a format string with a width of a million or more are refused.
Constant expressions are not evaluated at compile time, so compiling runs none of the template.

A GGUF without a template gets `CHATML_TEMPLATE` (documented below) when its vocabulary has the
ChatML tokens ``<|im_start|>`` and ``<|im_end|>``. Any other GGUF without a template (Gemma 3 270M,
a base model, is one) has no chat format at all: `ChatTemplate.from_metadata` then returns a template
that refuses every render with `MissingChatTemplateError`, unless a template is given in its place
(``echospec serve --chat-template FILE``). Rendering adds no BOS of its own: whatever the template
writes is the prompt text, to be tokenized with special-token parsing.

Example (SmolLM2-135M-Instruct)::

    ChatTemplate.from_gguf(path).render([{"role": "user", "content": "hi"}])
    == "<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
       "<|im_end|>\\n<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from contextlib import contextmanager
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from echospec.services.text.tokenizer import GGUFTokenizerMetadata, read_tokenizer_metadata

__all__ = ["ChatTemplateError", "TemplateRenderError", "MissingChatTemplateError", "ChatTemplate",
           "CHATML_TEMPLATE", "CHATML_TOKENS", "RENDER_BUDGET", "VALID_ROLES", "ROLE_ALIASES", "validate_messages"]

# The fallback for a GGUF without tokenizer.chat_template: plain ChatML, no default system message.
# Each message -> "<|im_start|>{role}\n{content}<|im_end|>\n"; generation prompt
# "<|im_start|>assistant\n".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# a vocabulary with both as tokens is a ChatML model: the fallback applies to it
CHATML_TOKENS: tuple[str, str] = ("<|im_start|>", "<|im_end|>")

VALID_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})
# roles taken under another name: "developer" is OpenAI's newer name for the system message
ROLE_ALIASES: dict[str, str] = {"developer": "system"}
_KEYS = frozenset({"role", "content"})
# the optional keys and the role that may carry each
_TOOL_KEYS = {"tool_calls": "assistant", "tool_call_id": "tool", "name": "tool"}


class ChatTemplateError(ValueError):
    """Malformed chat messages, or a template that fails to compile or render."""


class TemplateRenderError(ChatTemplateError):
    """The messages were well formed but the template failed on them: ``raise_exception``, a
    sandbox violation, its work budget, or a Python error inside the template."""


class MissingChatTemplateError(ChatTemplateError):
    """Chat messages for a model that has no chat template (and is not a ChatML model)."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return plain copies.

    Args:
        messages: a non-empty list (or tuple) of mappings, each with the keys ``"role"``
            (a str in `VALID_ROLES`; "developer" becomes "system") and ``"content"`` (a str,
            may be empty); an assistant message may add ``"tool_calls"`` (a list of
            ``{"id", "type": "function", "function": {"name", "arguments"}}``), a tool message
            ``"tool_call_id"`` and ``"name"`` (strs).

    Returns:
        A new list of new ``{"role": ..., "content": ...}`` dicts (with the tool keys given).

    Raises:
        ChatTemplateError: the first problem found, naming the message index and field, e.g.
            ``"messages[1].role: 'robot' is not one of assistant, developer, system, tool, user"``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ChatTemplateError("messages is empty: at least one message is required")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content, "
                                    f"got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ChatTemplateError(f"messages[{i}].{key} is missing")
        extra = sorted(str(k) for k in m.keys() if k not in _KEYS and _TOOL_KEYS.get(k) != m["role"])
        if extra:
            raise ChatTemplateError(f"messages[{i}] has unsupported field(s) {', '.join(extra)}; "
                                    f"only role and content are accepted (and tool_calls on an "
                                    f"assistant message, tool_call_id and name on a tool message)")
        role, content = m["role"], m["content"]
        if not isinstance(role, str):
            raise ChatTemplateError(f"messages[{i}].role must be a string, got {type(role).__name__}")
        if role not in VALID_ROLES:
            raise ChatTemplateError(f"messages[{i}].role: {role!r} is not one of "
                                    f"{', '.join(sorted(VALID_ROLES))}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        msg: dict[str, Any] = {"role": ROLE_ALIASES.get(role, role), "content": content}
        for key in ("tool_call_id", "name"):
            if key in m:
                if not isinstance(m[key], str):
                    raise ChatTemplateError(f"messages[{i}].{key} must be a string")
                msg[key] = m[key]
        if "tool_calls" in m:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Plain copies of an assistant message's tool calls, checked."""
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise ChatTemplateError(f"{where} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments"), (str, Mapping)):
            raise ChatTemplateError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": "
                                    f"{{\"name\": str, \"arguments\": str or object}}}}")
        args = fn["arguments"]
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": json.loads(json.dumps(args)) if isinstance(args, Mapping) else args}})
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


# items one render may take from range(), in all; also the longest string or list a * or + may
# build, the largest int a call or filter may take (a width, a count) and the most bits a ** may
# produce (real chat templates need a few hundred of each)
RENDER_BUDGET = 1_000_000
# seconds one render may run (a real template renders in well under a millisecond)
RENDER_SECONDS = 1.0

# a run of 7 or more digits in a format string: a width or precision past RENDER_BUDGET's order
_HUGE_FORMAT = re.compile(r"\d{7,}")


class _Budget:
    """One render's work budget: a ``range`` that counts what it yields."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def range(self, *args: int):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateRenderError(f"chat template asked range() for {len(r)} items; "
                                      f"the most one call may yield is {MAX_RANGE}")
        return self._count(r)

    def _count(self, r: range):
        for x in r:
            self.left -= 1
            if self.left < 0:
                raise TemplateRenderError(f"chat template exceeded its work budget: its loops took "
                                          f"more than {RENDER_BUDGET} items from range()")
            yield x


@contextmanager
def _deadline(seconds: float):
    """Stop the template code this thread runs once it has run ``seconds`` (a loop over a long
    string or list, which no counter sees): a trace function on this thread only checks the clock
    at each line the template's code runs."""
    end = time.monotonic() + seconds
    previous = sys.gettrace()

    def trace(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateRenderError(f"chat template ran for more than {seconds:g} s "
                                      f"(its work budget) and was stopped")
        return trace

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _check_args(what: str, args: tuple, kwargs: dict) -> None:
    """Refuse an int argument past RENDER_BUDGET (a width, a count): str.ljust(10**9),
    center(10**9), "{:>{w}}".format(1, w=10**9) ..."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > RENDER_BUDGET:
            raise TemplateRenderError(f"chat template passed {v} to {what}; the largest number a "
                                      f"call may take is {RENDER_BUDGET}")


def _checked_filter(name: str, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_args(f"the {name} filter", args, kwargs)
        return fn(*args, **kwargs)
    for attr in ("jinja_pass_arg",):   # keep how Jinja passes the context / environment
        if hasattr(fn, attr):
            setattr(call, attr, getattr(fn, attr))
    return call


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*``, ``+``, ``**`` and ``%``, every call and every filter checked
    against `RENDER_BUDGET` first. Constant expressions are not folded at compile time
    (``optimized=False``), so nothing a template computes runs outside these checks."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optimized=False, **kwargs)
        self.filters = {name: _checked_filter(name, fn) for name, fn in self.filters.items()}

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_args(getattr(__obj, "__name__", "a function"), args, kwargs)
        fmt = getattr(__obj, "__self__", None)
        if isinstance(fmt, str) and _HUGE_FORMAT.search(fmt):
            raise TemplateRenderError("chat template formats with a width or precision of a million "
                                      "or more")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map") and _HUGE_FORMAT.search(obj):
            raise TemplateRenderError("chat template formats with a width or precision of a million "
                                      "or more")
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(n, int) and _size(seq) * max(n, 0) > RENDER_BUDGET:
                    raise TemplateRenderError(f"chat template tried to repeat a sequence of {_size(seq)} "
                                              f"items {n} times; the limit is {RENDER_BUDGET} items")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > RENDER_BUDGET:
                raise TemplateRenderError(f"chat template tried to build a sequence of {a + b} items; "
                                          f"the limit is {RENDER_BUDGET}")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and abs(left).bit_length() * right > RENDER_BUDGET:
                raise TemplateRenderError(f"chat template tried to compute {left} ** {right}, a number "
                                          f"of more than {RENDER_BUDGET} bits")
        elif operator == "%" and isinstance(left, str):
            if _HUGE_FORMAT.search(left):
                raise TemplateRenderError("chat template formats with a width or precision of a "
                                          "million or more")
            _check_args("a % format", right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)


class ChatTemplate:
    """A compiled chat template.

    Attributes:
        source: the Jinja source in use (`CHATML_TEMPLATE` when it stands in for a missing
            template; ``""`` when there is none, see `missing`).
        is_fallback: True when `CHATML_TEMPLATE` stands in for a missing template.
        missing: None, or why there is no template: then `render` raises
            `MissingChatTemplateError` with this text.
        bos_token, eos_token: the texts given to the template.
    """

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        """Compile ``source`` (``None`` or ``""`` -> `CHATML_TEMPLATE`).

        Raises:
            ChatTemplateError: the template does not compile (message carries Jinja's reason and
                line).
        """
        self.is_fallback: bool = not source
        self.missing: str | None = None
        self.source: str = source if source else CHATML_TEMPLATE
        self.bos_token: str = bos_token
        self.eos_token: str = eos_token
        env = _BudgetedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _checked_filter("tojson", _tojson)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            line = getattr(e, "lineno", None)
            raise ChatTemplateError(f"chat template does not compile"
                                    f"{f' (line {line})' if line else ''}: {e}") from None

    @classmethod
    def from_metadata(cls, meta: GGUFTokenizerMetadata, source: str | None = None) -> "ChatTemplate":
        """Build from already-read GGUF tokenizer metadata (see `read_tokenizer_metadata`).

        Args:
            meta: the GGUF's tokenizer keys (BOS / EOS texts, the template).
            source: a template to use instead of the GGUF's (``--chat-template FILE``).

        Without ``source`` or a template in the GGUF: `CHATML_TEMPLATE` if the vocabulary has the
        `CHATML_TOKENS`, else a template whose `render` raises `MissingChatTemplateError`.

        Raises:
            ChatTemplateError: the template does not compile.
        """
        def text(i: int | None) -> str:
            return meta.tokens[i] if i is not None and 0 <= i < len(meta.tokens) else ""
        src = source or meta.chat_template
        t = cls(src, bos_token=text(meta.bos_id), eos_token=text(meta.eos_id))
        if not src and not set(CHATML_TOKENS) <= set(meta.tokens):
            t.is_fallback = False
            t.source = ""
            t.missing = ("the model has no chat template (its GGUF has no tokenizer.chat_template "
                         "and its vocabulary has no ChatML tokens), so chat messages cannot be "
                         "turned into a prompt; send a text prompt, or start the server with "
                         "--chat-template FILE (a Jinja chat template)")
        return t

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "ChatTemplate":
        """Build from a GGUF file's ``tokenizer.chat_template`` and BOS / EOS token texts.

        Raises:
            FileNotFoundError: no such file.
            ValueError: unreadable GGUF or tokenizer keys (see `read_tokenizer_metadata`).
            ChatTemplateError: the template does not compile.
        """
        return cls.from_metadata(read_tokenizer_metadata(path))

    def render(self, messages: Any, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: list[dict] | None = None) -> str:
        """Render chat messages into prompt text.

        Args:
            messages: see `validate_messages`.
            add_generation_prompt: end with the start of an assistant turn.
            enable_thinking: None: not defined for the template (its own default); else passed as
                ``enable_thinking`` (Qwen3's templates: false closes an empty think block at the
                generation prompt, and the model answers without reasoning).
            tools: None: not defined for the template; else passed as ``tools`` (OpenAI's tool
                objects, see services/text/tool_calls.py).

        Returns:
            The prompt text (special tokens appear as text, e.g. ``"<|im_start|>"``).

        Raises:
            MissingChatTemplateError: the model has no chat template (`missing`).
            ChatTemplateError: malformed messages (naming message index and field).
            TemplateRenderError: a render failure: ``raise_exception`` called by the template, a sandbox security violation,
                or any other error inside the template.
        """
        if self.missing is not None:
            raise MissingChatTemplateError(self.missing)
        msgs = validate_messages(messages)
        try:
            extra: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
            if tools is not None:
                extra["tools"] = json.loads(json.dumps(tools))   # plain copies
            with _deadline(RENDER_SECONDS):
                return self._template.render(
                    messages=msgs,
                    add_generation_prompt=bool(add_generation_prompt),
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    range=_Budget(RENDER_BUDGET).range,
                    **extra,
                )
        except TemplateRenderError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateRenderError(f"chat template violated the sandbox: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateRenderError(f"chat template error: {e}") from None
        except Exception as e:  # errors raised by Python operations inside the template
            raise TemplateRenderError(f"chat template failed: {type(e).__name__}: {e}") from None
