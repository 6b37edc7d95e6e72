"""Error messages that quote what a client sent, kept to a readable size."""
from __future__ import annotations

import json

MESSAGE_LIMIT = 1000
"""Characters of an error message at most. A message quotes the client's value (a role, a key, a
field's text), which can be megabytes: gRPC carries the message in a trailer that clients refuse
above 16 KiB (RESOURCE_EXHAUSTED instead of the real status), and an HTTP error body or a log line
of megabytes helps nobody."""


def clip(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` with its middle left out when it is longer than ``limit`` characters: its
    start (which names the field) and its end (which often lists what is allowed) stay."""
    if len(message) <= limit:
        return message
    mark = f" ... [{len(message)} characters, some left out] ... "
    keep = max(limit - len(mark), 2)
    head = keep * 3 // 4
    return f"{message[:head]}{mark}{message[len(message) - (keep - head):]}"


def json_type(v: object) -> str:
    """The JSON type of a value parsed from JSON, in JSON's words: null, boolean, number,
    string, array or object (what a client sent, not the Python type it was read into)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__   # not from JSON: the caller's own value


def json_value(v: object, limit: int = 200) -> str:
    """A value parsed from JSON written back as JSON text, as the client sent it (``true``,
    ``null``, ``"text"``, ``[1, 2]``), at most ``limit`` characters (``clip``)."""
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):   # not JSON, or too deep: Python's words
        text = repr(v)
    return clip(text, limit)
