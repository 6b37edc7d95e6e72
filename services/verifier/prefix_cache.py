"""Prefix KV reuse: idle engine sessions kept with the tokens whose KV they hold.

When a generation ends, its session goes here with ``tokens`` = the tokens in
its KV cache (prompt + output except the last, pending, token). A new
generation takes the entry whose tokens share the longest prefix with its
prompt, rolls the KV back to that prefix (es_session_rollback: exact) and
prefills only the rest. The result is bitwise what a cold prefill gives: the
KV of a position does not depend on how the tokens before it were split
into forward calls (the engine's batch-invariance contract).

Example: turn 1 of a chat ran prompt P1 and produced A1 (its KV holds P1 + A1
minus A1's last token). Turn 2's prompt P2 = P1 + A1 + the next user message
shares len(P1) + len(A1) - 1 tokens with it; only the rest is prefilled.

Reach: a session whose sliding-window layers keep a ring (Gemma 3's local
layers) can roll back only to n_past >= its ``min_past`` (Session.min_rollback,
fixed while it sits here), or to 0. A shared prefix shorter than that is no
use: the entry counts as sharing nothing. Example: a session that held 2000
tokens with a window of 512 and rings of 768 positions reaches n_past >= 1743;
a prompt sharing its first 1000 tokens gets none of them from it.

Worth it: taking an entry rolls back (and so loses) the tokens past the shared
prefix, which the next turn of that entry's conversation would have reused.
A prompt that continues the entry's conversation (it starts with the entry's
whole prompt: a next turn, the same prompt again) takes it as always; one
that shares only part of the entry's prompt (another chat with the same
system prompt) takes it only when it reuses at least as many tokens as it
loses (n >= len(tokens) - n), and otherwise leaves it for its conversation.
Example: chat 1's entry holds a 31-token prompt whose first 11 tokens are a
system prompt, and 24 more tokens. Chat 2's first turn shares those 11:
11 < 44, so it gets another session and chat 1's second turn, which starts
with chat 1's 31 + 24 tokens, reuses 54 of them.

Bounded: at most ``capacity`` idle sessions (each holds one KV cache of n_ctx
positions); the least recently used is evicted first. Pure bookkeeping: the
caller frees what ``put`` and ``evict_lru`` hand back. Not thread-safe (the
VerifierCore holds its lock around every call).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where a and b hold the same token."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU set of idle sessions keyed by the tokens in their KV cache.

    Args:
        capacity: most idle sessions kept (0: keep none).
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        # id(session) -> (session, its KV's tokens, the smallest n_past > 0 it can roll back to,
        #                 the length of the prompt those tokens start with)
        self._entries: OrderedDict[int, tuple[Any, list[int], int, int]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: Sequence[int]) -> tuple[Any, int]:
        """Remove and return the session sharing the longest reachable prefix with ``prompt``.

        The reusable length is capped at len(prompt) - 1: the prompt's last
        token is always prefilled (its forward gives the first output token);
        a length below the entry's ``min_past`` counts as 0 (see Reach above), and so does
        one shorter than what the entry would lose when the prompt does not continue the
        entry's conversation (see Worth it above).
        Returns:
            (session, reusable tokens), or (None, 0) when no entry shares a
            reachable token.
        """
        best_key, best_n = None, 0
        limit = len(prompt) - 1
        for key, (_, toks, min_past, prompt_len) in self._entries.items():
            common = common_prefix_len(toks, prompt)
            n = min(common, limit)
            if n < min_past or (common < prompt_len and n < len(toks) - n):
                n = 0
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None:
            return None, 0
        session = self._entries.pop(best_key)[0]
        return session, best_n

    def put(self, session: Any, tokens: Sequence[int], min_past: int = 0,
            prompt_len: int = 0) -> list[Any]:
        """Keep ``session`` (most recently used) with its KV's tokens.

        Args:
            min_past: the smallest n_past > 0 the session can roll back to (0: any).
            prompt_len: how many of ``tokens`` were its generation's prompt (0: not said;
                every prompt then counts as continuing it, see Worth it above).
        Returns:
            The sessions evicted to stay within capacity (``session`` itself
            when the capacity is 0 or it holds no tokens); the caller frees them.
        """
        if self.capacity == 0 or not tokens:
            return [session]
        self._entries[id(session)] = (session, list(tokens), max(0, min_past), max(0, prompt_len))
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False)[1][0])
        return evicted

    def evict_lru(self) -> Any | None:
        """Remove and return the least recently used session (None when empty)."""
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[1][0]

    def clear(self) -> list[Any]:
        """Remove every entry; returns their sessions."""
        out = [e[0] for e in self._entries.values()]
        self._entries.clear()
        return out

    def cached_tokens(self) -> int:
        """Tokens held over all entries."""
        return sum(len(e[1]) for e in self._entries.values())
