"""services/coordinator/balancer.py: the choice of a verifier, one rule per case (no gRPC)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echospec.services.coordinator.balancer import (  # noqa: E402
    ROUTE_LEAST_LOADED, ROUTE_NAMESPACE, ROUTE_OVERLOADED, Backend, PrefixIndex, block_hashes,
    choose, rendezvous_rank, route)


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


# -- prefix-aware routing (route) ---------------------------------------------------------------

def test_prefix_holder_serves_though_another_is_less_loaded_within_slack():
    pool = [_b("a:1", reported_active=3), _b("b:1", reported_active=1)]
    b, why = route(pool, {"a:1": 512}, slack=2)
    assert (b.address, why) == ("a:1", "prefix 512 tokens")


def test_prefix_holder_over_slack_is_overloaded_and_least_loaded_serves():
    pool = [_b("a:1", reported_active=4), _b("b:1", reported_active=1)]
    b, why = route(pool, {"a:1": 512}, slack=2)
    assert (b.address, why) == ("b:1", ROUTE_OVERLOADED)


def test_a_full_prefix_holder_is_overloaded_whatever_the_slack():
    pool = [_b("a:1", max_sessions=2, reported_active=2), _b("b:1", max_sessions=2, reported_active=1)]
    b, why = route(pool, {"a:1": 64}, slack=100)
    assert (b.address, why) == ("b:1", ROUTE_OVERLOADED)


def test_longest_prefix_wins_among_holders():
    pool = [_b("a:1"), _b("b:1"), _b("c:1")]
    b, why = route(pool, {"a:1": 32, "b:1": 96, "c:1": 64}, slack=2)
    assert (b.address, why) == ("b:1", "prefix 96 tokens")


def test_equal_prefixes_go_to_the_less_loaded_holder():
    pool = [_b("a:1", reported_active=2), _b("b:1", reported_active=1), _b("c:1")]
    b, why = route(pool, {"a:1": 32, "b:1": 32}, slack=2)
    assert (b.address, why) == ("b:1", "prefix 32 tokens")


def test_no_prefix_held_is_least_loaded():
    pool = [_b("a:1", reported_active=2), _b("b:1")]
    assert route(pool, {}, slack=2) == (pool[1], ROUTE_LEAST_LOADED)
    assert route(pool, {"a:1": 0}, slack=2) == (pool[1], ROUTE_LEAST_LOADED)


def test_negative_slack_ignores_prefixes():
    pool = [_b("a:1", reported_active=1), _b("b:1")]
    assert route(pool, {"a:1": 512}, slack=-1) == (pool[1], ROUTE_LEAST_LOADED)


def test_unhealthy_or_excluded_prefix_holder_is_not_chosen():
    pool = [_b("a:1", healthy=False), _b("b:1", reported_active=1), _b("c:1", reported_active=2)]
    assert route(pool, {"a:1": 512, "c:1": 16}, slack=2) == (pool[2], "prefix 16 tokens")
    assert route(pool, {"a:1": 512, "c:1": 16}, slack=2, exclude=["c:1"]) == \
        (pool[1], ROUTE_LEAST_LOADED)
    assert route([_b("a:1", healthy=False)], {"a:1": 512}, slack=2) == (None, "")


def test_namespace_decides_without_a_prefix_and_after_an_overloaded_holder():
    addrs = ["a:1", "b:1", "c:1"]
    owner = rendezvous_rank("ns-1", addrs)[0]
    other = next(a for a in addrs if a != owner)
    pool = [_b(a) for a in addrs]
    assert route(pool, {}, slack=2, namespace="ns-1") == (pool[addrs.index(owner)], ROUTE_NAMESPACE)
    # a prefix elsewhere beats the namespace owner
    assert route(pool, {other: 48}, slack=2, namespace="ns-1") == \
        (pool[addrs.index(other)], "prefix 48 tokens")
    pool[addrs.index(other)].reported_active = 5
    assert route(pool, {other: 48}, slack=2, namespace="ns-1") == \
        (pool[addrs.index(owner)], ROUTE_OVERLOADED)


def test_choose_is_route_without_prefixes():
    pool = [_b("a:1", reported_active=1), _b("b:1")]
    assert choose(pool) is route(pool, {"a:1": 512}, slack=-1)[0]


# -- the prefix index --------------------------------------------------------------------------

def test_block_hashes_are_chained_and_skip_a_partial_block():
    a = list(range(40))
    h = block_hashes(a, 16)
    assert len(h) == 2 and len(set(h)) == 2 and all(len(x) == 16 for x in h)
    assert block_hashes(a[:32], 16) == h            # the partial block adds nothing
    assert block_hashes(a[:15], 16) == []
    # the same second block after another first block hashes differently (chained)
    b = [99] + a[1:]
    assert block_hashes(b, 16)[1] != h[1]
    assert block_hashes(a[16:32], 16)[0] != h[1]


def test_index_predicts_whole_blocks_of_turn_one_prompt_plus_output_less_one():
    idx = PrefixIndex(block=16, capacity=100)
    turn1 = list(range(100, 140)) + list(range(200, 220))      # 40 prompt + 20 output tokens
    idx.remember("a:1", turn1[:-1])                             # the KV: 59 tokens, 3 blocks
    assert idx.blocks("a:1") == 3
    turn2 = turn1 + list(range(300, 312))                       # 72 tokens
    assert idx.match("a:1", block_hashes(turn2, 16), len(turn2)) == 48
    assert idx.match("b:1", block_hashes(turn2, 16), len(turn2)) == 0
    other = [7] + turn2[1:]                                     # differs in the first token
    assert idx.match("a:1", block_hashes(other, 16), len(other)) == 0


def test_index_match_is_capped_at_prompt_length_less_one():
    idx = PrefixIndex(block=16, capacity=100)
    toks = list(range(32))
    idx.remember("a:1", toks)
    assert idx.match("a:1", block_hashes(toks, 16), len(toks)) == 31


def test_index_forgets_a_verifier_and_its_least_recent_blocks():
    idx = PrefixIndex(block=4, capacity=3)
    old, new = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    idx.remember("a:1", old)
    idx.remember("a:1", new)                                    # 4 blocks > 3: old's first goes
    assert idx.blocks("a:1") == 3
    assert idx.match("a:1", block_hashes(old + [0], 4), 9) == 0  # its first block is gone
    assert idx.match("a:1", block_hashes(new + [0], 4), 9) == 8
    idx.forget("a:1")
    assert idx.blocks("a:1") == 0
    assert idx.match("a:1", block_hashes(new + [0], 4), 9) == 0
