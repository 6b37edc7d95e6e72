"""Logging of the services: one setup for every entry point, text or JSON lines.

    setup(level="INFO", fmt="text")   # or fmt="json": one JSON object per line

A record may carry structured fields in ``extra={"fields": {...}}`` (the coordinator's
per-request line does): the text format appends them as ``key=value``, the JSON format puts them
at the top level of the object beside ``ts``, ``level``, ``logger`` and ``message``.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")


def _text_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' ="')) else s


class TextFormatter(logging.Formatter):
    """``2026-12-01T12:00:00.123Z INFO echospec.coordinator message key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname} {record.name} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (RFC 3339, UTC), level, logger, message, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        for k, v in (getattr(record, "fields", None) or {}).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Configure the root logger: one handler on `stream` (stderr) with the chosen format.

    Raises:
        ValueError: unknown level or format (the message lists the choices).
    """
    lv = level.upper()
    if lv not in LEVELS:
        raise ValueError(f"log level {level!r}: one of {', '.join(LEVELS)}")
    if fmt.lower() not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lv)


def write_stderr_line(line: str | bytes) -> None:
    """Write one line to stderr as a single write(2) on its descriptor, a newline added when it
    has none. sys.stderr's TextIOWrapper is not safe to share between threads (CPython
    gh-118138: lines come out split into each other, or lost), and print() writes the newline
    apart; a pipe takes a write of up to PIPE_BUF (4 KiB) bytes whole, so lines from threads (the
    announcements of `echospec serve`, its children's log lines) never mix."""
    raw = line if isinstance(line, bytes) else line.encode("utf-8", "backslashreplace")
    if not raw.endswith(b"\n"):
        raw += b"\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # replaced by an object with no descriptor
        with _STDERR_LOCK:
            sys.stderr.write(raw.decode("utf-8", "replace"))
            sys.stderr.flush()
        return
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]


_STDERR_LOCK = threading.Lock()
