"""Pure parts of the coordinator: the gating table, the spec controller, the counter formulas,
the wording of a verifier's failure."""
import pytest

from echospec.v1 import common_pb2, coordinator_pb2
from echospec.services.common.economics import SpecCounters
from echospec.services.verifier.controller import SpecController
from echospec.services.coordinator.gating import MODE_OFF, MODE_ON, MODE_UNSPECIFIED, VerifierCaps, decide_spec

OK_CAPS = VerifierCaps()

# (name, mode, server_default, temperature, top_p, min_p, caps, enabled, reason fragment)
GATING = [
    ("greedy, request on", MODE_ON, False, 0.0, 1.0, 0.0, OK_CAPS, True, ""),
    ("greedy, server flag on, request unspecified", MODE_UNSPECIFIED, True, 0.0, 1.0, 0.0, OK_CAPS, True, ""),
    ("request off beats server flag", MODE_OFF, True, 0.0, 1.0, 0.0, OK_CAPS, False, "off by request"),
    ("unspecified without server flag", MODE_UNSPECIFIED, False, 0.0, 1.0, 0.0, OK_CAPS, False, "without --spec"),
    ("temperature > 0", MODE_ON, False, 0.7, 1.0, 0.0, OK_CAPS, False, "temperature 0.7 > 0"),
    ("negative temperature is greedy", MODE_ON, False, -1.0, 1.0, 0.0, OK_CAPS, True, ""),
    ("top_p < 1", MODE_ON, False, 0.0, 0.9, 0.0, OK_CAPS, False, "top_p 0.9 < 1"),
    ("min_p > 0", MODE_ON, False, 0.0, 1.0, 0.05, OK_CAPS, False, "min_p 0.05 > 0"),
    ("KV eviction", MODE_ON, False, 0.0, 1.0, 0.0, VerifierCaps(kv_eviction="sliding"), False, "KV eviction"),
    ("sparse attention", MODE_ON, False, 0.0, 1.0, 0.0, VerifierCaps(sparse_attention=True), False, "sparse attention"),
    ("batched verifier", MODE_ON, False, 0.0, 1.0, 0.0, VerifierCaps(batch_max=2), False, "batch_max 2 >= 2"),
    ("batch_max 1 is fine", MODE_ON, True, 0.0, 1.0, 0.0, VerifierCaps(batch_max=1), True, ""),
]


@pytest.mark.parametrize("name,mode,default,temp,top_p,min_p,caps,enabled,reason", GATING,
                         ids=[g[0] for g in GATING])
def test_gating_table(name, mode, default, temp, top_p, min_p, caps, enabled, reason):
    d = decide_spec(mode, default, temp, top_p, min_p, caps)
    assert d.enabled is enabled
    if enabled:
        assert d.reason == ""
    else:
        assert reason in d.reason


def test_gating_quotes_float32_values_as_sent():
    """The wire's float32 0.3 reads back as 0.30000001192092896; the reason quotes 0.3, and keeps
    the digits a float32 holds (was: ':g', 0.123457 for 0.12345679)."""
    import numpy as np
    f32 = lambda x: float(np.float32(x))
    d = decide_spec(MODE_ON, False, f32(0.12345679), f32(0.3), f32(1e-7), OK_CAPS)
    assert "temperature 0.12345679 > 0" in d.reason and "top_p 0.3 < 1" in d.reason
    assert "min_p 1e-07 > 0" in d.reason


@pytest.mark.parametrize("sent, shown", [(0.3, "0.3"), (1.3, "1.3"), (0.7, "0.7"), (100.0, "100.0"), (-1.0, "-1.0"),
                                         (0.0, "0.0"), (1e-45, "1e-45"), (3.4028234663852886e38, "3.4028235e+38"),
                                         (0.12345679, "0.12345679"), (float("inf"), "inf"), (float("nan"), "nan")])
def test_f32_str_is_the_shortest_float32_spelling(sent, shown):
    import numpy as np
    from echospec.services.common.floats import f32_str
    wire = float(np.float32(sent))
    assert f32_str(wire) == shown
    assert str(np.float32(wire)) == str(np.float32(shown))   # reads back as the same float32


def test_gating_lists_every_violated_rule():
    d = decide_spec(MODE_ON, False, 0.5, 0.5, 0.1, VerifierCaps("sliding", True, 4))
    for frag in ("temperature", "top_p", "min_p", "KV eviction", "sparse", "batch_max"):
        assert frag in d.reason


def test_gating_modes_match_the_proto_enum():
    assert (MODE_UNSPECIFIED, MODE_OFF, MODE_ON) == (
        common_pb2.SPEC_MODE_UNSPECIFIED, common_pb2.SPEC_MODE_OFF, common_pb2.SPEC_MODE_ON)


def test_generate_and_complete_requests_have_the_same_fields():
    g = {(f.name, f.number, f.type) for f in coordinator_pb2.GenerateRequest.DESCRIPTOR.fields}
    c = {(f.name, f.number, f.type) for f in coordinator_pb2.CompleteRequest.DESCRIPTOR.fields}
    assert g == c


def test_controller_proposes_first_then_uses_the_cached_tail():
    c = SpecController(k=2)
    assert c.plan(k_cap=2) == ("propose", 8)
    assert c.on_proposal([5, 6, 7, 8, 9], k_cap=2) == [5, 6]
    c.on_result([5, 6], [5, 6, 7])         # all accepted, bonus 7 == next cached token
    assert c.plan(k_cap=2) == ("cached", [8, 9])


def test_controller_drops_the_cache_when_the_bonus_differs():
    c = SpecController(k=2)
    c.on_proposal([5, 6, 7, 8], k_cap=2)
    c.on_result([5, 6], [5, 6, 1])
    assert c.plan(k_cap=2) == ("propose", 8)


def test_controller_backs_off_after_misses_and_resets_on_a_hit():
    c = SpecController(k=2, max_skip=4)
    c.on_proposal([], k_cap=2)             # miss 1: skip 1 round
    assert c.plan(2) == ("none", 0)
    assert c.plan(2) == ("none", 0)        # backing off: the proposal goes in flight ...
    assert c.prefetch_size(0) == 8         # ... beside the plain step
    c.on_prefetch([3, 4], tokens=[9])      # wrong: miss 2, skip 2 rounds
    assert c.skip == 2
    assert [c.prefetch_size(0) if c.plan(2)[0] == "none" else -1 for _ in range(3)] == [0, 8, 8]
    c.on_proposal([], 2)
    c.on_proposal([], 2)                   # misses 3, 4: skip capped at max_skip
    assert c.skip == 4
    c.skip = 0
    c.on_prefetch([7, 1, 2], tokens=[7])   # a proposal that continues the output
    assert c.plan(2) == ("cached", [1, 2])
    c.on_result([1, 2], [1, 7])            # R = 1 resets
    assert (c.misses, c.skip) == (0, 0)
    assert c.plan(2) == ("propose", 8)     # not backing off: proposals block again


def test_controller_never_drafts_past_k_cap():
    c = SpecController(k=4)
    c.plan(3)
    assert c.on_proposal([1, 2, 3, 4, 5], k_cap=1) == [1]
    assert c.plan(k_cap=0) == ("none", 0)


def test_counter_formulas():
    s = SpecCounters()
    s.add_round(k=4, accepted=4, v_ms=6.0, wall_ms=6.5, t_ms=5.0)
    s.add_round(k=4, accepted=1, v_ms=6.0, wall_ms=6.5, t_ms=5.0)
    s.add_round(k=0, accepted=0, v_ms=5.0, wall_ms=5.2, t_ms=5.0)
    s.check()
    assert (s.tries, s.hits, s.kv_rolls, s.draft_tokens, s.rounds) == (2, 5, 3, 8, 3)
    assert s.acceptance_rate == 5 / 8
    assert s.mean_acceptance_length == 1 + 5 / 2
    assert s.mean_accepted_per_round == 5 / 3
    assert s.v_ms == pytest.approx(17 / 3)
    assert s.overhead_ms == pytest.approx(1.2 / 3)
    gain, text = s.gain()                  # 5.667 + 0.4 < (1.667 + 1) * 5
    assert gain and "gain" in text
    with pytest.raises(ValueError):
        s.add_round(k=2, accepted=3, v_ms=1, wall_ms=1, t_ms=1)


def test_a_verifier_failure_names_the_verifier_once():
    # was: "verifier: verifier 127.0.0.1:P failed after 51 message(s) ..."
    import grpc

    from echospec.services.coordinator.clients import VerifierFailure
    mid = "verifier 127.0.0.1:9 failed after 51 message(s) of this generation had arrived"
    assert str(VerifierFailure(grpc.StatusCode.UNAVAILABLE, mid)) == mid
    assert str(VerifierFailure(grpc.StatusCode.INVALID_ARGUMENT, "bad k")) == "verifier: bad k"
