"""services/coordinator/pool.py without servers: targets, DNS membership, failure marking, and
what it logs while it waits for a verifier."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echospec.services.coordinator.pool import NoVerifier, VerifierPool, parse_target  # noqa: E402


def test_parse_target():
    assert parse_target("10.0.0.1:50053") == ("static", "10.0.0.1:50053", 0)
    assert parse_target("[::1]:50053") == ("static", "[::1]:50053", 0)
    assert parse_target("dns:///echospec-verifier:50053") == ("dns", "echospec-verifier", 50053)
    for bad in ("", "dns:///noport", "dns:///name:0", "dns:///:50053", "http://x:1"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_dns_membership_follows_the_answers_and_survives_a_failed_lookup():
    answers = [["127.0.0.21", "127.0.0.22"]]

    def resolver(host, port):   # a test double for getaddrinfo
        if answers[0] is None:
            raise OSError("temporary failure in name resolution")
        return [f"{ip}:{port}" for ip in answers[0]]

    pool = VerifierPool(["dns:///v.test:7", "127.0.0.9:8"], 1 << 20, resolver=resolver)
    try:
        assert pool.addresses() == ["127.0.0.21:7", "127.0.0.22:7", "127.0.0.9:8"]
        answers[0] = None
        pool.resolve()
        assert pool.addresses() == ["127.0.0.21:7", "127.0.0.22:7", "127.0.0.9:8"]
        answers[0] = ["127.0.0.22", "127.0.0.23"]
        pool.resolve()
        assert pool.addresses() == ["127.0.0.22:7", "127.0.0.23:7", "127.0.0.9:8"]
        # nothing polled yet: no candidate, and the error says so for each
        with pytest.raises(NoVerifier, match="not polled yet"):
            pool.acquire()
    finally:
        pool.close()


def test_unreachable_verifiers_are_unhealthy_after_a_poll_and_a_reported_failure_sticks():
    pool = VerifierPool(["127.0.0.1:1"], 1 << 20, poll_s=0.1)   # nothing listens on port 1
    try:
        pool.poll()
        (b,) = pool.backends()
        assert not b.healthy and "UNAVAILABLE" in b.last_error
        pool.report_failure("127.0.0.1:1", "UNAVAILABLE: gone")
        assert pool.backends()[0].last_error == "UNAVAILABLE: gone"
        with pytest.raises(TimeoutError, match="127.0.0.1:1"):
            pool.wait_healthy(0.2)
    finally:
        pool.close()


def test_a_coordinator_waiting_for_its_verifier_says_so(monkeypatch, caplog):
    # was: 120 s of silence (one "joined" line), then exit 1
    import logging

    from echospec.services.coordinator import pool as pool_mod
    monkeypatch.setattr(pool_mod, "WAIT_LOG_S", 0.2)
    pool = pool_mod.VerifierPool(["127.0.0.1:1"], 1 << 20, poll_s=0.1)   # nothing listens on 1
    pool.start()
    try:
        with caplog.at_level(logging.INFO, logger="echospec.coordinator"):
            with pytest.raises(TimeoutError):
                pool.wait_healthy(0.7)
        assert "127.0.0.1:1 (" in pool.state_text()
    finally:
        pool.close()
    waits = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("waiting for a verifier to be SERVING")]
    assert waits and "127.0.0.1:1 (" in waits[-1], waits


def _fake_healthy(pool: VerifierPool, prefix_cache: bool = True) -> None:
    """Every entry healthy with a config, as a poll that found them SERVING leaves them."""
    for e in pool._entries.values():
        e.backend.healthy, e.backend.last_error = True, ""
        e.config = SimpleNamespace(prefix_cache=prefix_cache)


def test_a_prompt_goes_where_its_prefix_was_left_until_that_verifier_fails():
    a, b = "127.0.0.1:1", "127.0.0.1:2"   # never called: health is set by hand
    pool = VerifierPool([a, b], 1 << 20, prefix_slack=2)
    try:
        _fake_healthy(pool)
        turn1 = list(range(10, 50))                                  # 40 tokens
        lease = pool.acquire(prompt=turn1)
        assert (lease.address, lease.route) == (a, "least loaded")  # equal load: by address
        pool.remember(a, turn1 + list(range(60, 79)))               # + 20 generated less the last
        lease.release()
        turn2 = turn1 + list(range(60, 80)) + [5] * 8                # 68 tokens
        # a has served one more, so least loaded alone would pick b
        assert pool.acquire(prompt=[1] * 40).address == b
        # (that lease is still held: b has 1 in flight, a none) the prefix holder a serves turn 2
        lease = pool.acquire(prompt=turn2)
        assert (lease.address, lease.route) == (a, "prefix 48 tokens")
        lease.release()
        pool.report_failure(a, "UNAVAILABLE: gone")
        assert pool.acquire(prompt=turn2).address == b
        _fake_healthy(pool)                                          # back (a restart, say)
        lease = pool.acquire(prompt=turn2)
        # a, now the less loaded, serves it, but not as a prefix holder: its prefixes were forgotten
        assert (lease.address, lease.route) == (a, "least loaded")
        pool.remember(b, [])                                          # nothing to keep: no error
    finally:
        pool.close()


def test_prefix_routing_off_remembers_nothing():
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pool = VerifierPool([a, b], 1 << 20)                             # prefix_slack -1: off
    try:
        _fake_healthy(pool)
        turn1 = list(range(10, 50))
        pool.acquire(prompt=turn1).release()
        pool.remember(a, turn1 + list(range(60, 79)))
        lease = pool.acquire(prompt=turn1 + list(range(60, 80)))
        assert (lease.address, lease.route) == (b, "least loaded")
    finally:
        pool.close()


def test_a_verifier_without_a_prefix_cache_is_never_a_prefix_holder():
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    pool = VerifierPool([a, b], 1 << 20, prefix_slack=2)
    try:
        _fake_healthy(pool, prefix_cache=False)
        turn1 = list(range(10, 50))
        pool.acquire(prompt=turn1).release()
        pool.remember(a, turn1 + list(range(60, 79)))
        lease = pool.acquire(prompt=turn1 + list(range(60, 80)))
        assert (lease.address, lease.route) == (b, "least loaded")
    finally:
        pool.close()


def _poll_with_reports(reports, caplog):
    """A pool of verifiers whose GetConfig answers ``reports[address]`` (GetConfigResponse
    keyword arguments), polled twice; the WARNING lines it logged about mixed attention."""
    from echospec.v1 import verifier_pb2
    from grpc_health.v1 import health_pb2
    pool = VerifierPool(list(reports), 1 << 20)
    try:
        for addr, e in pool._entries.items():   # stand-ins for the channels' stubs
            e.health = SimpleNamespace(Check=lambda req, timeout: health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING))
            e.stub = SimpleNamespace(GetConfig=lambda req, timeout, kw=reports[addr]:
                                     verifier_pb2.GetConfigResponse(max_sessions=4, **kw))
        with caplog.at_level("WARNING", logger="echospec"):
            pool.poll()
            pool.poll()                                       # the same reports: no new warning
        warned = [r.getMessage() for r in caplog.records if "does not continue" in r.getMessage()]
        return pool.backends(), warned
    finally:
        pool.close()


def test_a_fleet_with_mixed_kv_eviction_is_warned_about_once(caplog):
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    evictions = {a: "none", b: "sinks 4, window 64"}
    backends, warned = _poll_with_reports({k: {"kv_eviction": v} for k, v in evictions.items()}, caplog)
    assert len(warned) == 1, warned
    assert "'sinks 4, window 64'" in warned[0] and "'none'" in warned[0], warned
    assert {x.address: x.kv_eviction for x in backends} == evictions


def test_a_fleet_with_mixed_sparse_attention_or_kv_type_is_warned_about(caplog):
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    for other, words in (({"sparse_attention": True}, "sparse attention on"),
                         ({"kv_type": "q8_0"}, "KV type q8_0")):
        caplog.clear()
        reports = {a: {"kv_eviction": "none"}, b: {"kv_eviction": "none", **other}}
        _, warned = _poll_with_reports(reports, caplog)
        assert len(warned) == 1 and words in warned[0], warned
        assert "--sparse-attention and --kv-type" in warned[0], warned
    caplog.clear()
    same = {a: {"kv_eviction": "none", "kv_type": "f16"}, b: {"kv_eviction": "none"}}
    backends, warned = _poll_with_reports(same, caplog)
    assert warned == []                           # "" (a verifier that does not say) is f16
    assert {x.kv_type for x in backends} == {"f16"}
