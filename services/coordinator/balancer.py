"""Which verifier serves a generation: pure policy over the verifiers' last load reports.

No gRPC here (services/coordinator/pool.py polls the verifiers and keeps the
``Backend`` records up to date). The rules, in order:

1. Only healthy verifiers are candidates (grpc.health.v1 SERVING at the last
   poll and no failed call since), minus the ones a retry excludes.
2. A request with a ``draft_namespace`` prefers one verifier per namespace:
   rendezvous hashing (highest random weight, a form of consistent hashing)
   ranks the candidates by sha256(namespace + address); the first one that is
   not full serves it. When a verifier leaves, only its namespaces move; when
   it comes back, they come back (so the draft service's cross-request memory
   of that namespace stays warm on one board).
3. Otherwise the least-loaded candidate: fewest estimated active sessions,
   then most free KV positions, then fewest generations this coordinator has
   sent it (so equal verifiers take turns).

Prefix-aware routing (``route``, before rule 2): a verifier that holds KV of a
leading part of the prompt (``PrefixIndex``: what this coordinator sent it
and what it generated there) serves the prompt when it is not overloaded:
the candidate with the longest predicted prefix wins (ties: the usual load
order) unless it is full or its estimated active sessions exceed the least
loaded candidate's by more than ``slack``; then rules 2 and 3 decide, and the
reason says the holder was overloaded. ``slack`` < 0 turns the rule off.

Example (slack 2): A holds 512 prompt tokens and runs 3 sessions, B none and
runs 1: 3 - 1 = 2 <= 2, A serves ("prefix 512 tokens"). A at 4: 4 - 1 = 3 > 2,
B serves ("prefix holder overloaded").

Estimated active sessions = the verifier's reported ``active_sessions``, less
this coordinator's generations on it when that report was taken, plus this
coordinator's generations on it now. Reports come once per poll; the local
count sees a burst of requests at once.

Example: A reports 3 active (2 of them ours at the time), B reports 1 (0 ours);
we have sent 2 more to B since: A = 3 - 2 + 2 = 3, B = 1 - 0 + 2 = 3; equal load,
the one with more free KV wins.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

PREFIX_BLOCK = 16                  # tokens per hashed block of the prefix index
PREFIX_BLOCKS_PER_VERIFIER = 8192  # blocks remembered per verifier (131072 tokens, ~1.1 MB)

# the routing reasons (the request log's ``route`` field)
ROUTE_LEAST_LOADED = "least loaded"
ROUTE_NAMESPACE = "namespace owner"
ROUTE_OVERLOADED = "prefix holder overloaded"


@dataclass
class Backend:
    """What the coordinator knows of one verifier."""

    address: str                   # host:port
    healthy: bool = False
    reported_active: int = 0       # the verifier's active_sessions at the last poll
    max_sessions: int = 0          # 0: not reported yet (never full)
    free_kv_tokens: int = 0
    in_flight: int = 0             # this coordinator's generations on it now
    in_flight_at_report: int = 0   # ... when the last report was taken
    served: int = 0                # generations this coordinator sent it
    last_error: str = ""
    recoveries: int = 0            # polls that found it SERVING again after it was down
    kv_eviction: str = ""          # its GetConfig kv_eviction ("": not reported yet)
    sparse_attention: bool = False # its GetConfig sparse_attention
    kv_type: str = ""              # its GetConfig kv_type ("": not reported yet)

    @property
    def estimated_active(self) -> int:
        return max(0, self.reported_active - self.in_flight_at_report) + self.in_flight

    @property
    def full(self) -> bool:
        """Every session slot is taken (by the last report and our generations since)."""
        return self.max_sessions > 0 and self.estimated_active >= self.max_sessions


def rendezvous_rank(namespace: str, addresses: Iterable[str]) -> list[str]:
    """Addresses by decreasing sha256(namespace NUL address) weight (the first is the owner).

    The ranking of two addresses never depends on the others, so adding or
    removing an address moves only the namespaces it owns.
    """
    def weight(addr: str) -> bytes:
        return hashlib.sha256(f"{namespace}\0{addr}".encode()).digest()
    return sorted(addresses, key=weight, reverse=True)


def choose(backends: Sequence[Backend], namespace: str = "",
           exclude: Iterable[str] = ()) -> Backend | None:
    """The verifier for the next generation (None: no healthy candidate).

    Args:
        backends: every known verifier.
        namespace: the request's draft_namespace ("" : no preference).
        exclude: addresses not to use (the one a retry moves away from).
    """
    return route(backends, {}, -1, namespace, exclude)[0]


def route(backends: Sequence[Backend], prefix: dict[str, int], slack: int, namespace: str = "",
          exclude: Iterable[str] = ()) -> tuple[Backend | None, str]:
    """The verifier for the next generation and why (see the module docstring).

    Args:
        backends, namespace, exclude: as for ``choose``.
        prefix: address -> prompt tokens whose KV that verifier is predicted to hold
            (``PrefixIndex.match``); a missing address holds none.
        slack: how many more estimated active sessions than the least-loaded candidate the
            prefix holder may have and still serve (< 0: prefix routing off).
    Returns:
        (backend, reason): reason is "prefix N tokens", ROUTE_OVERLOADED, ROUTE_NAMESPACE
        or ROUTE_LEAST_LOADED; (None, "") when no healthy candidate.
    """
    skip = set(exclude)
    cands = [b for b in backends if b.healthy and b.address not in skip]
    if not cands:
        return None, ""
    overloaded = False
    if slack >= 0:
        order = lambda b: (-prefix.get(b.address, 0), b.estimated_active,  # noqa: E731
                           -b.free_kv_tokens, b.served, b.address)
        holder = min(cands, key=order)
        held = prefix.get(holder.address, 0)
        if held > 0:
            least = min(b.estimated_active for b in cands)
            if not holder.full and holder.estimated_active - least <= slack:
                return holder, f"prefix {held} tokens"
            overloaded = True
    if namespace:
        by_addr = {b.address: b for b in cands}
        for addr in rendezvous_rank(namespace, by_addr):
            if not by_addr[addr].full:
                return by_addr[addr], ROUTE_OVERLOADED if overloaded else ROUTE_NAMESPACE
    b = min(cands, key=lambda b: (b.estimated_active, -b.free_kv_tokens, b.served, b.address))
    return b, ROUTE_OVERLOADED if overloaded else ROUTE_LEAST_LOADED


def block_hashes(tokens: Sequence[int], block: int = PREFIX_BLOCK) -> list[bytes]:
    """Chained hashes of the whole ``block``-token blocks of ``tokens``.

    h[i] = blake2b(h[i-1] + tokens[i*block:(i+1)*block] as 4-byte little-endian), 16 bytes,
    h[-1] = b"": h[i] names the whole prefix tokens[:(i+1)*block], not only its last block.
    A trailing partial block has no hash.
    """
    out: list[bytes] = []
    h = b""
    for i in range(len(tokens) // block):
        chunk = b"".join(int(t).to_bytes(4, "little", signed=True)
                         for t in tokens[i * block:(i + 1) * block])
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        out.append(h)
    return out


class PrefixIndex:
    """Per verifier, a bounded LRU of the token-block prefixes whose KV it is predicted to hold.

    What it mirrors: a verifier keeps a finished generation's session with the tokens of its
    KV cache, prompt + output except the last token (services/verifier/prefix_cache.py), and
    a new prompt reuses the longest common prefix, at most len(prompt) - 1 tokens. So
    ``remember(address, prompt + output[:-1])`` after a generation, and ``match`` predicts
    the reuse in whole blocks: the leading blocks of the prompt found there, times
    ``block``, capped at len(prompt) - 1. The prediction is a lower bound of the verifier's
    own (it reuses partial blocks too) unless the verifier has evicted that session since.

    Example (block 16): turn 1 sent 40 prompt tokens and got 20 back; remembered: 59 tokens,
    3 whole blocks. Turn 2's prompt (the 60 tokens + 12 new) matches 3 blocks: 48 tokens.

    Args:
        block: tokens per block. capacity: blocks kept per verifier (least recently used
            forgotten first). Not thread-safe (the pool holds its lock around every call).
    """

    def __init__(self, block: int = PREFIX_BLOCK, capacity: int = PREFIX_BLOCKS_PER_VERIFIER):
        self.block = block
        self.capacity = max(0, capacity)
        self._by_addr: dict[str, OrderedDict[bytes, None]] = {}

    def remember(self, address: str, tokens: Sequence[int]) -> None:
        """``address`` now holds KV of ``tokens`` (its blocks become the most recently used)."""
        lru = self._by_addr.setdefault(address, OrderedDict())
        for h in block_hashes(tokens, self.block):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, address: str, hashes: Sequence[bytes], prompt_len: int) -> int:
        """Prompt tokens ``address`` is predicted to reuse (hashes: block_hashes(prompt))."""
        lru = self._by_addr.get(address)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return max(0, min(n * self.block, prompt_len - 1))

    def forget(self, address: str) -> None:
        """``address`` restarted, went unhealthy or left: it holds nothing we know of."""
        self._by_addr.pop(address, None)

    def blocks(self, address: str) -> int:
        """Blocks remembered for ``address``."""
        return len(self._by_addr.get(address, ()))
