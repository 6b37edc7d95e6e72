"""The tree describes the project, not its history.

No tracked file names a numbered round of work, an issue number or a path of the machine it was
written on: git keeps the history, and a path such as a user's home directory means nothing on
another machine. Binary files and tests/data (recorded outputs) are not read.

The patterns are built from pieces below so that this file does not match them itself. An engine
session named by its index reads "sessions[1]" or "the second session", not the pattern's form.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = ("tests/data/",)

_S = "ses" + "sion"
_I = "iss" + "ue"
# a path that starts a word: not "$R/root/" (a directory inside a root filesystem), "a/root/b",
# "~/work/" or "./work/"
_START = r"(?<![\w$}).~/-])"
# users of example paths and the container image's own user
_EXAMPLE_USERS = ("alice", "bob", "user", "echospec")

PATTERNS = {
    "a numbered round of work": re.compile(r"\b[" + _S[0].upper() + _S[0] + "]" + _S[1:] + r" \d+\b"
                                           r"|\bround \d+ of " + "work" + r"\b"),
    "an issue number": re.compile(r"\b[" + _I[0].upper() + _I[0] + "]" + _I[1:] + r" #?\d+\b"),
    "an absolute machine path": re.compile(
        _START + "/" + "root/"
        + "|" + _START + "/" + "work/"
        + "|" + _START + "/" + "home/(?!(?:" + "|".join(_EXAMPLE_USERS) + r")\b)[A-Za-z_][\w.-]*"),
}


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for every line of text that matches a pattern."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, rx in PATTERNS.items():
            if rx.search(line):
                out.append((n, what, line.strip()))
    return out


def tracked_text_files() -> list[Path]:
    try:
        r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    paths = []
    for name in r.stdout.decode().split("\0"):
        if not name or name.startswith(SKIP_DIRS):
            continue
        p = ROOT / name
        if p.is_file() and not p.is_symlink():
            paths.append(p)
    return paths


def read_text(p: Path) -> str | None:
    """The file as text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = p.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@pytest.mark.parametrize("line", [
    "see " + _S + " 7 for the figures",
    _S.capitalize() + " 13 (the Zen 5 host)",
    "round 2 of " + "work",
    "the goals of " + _I + " 13",
    _I.capitalize() + " #2 asked for it",
    "model = '/" + "root/.cache/echospec/m.gguf'",
    "cd /" + "work/wt-x && make",
    "e.g. /" + "home/carol/.cache",
])
def test_a_history_word_or_machine_path_is_found(line):
    assert findings(line), line


@pytest.mark.parametrize("line", [
    "round 0 of sessions 0, 2, 4 are good",       # engine sessions by index, plural
    "--max-sessions 0",
    'mkdir -p "$R/' + 'root/.cache/echospec"',   # a directory inside a root filesystem
    "useradd --home-dir /" + "home/echospec echospec",
    "# e.g. /" + "home/alice/.cache/echospec/model.gguf",
    "~/.cache/echospec/bench/qwen3-0.6B-shape.Q4_K_M.gguf",
    "the " + _S + "'s KV cache",
    "an " + _I + " of the tokenizer",
])
def test_project_words_are_not_history(line):
    assert not findings(line), line


def test_no_tracked_file_names_its_history():
    bad = []
    for p in tracked_text_files():
        text = read_text(p)
        if text is None:
            continue
        for n, what, line in findings(text):
            bad.append(f"{p.relative_to(ROOT)}:{n}: {what}: {line[:120]}")
    assert not bad, ("say what is true now (git keeps the history):\n" + "\n".join(bad[:50])
                     + (f"\n... and {len(bad) - 50} more" if len(bad) > 50 else ""))
