"""The numpy reference (tests/reference.py) on the qwen3moe / qwen3vl / qwen3vlmoe fixtures.

The fixtures in tests/data/models were made by scripts/make_fixtures.py the way real files are made:
transformers' tiny random models, llama.cpp's converter, llama.cpp's quantizer. Beside each GGUF,
a .ref.npz holds transformers' float32 logits for three prompts, computed on the GGUF's own
dequantized weights (so the two sides share every weight; only the arithmetic differs): the top
TOPK ids and logits and a fixed random subset of vocabulary ids at every position, and the full
row at the first prompt's last position (tests/data/models/README.md).

Bound: float64 reference against float32 transformers. Observed max |difference| is about 4e-5
logit units on logits with std 2-3; BOUND is 1e-3, still a hundred times below the difference a
wrong rule makes (a wrong expert, weight or RoPE component moves logits by O(1)).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from reference import Reference, mrope_component, rope, rope_multi, route_experts

MODELS = Path(__file__).resolve().parent / "data" / "models"
FIXTURES = ["qwen3moe-Q4_K_M", "qwen3vl-Q8_0", "qwen3vlmoe-Q8_0"]
BOUND = 1e-3


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    name = request.param
    R = Reference(MODELS / f"{name}.gguf", dtype=np.float64, act_quant=False, kv_f16=False)
    return name, R, np.load(MODELS / f"{name}.ref.npz")


def _prompts(z):
    i = 0
    while f"p{i}_tokens" in z:
        yield i, [int(t) for t in z[f"p{i}_tokens"]]
        i += 1


def test_logits_match_transformers(fixture):
    name, R, z = fixture
    subset = z["subset"]
    n_checked = 0
    for i, toks in _prompts(z):
        L = R.logits(toks)
        top_ids, top = z[f"p{i}_top_ids"], z[f"p{i}_top_logits"]
        err = max(float(np.abs(np.take_along_axis(L, top_ids, axis=-1) - top).max()),
                  float(np.abs(L[:, subset] - z[f"p{i}_subset_logits"]).max()),
                  float(np.abs(L[-1] - z[f"p{i}_last_logits"]).max()) if f"p{i}_last_logits" in z else 0.0)
        assert err < BOUND, f"{name} prompt {i}: max |reference - transformers| = {err:.2e}"
        # argmax: equal wherever transformers' top-2 margin exceeds the bound
        margin = top[:, 0] - top[:, 1]
        sure = margin > BOUND
        assert np.array_equal(L.argmax(-1)[sure], top_ids[sure, 0]), f"{name} prompt {i}: argmax differs"
        n_checked += int(sure.sum())
    assert n_checked >= 30


def test_fixture_keys(fixture):
    name, R, _ = fixture
    hp = R.hp
    assert hp.arch == name.split("-")[0]
    assert hp.rope_neox
    if hp.arch in ("qwen3moe", "qwen3vlmoe"):
        assert hp.n_expert == 8 and hp.n_ff_exp == 256
        assert hp.n_expert_used == (4 if hp.arch == "qwen3moe" else 2)
        t = R.tensors
        assert [int(s) for s in t["blk.0.ffn_gate_exps.weight"].shape] == [hp.n_embd, hp.n_ff_exp, hp.n_expert]
        assert [int(s) for s in t["blk.0.ffn_up_exps.weight"].shape] == [hp.n_embd, hp.n_ff_exp, hp.n_expert]
        assert [int(s) for s in t["blk.0.ffn_down_exps.weight"].shape] == [hp.n_ff_exp, hp.n_embd, hp.n_expert]
        assert [int(s) for s in t["blk.0.ffn_gate_inp.weight"].shape] == [hp.n_embd, hp.n_expert]
        assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    if hp.arch == "qwen3moe":
        assert not hp.tied and hp.rope_sections is None
        # Q4_K_M: the experts come in K-quant types
        types = {R.tensors[f"blk.{il}.{n}.weight"].tensor_type.name
                 for il in range(hp.n_layer) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        assert types <= {"Q4_K", "Q6_K"} and "Q4_K" in types
    else:
        assert hp.tied and hp.rope_sections == (12, 10, 10, 0) and hp.n_deepstack == 1
        assert sum(hp.rope_sections) == hp.head_dim // 2


@pytest.mark.parametrize("name", [f for f in FIXTURES if "moe" in f])
def test_experts_are_really_used(name):
    """Every expert is chosen somewhere in the prompts, and the routing differs between tokens."""
    R = Reference(MODELS / f"{name}.gguf", dtype=np.float64, act_quant=False, kv_f16=False)
    z = np.load(MODELS / f"{name}.ref.npz")
    assert R.hp.n_expert
    seen = set()
    for _, toks in _prompts(z):
        R.logits(toks)
        for ids, w in R.last_routing.values():
            seen |= set(ids.reshape(-1).tolist())
            np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
            assert (np.diff(w, axis=-1) <= 0).all()    # best first
    assert seen == set(range(R.hp.n_expert))


def test_route_experts_ties_and_normalisation():
    logits = np.log(np.array([[1.0, 3.0, 3.0, 2.0, 3.0],
                              [5.0, 1.0, 1.0, 1.0, 1.0]]))
    ids, w = route_experts(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]        # ties: the lower index first
    np.testing.assert_allclose(w, [[1 / 3] * 3, [5 / 7, 1 / 7, 1 / 7]])
    ids, w = route_experts(logits, 2, normalize=False)
    np.testing.assert_allclose(w, [[0.25, 0.25], [5 / 9, 1 / 9]])


def test_mrope_layout_and_text_positions():
    # Qwen3-VL's sections [24, 20, 20, 0] for head_dim 128: h at pairs 1, 4, .., 58; w at 2, 5, .., 59
    # (61 and 62 are left over: ggml's component e, which is t for text and for 3-column positions)
    comp = mrope_component(128, [24, 20, 20, 0])
    assert (comp[1:60:3] == 1).all() and (comp[2:60:3] == 2).all() and (comp[0:60:3] == 0).all()
    assert comp[60:].tolist() == [0, 3, 3, 0] and np.bincount(comp, minlength=4).tolist() == [22, 20, 20, 2]
    # text tokens (t = h = w) give plain NEOX RoPE, exactly
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 2, 64))
    pos = np.arange(5, 14)
    thw = np.repeat(pos[:, None], 3, axis=1)
    np.testing.assert_array_equal(rope_multi(x, thw, 5e6, 64, [12, 10, 10, 0]), rope(x, pos, 5e6, 64, True))


@pytest.mark.parametrize("name", ["qwen3vl-Q8_0", "qwen3vlmoe-Q8_0"])
def test_mrope_matches_transformers_angles(name):
    """transformers' cos/sin for distinct (t, h, w) positions, saved by make_fixtures.py."""
    z = np.load(MODELS / f"{name}.ref.npz")
    thw, cos_ref, sin_ref = z["rope_thw"].T, z["rope_cos_thw"], z["rope_sin_thw"]   # [n, 3], [n, head_dim]
    n, hd = cos_ref.shape
    x = np.zeros((n, 1, hd))
    x[..., : hd // 2] = 1.0                   # rotating (1, 0) pairs gives (cos, sin)
    y = rope_multi(x, thw, 5e6, hd, [12, 10, 10, 0])[:, 0]
    np.testing.assert_allclose(y[:, : hd // 2], cos_ref[:, : hd // 2], atol=2e-6)
    np.testing.assert_allclose(y[:, hd // 2:], sin_ref[:, : hd // 2], atol=2e-6)
    assert float(z["rope_text_vs_neox_max"]) < 1e-6


def test_mrope_positions_change_the_logits():
    """The reference really reads (t, h, w): image-like positions differ from text positions."""
    R = Reference(MODELS / "qwen3vl-Q8_0.gguf", kv_f16=False)
    toks = [504, 2365, 6354, 16438]
    base = R.logits(toks)
    thw = np.stack([np.arange(4), np.arange(4), np.arange(4)], axis=1)
    np.testing.assert_array_equal(R.forward(toks, pos_thw=thw), base)
    thw[2:, 1] += 3                           # h only
    assert np.abs(R.forward(toks, pos_thw=thw)[2:] - base[2:]).max() > 1e-3
