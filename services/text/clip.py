"""Error messages that quote what a client sent, kept to a readable size."""
from __future__ import annotations

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
