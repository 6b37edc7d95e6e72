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
from dataclasses import dataclass
from typing import Iterable, Sequence


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
    skip = set(exclude)
    cands = [b for b in backends if b.healthy and b.address not in skip]
    if not cands:
        return None
    if namespace:
        by_addr = {b.address: b for b in cands}
        for addr in rendezvous_rank(namespace, by_addr):
            if not by_addr[addr].full:
                return by_addr[addr]
    return min(cands, key=lambda b: (b.estimated_active, -b.free_kv_tokens, b.served, b.address))
