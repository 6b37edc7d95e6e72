"""Cross-request draft memory, scoped by namespace, bounded, evicting. Pure (no gRPC).

A namespace (the request's ``draft_namespace``; "" never shares) owns one
suffix automaton over the token sequences (prompt + output) of its finished
generations, each followed by its own negative separator, so no match spans
two of them. Nothing is shared between namespaces: a session reads and
writes only its own namespace's index.

Bounds:
    max_tokens       per namespace; adding past it evicts the oldest sequences
                     until at most max_tokens // 2 remain, then rebuilds the
                     automaton from what is left (amortized O(1) per token). A
                     sequence longer than max_tokens keeps its last max_tokens.
    max_namespaces   namespaces kept; one more evicts the least recently used.
The automaton takes about 0.4 KB per token (Python objects; 64k tokens of
text measured at 370-420 bytes each), so the defaults (16384 tokens x 16
namespaces) bound the memory near 110 MB.
Drafts never point into evicted data: a session keeps no state inside the
shared index between calls; each proposal walks the session's recent tokens
from the root of the index as it is now (``ShareIndex.propose``).
Locking: one lock for the namespace table, one per namespace. A proposal
never waits: while its namespace's index is being extended or rebuilt (a
finished generation being added), it drafts nothing from shared memory.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

from echospec.services.draft.suffix_index import SuffixAutomaton, SuffixParams

MAX_NAMESPACE_CHARS = 256


def namespace_problem(ns: str) -> str:
    """Why ``ns`` cannot name a namespace ("" when it can): at most MAX_NAMESPACE_CHARS characters,
    all printable; the message names the rule broken (the coordinator, the verifier and the draft
    service refuse the request with it)."""
    if len(ns) > MAX_NAMESPACE_CHARS:
        return f"draft_namespace must be at most {MAX_NAMESPACE_CHARS} characters, got {len(ns)}"
    for i, c in enumerate(ns):
        if not c.isprintable():
            return (f"draft_namespace must hold printable characters only, got U+{ord(c):04X} "
                    f"at position {i}")
    return ""

WALK_TOKENS = 32  # recent session tokens matched against a shared index per proposal


class ShareIndex:
    """One namespace's sequences and their automaton (callers hold ``lock``)."""

    def __init__(self, max_tokens: int):
        self.lock = threading.Lock()
        self.max_tokens = max_tokens
        self.docs: deque[list[int]] = deque()
        self.n_tokens = 0
        self._seq = 0
        self.sam = SuffixAutomaton()

    def add(self, tokens: list[int]) -> None:
        doc = list(tokens[-self.max_tokens:])
        if not doc:
            return
        if self.n_tokens + len(doc) > self.max_tokens:
            while self.docs and self.n_tokens + len(doc) > self.max_tokens // 2:
                self.n_tokens -= len(self.docs.popleft())
            self.sam = SuffixAutomaton()
            for d in self.docs:
                self._index(d)
        self.docs.append(doc)
        self.n_tokens += len(doc)
        self._index(doc)

    def _index(self, doc: list[int]) -> None:
        self.sam.extend(doc)
        self._seq += 1
        self.sam.append(-self._seq)

    def propose(self, recent: list[int], k: int, params: SuffixParams) -> tuple[list[int], int, float]:
        """Draft continuing ``recent`` (the session's last tokens): (draft, match length, confidence)."""
        state, n = self.sam.walk(recent[-WALK_TOKENS:])
        draft, conf = self.sam.draft(state, n, k, params)
        return draft, n, conf

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bound holds and the index covers exactly the kept docs."""
        assert self.n_tokens == sum(len(d) for d in self.docs) <= self.max_tokens, self.n_tokens
        assert len(self.sam) == self.n_tokens + len(self.docs), (len(self.sam), self.n_tokens)


class SharedMemory:
    """Namespaces -> ShareIndex, thread-safe, bounded (see the module docstring)."""

    def __init__(self, max_tokens: int = 1 << 14, max_namespaces: int = 16):
        if max_tokens < 1 or max_namespaces < 1:
            raise ValueError(f"shared memory bounds must be >= 1, got max_tokens={max_tokens} "
                             f"max_namespaces={max_namespaces}")
        self.max_tokens = max_tokens
        self.max_namespaces = max_namespaces
        self._spaces: OrderedDict[str, ShareIndex] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, namespace: str, tokens: list[int]) -> None:
        """Remember a finished generation's tokens in ``namespace`` ("" remembers nothing)."""
        if not namespace or not tokens:
            return
        with self._lock:
            idx = self._spaces.get(namespace)
            if idx is None:
                idx = self._spaces[namespace] = ShareIndex(self.max_tokens)
                while len(self._spaces) > self.max_namespaces:
                    self._spaces.popitem(last=False)
            self._spaces.move_to_end(namespace)
        with idx.lock:
            idx.add(tokens)

    def propose(self, namespace: str, recent: list[int], k: int, params: SuffixParams
                ) -> tuple[list[int], int, float]:
        """Draft from ``namespace``'s memory only; ([], 0, 1.0) for "", an unknown namespace or
        one whose index is busy being extended."""
        if not namespace:
            return [], 0, 1.0
        with self._lock:
            idx = self._spaces.get(namespace)
            if idx is None:
                return [], 0, 1.0
            self._spaces.move_to_end(namespace)
        if not idx.lock.acquire(blocking=False):
            return [], 0, 1.0
        try:
            return idx.propose(recent, k, params)
        finally:
            idx.lock.release()

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(self._spaces)

    def n_tokens(self, namespace: str) -> int:
        with self._lock:
            idx = self._spaces.get(namespace)
        if idx is None:
            return 0
        with idx.lock:
            return idx.n_tokens

    def kept_tokens(self, namespace: str) -> set[int]:
        """The distinct tokens ``namespace`` holds now (tests)."""
        with self._lock:
            idx = self._spaces.get(namespace)
        if idx is None:
            return set()
        with idx.lock:
            return {t for d in idx.docs for t in d}

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._spaces) <= self.max_namespaces
            spaces = list(self._spaces.values())
        for idx in spaces:
            with idx.lock:
                idx.check_integrity()
