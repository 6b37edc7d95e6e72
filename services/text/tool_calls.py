"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): the request's tools checked, the grammar that
forces a call, and the model's tool-call text parsed back into calls. Pure logic, no gRPC.

The format is the one Hermes-style chat templates (Qwen2.5, Qwen3, Hermes) teach their model:
the template lists the tools in its system prompt and asks for each call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_format` says whether a chat template uses it (its source writes ``<tool_call>`` and reads
``tools``). A template that never reads ``tools`` (SmolLM2's, the ChatML fallback) cannot show the
model its tools, so a request with tools is refused there, naming why, rather than silently
generating without them.

``tool_choice`` (`ToolRequest.choice`):
    "" or "auto"  tools rendered, the model chooses; its output is parsed (`parse_tool_calls`)
    "none"        tools not rendered (the prompt is that of a request without them), nothing parsed
    "required"    tools rendered; `call_grammar` forces one or more calls of any of them
    a name        tools rendered; `call_grammar` forces exactly one call of that function
A forced call's arguments follow the function's ``parameters`` schema (compact JSON).

Parsing (`parse_tool_calls`): each ``<tool_call>`` ... ``</tool_call>`` block whose body is a JSON
object with a string ``name`` and an object (or JSON-text) ``arguments`` becomes a `ToolCall`; the
rest of the text is the content (the whitespace beside each call dropped with it, the pieces left
joined by a newline). A block that is not such an
object, or that is not closed, stays in the content as it was written.

Streaming (`ContentFilter`): text is passed on as it comes until a ``<tool_call>`` may begin;
from there it is held until the output ends, when the held text is parsed. What was passed on is
always a prefix of the final content, so the stream and the whole answer agree.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Collection

from echospec.services.text.clip import json_type, json_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("", "auto", "none", "required")
MAX_TOOLS = 128
# the JSON inside a forced call: compact, as services/text/grammar.py writes JSON
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ToolError(ValueError):
    """The request's tools or tool_choice are refused; the message names the field."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools.

    Attributes:
        tools: OpenAI's tool objects as given (``{"type": "function", "function": {...}}``), as
            the chat template receives them.
        choice: "auto", "none", "required" or a function's name ("" is taken as "auto").
    """

    tools: list[dict]
    choice: str

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict:
        """The ``parameters`` schema of the function ``name`` (omitted: no arguments, ``{}``)."""
        fn = self.tools[self.names.index(name)]["function"]
        return fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})

    @property
    def rendered(self) -> bool:
        """The tools go to the chat template and the output is parsed (choice is not none)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """A grammar forces the output to be calls (required or a named function)."""
        return self.choice not in ("auto", "none")


def parse_tools(tools_json: str, tool_choice: str) -> ToolRequest | None:
    """Check the request's ``tools`` (JSON text of OpenAI's array) and ``tool_choice``.

    Args:
        tools_json: "" (no tools) or a JSON array of ``{"type": "function", "function": {"name",
            "description"?, "parameters"?, "strict"?}}``; ``name`` matches `FUNCTION_NAME`,
            ``parameters`` is a JSON schema object (``{"type": "object", ...}``; omitted: none).
        tool_choice: "", "auto", "none", "required" or the name of one of the tools.

    Returns:
        None without tools (then tool_choice must be "", "auto" or "none"), else the ToolRequest
        (its tools as given: the chat template shows them to the model as they are).

    Raises:
        ToolError: naming the field, e.g. ``tools[1].function.name: "get weather" must be 1-64
            letters, digits, '_' or '-'``.
    """
    choice = tool_choice or "auto"
    if not tools_json:
        if choice not in ("auto", "none"):
            raise ToolError(f"tool_choice {tool_choice!r} needs tools: the request has none")
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise ToolError(f"tools is not valid JSON: {exc}") from None
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a JSON array of tool objects, got {json_type(tools)}")
    if not tools:
        if choice not in ("auto", "none"):
            raise ToolError(f"tool_choice {tool_choice!r} needs tools: tools is empty")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools takes at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[dict] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            got = json_value(t.get("type")) if isinstance(t, dict) else json_type(t)
            raise ToolError(f"{p}.type must be \"function\" (the only tool type), got {got}")
        extra = sorted(set(t) - {"type", "function"})
        if extra:
            raise ToolError(f"{p} takes no field {extra[0]!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{p}.function must be an object {{\"name\", \"description\", \"parameters\"}}")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise ToolError(f"{p}.function takes no field {extra[0]!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError(f"{p}.function.name: {json_value(name)} must be 1-64 letters, digits, '_' or '-'")
        if name in CHOICES:
            raise ToolError(f"{p}.function.name: {name!r} is a tool_choice keyword (auto, none, "
                            f"required), so tool_choice could not name it: rename the tool")
        if name in seen:
            raise ToolError(f"{p}.function.name: {name!r} names two tools")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{p}.function.description must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{p}.function.strict must be a boolean")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ToolError(f"{p}.function.parameters (tool {name!r}) must be a JSON schema of an "
                            f"object ({{\"type\": \"object\", \"properties\": ...}})")
        out.append(t)
    if choice not in CHOICES and choice not in seen:
        raise ToolError(f"tool_choice {tool_choice!r} is not \"auto\", \"none\", \"required\" nor "
                        f"the name of one of the tools ({', '.join(sorted(seen))})")
    return ToolRequest(out, choice)


def check_schemas(req: ToolRequest) -> None:
    """Check that the matcher takes each tool's ``parameters`` schema (a forced call is built
    from them; an auto one is checked the same, so whether a request is valid does not depend on
    tool_choice).

    Raises:
        ToolError: ``tools[i].function.parameters (tool 'name'): <the matcher's reason>``.
    """
    from echospec.services.text import grammar
    for i, name in enumerate(req.names):
        try:
            grammar.check_grammar(grammar.GrammarSpec("json_schema", json.dumps(req.parameters(name))))
        except grammar.GrammarError as exc:
            why = str(exc).removeprefix("grammar.json_schema: ")
            raise ToolError(f"tools[{i}].function.parameters (tool {name!r}): {why}") from None


def template_arguments(arguments: str) -> Any:
    """A call's arguments as a chat template receives them (as transformers documents them): a
    mapping when the text is a JSON object, else the text itself (Qwen's templates write a
    string as it is and a mapping with ``tojson``)."""
    try:
        obj = json.loads(arguments)
    except ValueError:
        return arguments
    return obj if isinstance(obj, dict) else arguments


def tool_format(template_source: str) -> str | None:
    """The tool-call format a chat template teaches: "hermes" (it reads ``tools`` and writes
    ``<tool_call>``), or None (it never reads ``tools``, or writes calls some other way)."""
    if re.search(r"\btools\b", template_source) and OPEN in template_source:
        return "hermes"
    return None


def _lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` (JSON's escapes, which llguidance's Lark takes)."""
    return json.dumps(text)


def call_grammar(req: ToolRequest) -> str:
    """The Lark grammar (llguidance's dialect) of the output a forced ``tool_choice`` allows:
    one call of the named function, or (required) one or more calls of any tool, separated by
    a newline. Each call is written as the Hermes format above, its arguments a JSON value of
    the function's ``parameters`` schema (embedded with ``%json``).

    Raises:
        ToolError: the choice does not force a call (auto, none).
    """
    if not req.forced:
        raise ToolError(f"tool_choice {req.choice!r} forces no call")
    names = req.names if req.choice == "required" else [req.choice]
    rules = []
    for i, name in enumerate(names):
        schema = dict(req.parameters(name))
        schema["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
        head = _lark_string(f'{OPEN}\n{{"name": "{name}", "arguments": ')
        rules.append(f"call_{i}: {head} args_{i} {_lark_string('}' + chr(10) + CLOSE)}\n"
                     f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    calls = " | ".join(f"call_{i}" for i in range(len(names)))
    start = "start: call\n" if req.choice != "required" else "start: call (\"\\n\" call)*\n"
    return start + f"call: {calls}\n" + "\n".join(rules) + "\n"


def new_call_id() -> str:
    """A fresh call id, as OpenAI spells them: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')


def _call_of(body: str, names: Collection[str] | None = None) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a block's body, or None when it is not a call (or, with
    ``names``, not a call of one of them). The arguments are the model's own text (a forced call's
    are compact JSON), not a re-serialization."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, dict) and "arguments" in obj:
        # the first "arguments": is the top-level key (a name holds no quote, and a key of the
        # arguments comes after it), so its value's own text starts where the match ends
        m = _ARGUMENTS_KEY.search(body)
        try:
            value, end = json.JSONDecoder().raw_decode(body, m.end()) if m else (None, 0)
        except ValueError:
            value = None
        if value == args:
            return obj["name"], body[m.end():end]
    if isinstance(args, str):   # arguments given as JSON text: kept when it is an object
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, make_id=new_call_id,
                     names: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split model output into content and calls.

    Args:
        text: the output text.
        make_id: () -> a call id (`new_call_id`).
        names: the request's tools: a block calling any other function stays content (None:
            any name).

    Returns:
        (content, calls): the text outside the parsed calls, and the calls in order. With calls,
        the whitespace beside each call is dropped with it, the pieces of text left are joined
        by a newline, and trailing whitespace is trimmed; without, the text is as it was.

    Example::

        parse_tool_calls('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
        == ("Sure.", [ToolCall("call_...", "f", '{"x": 1}')])
    """
    calls: list[ToolCall] = []
    parts: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _call_of(m.group(1), names)
        if call is None:
            continue
        parts.append(text[pos:m.start()])
        pos = m.end()
        calls.append(ToolCall(make_id(), *call))
    if not calls:
        return text, []
    parts.append(text[pos:])
    # the whitespace beside each call goes with it; the pieces left are joined by a newline
    pieces = [p.lstrip() if i else p for i, p in enumerate(parts)]
    pieces = [p.rstrip() if i < len(pieces) - 1 else p for i, p in enumerate(pieces)]
    return "\n".join(p for p in pieces if p).rstrip(), calls


class ContentFilter:
    """The streamed content of an output that may hold tool calls (lifecycle: ``feed`` each text
    delta, then ``finish`` once).

    ``feed`` returns the text that can be passed on now: everything up to the first place a
    ``<tool_call>`` may start, less trailing whitespace (which a call would trim). ``finish``
    parses the whole output and returns the rest of the content and the calls.
    """

    def __init__(self, make_id=new_call_id, names: Collection[str] | None = None) -> None:
        self.text = ""          # the whole output so far
        self.sent = 0           # characters of it passed on
        self.held = False       # a <tool_call> began: everything from it on waits for finish
        self.make_id = make_id
        self.names = names      # the request's tools (parse_tool_calls)

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.held = True
            end = at
        else:   # a tail that may still become "<tool_call>" waits
            end = len(self.text)
            for n in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-n:]):
                    end = len(self.text) - n
                    break
        end = self.sent + len(self.text[self.sent:end].rstrip())
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(the content not passed on yet, the whole content, the calls)."""
        content, calls = parse_tool_calls(self.text, self.make_id, self.names)
        rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
        return rest, content, calls
