"""The spec controller's cost model: draft only where V + overhead < (E[accepted] + 1) * (T + overhead)."""
from __future__ import annotations

import pytest

from echospec.services.verifier.controller import CostModel, SpecController, best_k, expected_accepted


def cost(t: float, slope: float, overhead: float = 0.5, hop: float = 0.4) -> CostModel:
    c = CostModel(prior_slope=slope)
    c.observe(0, t, t + overhead, t)
    c.hop_ms, c.overhead_ms = hop, overhead
    return c


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.0, 4) == 0


def test_no_draft_when_verify_costs_more_than_it_can_return():
    # V(K) = T (1 + 1.2 K): even a sure hit of K = 1 costs 2.2 T for 2 tokens.
    c = cost(t=5.0, slope=1.2)
    assert best_k(0.99, 4, c, hop=False) == 0


def test_long_drafts_when_acceptance_is_high_and_verify_is_cheap():
    c = cost(t=5.0, slope=0.05)
    assert best_k(0.95, 8, c, hop=False) == 8


def test_short_drafts_when_acceptance_is_middling():
    c = cost(t=5.0, slope=0.3)
    k = best_k(0.5, 8, c, hop=False)
    assert 1 <= k <= 3


def test_measured_v_overrides_the_linear_model():
    c = cost(t=5.0, slope=0.05)
    for _ in range(50):
        c.observe(4, 25.0, 25.5, 5.0)       # V(4) measured at 5 T
    assert c.v_est(4) == pytest.approx(25.0, rel=0.05)
    assert c.slope() > 0.5                  # the fit follows the measurement
    assert best_k(0.6, 4, c, hop=False) < 4


def test_controller_keeps_the_cached_tail_over_a_plain_step():
    c = SpecController(k=4, cost=cost(t=5.0, slope=5.0))   # verify never pays
    assert c.on_proposal([7, 8, 9], k_cap=4) == []          # proposal kept, nothing drafted
    assert c.plan(4) == ("none", 0)
    c.on_result([], [7])                                    # plain step produced the cached 7
    assert c.cache == [8, 9]
    c.on_result([], [1])                                    # diverged: the tail is stale
    assert c.cache == []


def test_a_round_drafted_elsewhere_advances_the_cache_without_counting_acceptance():
    c = SpecController(k=4, cost=None)
    assert c.on_proposal([7, 8, 9, 10], k_cap=4, source=1) == [7, 8, 9, 10]
    c.advance([7, 8])                                       # the grammar's forced tokens, as cached
    assert c.cache == [9, 10] and c.acc == {}
    c.advance([9, 11])                                      # diverged: the tail is stale
    assert c.cache == []


def test_acceptance_estimate_tracks_recent_rounds():
    c = SpecController(k=4, cost=cost(t=5.0, slope=0.1))
    p0 = c.p_accept
    c.on_proposal([1, 2, 3, 4], 4)
    c.on_result([1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert c.p_accept > p0
    for _ in range(10):
        c.on_proposal([1, 2, 3, 4], 4)
        c.on_result([1, 2, 3, 4], [9])
    assert c.p_accept < 0.3


def test_a_pessimistic_estimate_is_probed_again():
    c = SpecController(k=4, cost=cost(t=5.0, slope=5.0), probe_every=4)
    c.on_proposal([1, 2, 3, 4, 5, 6, 7, 8, 9], k_cap=4)
    plans = []
    for tok in range(1, 9):
        kind, arg = c.plan(4)
        plans.append(kind)
        c.on_result(arg if kind == "cached" else [], list(arg) + [tok + 2] if kind == "cached" else [tok])
    assert "cached" in plans                     # a probe drafted although the model said no


def test_a_v_sample_under_half_the_estimate_replaces_it_others_average_in():
    c = CostModel()
    c.observe(4, 10.0, 10.5, 3.0)
    c.observe(4, 6.0, 6.5, 3.0)                        # 0.6 of it: the moving average
    assert c.v_ms[4] == pytest.approx(9.6)
    c.observe(4, 4.0, 4.5, 3.0)                        # under half: the estimate was stale
    assert c.v_ms[4] == 4.0
    c.observe(4, 40.0, 40.5, 3.0)                      # a dear sample only moves it by alpha
    assert c.v_ms[4] == pytest.approx(7.6)


def _held_down(probe_v: float, rounds: int) -> list[int]:
    """A controller whose V(16) was measured once at 10 T, over ``rounds`` rounds whose drafts are
    all kept: each round's K; a round of 16 measures V(16) = probe_v."""
    c = SpecController(k=16, cost=cost(t=3.0, slope=0.1, overhead=0.1), probe_up_every=3)
    c.cost.observe(16, 30.0, 30.1, 3.0)
    ks = []
    for _ in range(rounds):
        d = c.on_proposal(list(range(1, 33)), k_cap=16)
        ks.append(len(d))
        if len(d) == 16:
            c.cost.observe(16, probe_v, probe_v + 0.1, 3.0)
        c.on_result(d, d + [99])
    return ks


def test_a_high_acceptance_held_down_by_a_dear_v_drafts_all_it_has_now_and_then():
    """V(16) measured once at 10 T (a forward beside other work) keeps the cost model at short
    drafts although every draft is kept; after probe_up_every such rounds one drafts all at hand,
    and the V it then measures (2 T) lets the model take long drafts again. Where the dear V is
    right, each probe doubles the wait for the next; at a low acceptance there is none."""
    ks = _held_down(6.0, 30)
    first = ks.index(16)                               # held down, then one probe of all 16
    assert first >= 3 and all(0 < k < 16 for k in ks[first - 2:first]), ks
    assert ks[-1] == 16, ks                            # the new figure stands
    ks = _held_down(30.0, 60)
    probes = [i for i, k in enumerate(ks) if k == 16]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:])), ks
    low = SpecController(k=16, cost=cost(t=3.0, slope=0.1, overhead=0.1), probe_up_every=3)
    low.cost.observe(16, 30.0, 30.1, 3.0)
    for _ in range(30):
        d = low.on_proposal(list(range(1, 33)), k_cap=16)
        assert len(d) < 16
        low.on_result(d, d[:len(d) // 3] + [99])


# ---- one gain formula: the controller's choice and the reported verdict ----------------------

@pytest.mark.parametrize("t,o,v,r", [
    (5.0, 3.0, 11.0, 1),    # 14 >= 2 * 5: no gain
    (5.0, 0.5, 12.0, 1),    # 12.5 >= 10: no gain
    (5.0, 0.5, 9.0, 1),     # 9.5 < 10: a gain
    (10.0, 2.0, 26.0, 2),   # 28 < 30: a gain
    (10.0, 2.0, 30.0, 2),   # 32 >= 30: no gain
    (4.0, 1.0, 2.5, 0),     # nothing accepted: 3.5 < 4, a gain on paper (the verdict needs drafts)
])
def test_the_controller_and_the_verdict_use_one_formula(t, o, v, r):
    from echospec.services.common.economics import SpecCounters, gain_condition
    ok, lhs, rhs = gain_condition(r, v, o, t)
    # the verdict over a generation whose every round verified K = r drafts, all accepted
    c = SpecCounters()
    for _ in range(5):
        c.add_round(k=max(r, 1), accepted=r, v_ms=v, wall_ms=v + o, t_ms=t)
    assert c.gain()[0] == ok, c.gain()[1]
    # the controller, certain of acceptance (p = 1: E(K) = K) with V(K) measured at v for K = r
    cm = CostModel()
    cm.observe(0, t, t + o, t)
    cm.observe(r, v, v + o, t)
    cm.overhead_ms = o
    if r >= 1:
        assert (best_k(1.0, r, cm, hop=False) == r) == ok
    assert lhs == pytest.approx(v + o) and rhs == pytest.approx((r + 1) * t)


def test_k_choice_names_the_numbers_of_the_gain_condition():
    # A mixture-of-experts verify: V(K) grows with the union of the experts its rows choose
    # (measured, not the linear prior), so K = 1 pays at high acceptance and K = 4 does not.
    c = cost(t=20.0, slope=0.05)
    for _ in range(50):
        c.observe(1, 24.0, 24.5, 20.0)      # V(1) = 1.2 T
        c.observe(4, 70.0, 70.5, 20.0)      # V(4) = 3.5 T
    ctl = SpecController(k=4, cost=c)
    ctl.acc[0] = (50.0, 1.0)                # p about 0.96
    draft = ctl.on_proposal([1, 2, 3, 4], k_cap=4)
    assert 1 <= len(draft) < 4
    assert ctl.k_choice.startswith(f"K={len(draft)} of 4: p=0.9")
    assert "V(K)/T=" in ctl.k_choice and "T=20.0 ms" in ctl.k_choice
    # low acceptance: off, with the acceptance K = 1 would need
    ctl2 = SpecController(k=4, cost=c)
    ctl2.acc[0] = (0.0, 30.0)
    assert ctl2.on_proposal([1, 2, 3, 4], k_cap=4) == []
    assert ctl2.k_choice.startswith("K=0 of 4: no K pays at p=0.03")
    # (V(1) + o) / T - 1 = (24 + 0.5) / 20 - 1
    assert "an acceptance above 0.22" in ctl2.k_choice   # 0.225 in float


def test_k_choice_is_renewed_only_when_the_choice_changes():
    c = cost(t=5.0, slope=0.05)
    ctl = SpecController(k=4, cost=c)
    ctl.acc[0] = (40.0, 1.0)
    ctl.on_proposal([1, 2, 3, 4], k_cap=4)
    first = ctl.k_choice
    c.observe(0, 5.2, 5.7, 5.2)             # T drifts a little: the same choice, the same words
    ctl.on_proposal([1, 2, 3, 4], k_cap=4)
    assert ctl.k_choice == first
    ctl.on_proposal([1, 2], k_cap=2)        # fewer drafts at hand: a new choice
    assert ctl.k_choice.startswith("K=2 of 2")


def test_k_choice_is_kept_while_only_the_drafts_at_hand_shrink():
    """A cache that shrinks round by round under the same choice keeps the words of that choice."""
    c = cost(t=5.0, slope=0.3)
    ctl = SpecController(k=16, cost=c)
    ctl.acc[0] = (8.0, 2.0)
    k16 = len(ctl.on_proposal(list(range(1, 17)), k_cap=16))
    first = ctl.k_choice
    assert 0 < k16 < 12 and first.startswith(f"K={k16} of 16")
    assert len(ctl.on_proposal(list(range(1, 13)), k_cap=12)) == k16
    assert ctl.k_choice == first


def test_a_stale_dear_v_below_a_larger_k_does_not_hold_the_choice_down():
    """V(1) measured once at 6.2 ms (a cold thread pool) and never again, V(2) since at 2.5 ms,
    below T: a verify of more drafts never costs less, so V(1) is taken as 2.5 and the fitted
    slope is that of the figures that stand (here none above T: V(16) estimated at T, so a long
    draft is tried and measured instead of K = 2 forever)."""
    c = cost(t=2.7, slope=0.12, overhead=0.1)
    c.observe(1, 6.2, 6.3, 2.7)
    c.observe(2, 2.5, 2.6, 2.7)
    assert c.v_est(1) == pytest.approx(2.5) and c.v_est(2) == pytest.approx(2.5)
    assert c.slope() == 0.0 and c.v_est(16) == pytest.approx(2.7)
    assert c.v_table(3) == pytest.approx([2.7, 2.5, 2.5, 2.7])
    assert best_k(0.9, 16, c, hop=False) == 16
    c.observe(16, 9.0, 9.1, 2.7)     # measured: dearer than V(1) and V(2), which stand
    assert c.v_est(16) == pytest.approx(9.0) and c.v_est(1) == pytest.approx(2.5)
