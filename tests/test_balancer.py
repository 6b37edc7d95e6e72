"""services/coordinator/balancer.py: the choice of a verifier, one rule per case (no gRPC)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echospec.services.coordinator.balancer import Backend, choose, rendezvous_rank  # noqa: E402


def _b(addr, **kw) -> Backend:
    kw.setdefault("healthy", True)
    kw.setdefault("max_sessions", 8)
    return Backend(addr, **kw)


def test_no_backend_or_none_healthy_gives_none():
    assert choose([]) is None
    assert choose([_b("a:1", healthy=False), _b("b:1", healthy=False)]) is None


def test_unhealthy_is_never_chosen_even_when_idle():
    pool = [_b("a:1", healthy=False), _b("b:1", reported_active=5)]
    assert choose(pool).address == "b:1"


def test_fewest_estimated_active_sessions_wins():
    pool = [_b("a:1", reported_active=3), _b("b:1", reported_active=1), _b("c:1", reported_active=2)]
    assert choose(pool).address == "b:1"


def test_estimate_replaces_our_reported_share_by_our_current_in_flight():
    # a reported 3 when 2 were ours, and we have 2 now: 3; b reported 1, 0 ours then, 3 ours now: 4
    a = _b("a:1", reported_active=3, in_flight_at_report=2, in_flight=2)
    b = _b("b:1", reported_active=1, in_flight_at_report=0, in_flight=3)
    assert (a.estimated_active, b.estimated_active) == (3, 4)
    assert choose([a, b]).address == "a:1"


def test_estimate_never_negative():
    a = _b("a:1", reported_active=0, in_flight_at_report=3, in_flight=0)
    assert a.estimated_active == 0


def test_equal_sessions_more_free_kv_wins():
    pool = [_b("a:1", free_kv_tokens=1000), _b("b:1", free_kv_tokens=5000)]
    assert choose(pool).address == "b:1"


def test_equal_load_takes_turns_by_served_count():
    pool = [_b("a:1", served=4), _b("b:1", served=3), _b("c:1", served=4)]
    assert choose(pool).address == "b:1"


def test_exclude_skips_the_failed_one():
    pool = [_b("a:1"), _b("b:1", reported_active=4)]
    assert choose(pool, exclude=["a:1"]).address == "b:1"
    assert choose(pool, exclude=["a:1", "b:1"]) is None


def test_rendezvous_rank_is_stable_when_others_join_or_leave():
    addrs = ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"]
    for ns in ("alice", "bob", "carol", "dave"):
        full = rendezvous_rank(ns, addrs)
        for gone in addrs:
            rest = [a for a in addrs if a != gone]
            assert rendezvous_rank(ns, rest) == [a for a in full if a != gone]
        joined = rendezvous_rank(ns, addrs + ["10.0.0.4:50053"])
        assert [a for a in joined if a != "10.0.0.4:50053"] == full
    # the owners spread: not every namespace lands on one address
    assert len({rendezvous_rank(f"ns{i}", addrs)[0] for i in range(30)}) == 3


def test_namespace_prefers_its_owner_over_a_less_loaded_one():
    addrs = ["a:1", "b:1", "c:1"]
    owner = rendezvous_rank("ns-1", addrs)[0]
    pool = [_b(a, reported_active=(6 if a == owner else 0)) for a in addrs]
    assert choose(pool, namespace="ns-1").address == owner
    # no namespace: load decides
    assert choose(pool).address != owner


def test_namespace_moves_to_its_next_when_owner_unhealthy_and_back_after():
    addrs = ["a:1", "b:1", "c:1"]
    rank = rendezvous_rank("ns-2", addrs)
    pool = [_b(a) for a in addrs]
    pool[addrs.index(rank[0])].healthy = False
    assert choose(pool, namespace="ns-2").address == rank[1]
    pool[addrs.index(rank[0])].healthy = True
    assert choose(pool, namespace="ns-2").address == rank[0]


def test_namespace_skips_a_full_owner():
    addrs = ["a:1", "b:1"]
    rank = rendezvous_rank("ns-3", addrs)
    pool = [_b(a, max_sessions=2, reported_active=(2 if a == rank[0] else 0)) for a in addrs]
    assert choose(pool, namespace="ns-3").address == rank[1]


def test_unreported_max_sessions_is_never_full():
    assert not Backend("a:1", healthy=True, reported_active=100, max_sessions=0).full
