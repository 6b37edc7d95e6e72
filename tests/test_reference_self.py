"""Checks of the numpy reference (tests/reference.py) and the GGUF writer (tests/ggufgen.py) themselves.

They run without the engine. The engine tests trust these two files, so each
rule they rely on has its own case here: the K-quant byte layout against the
gguf package's dequantizer, RoPE on known vectors, softmax, the causal mask,
the KV cache, GQA head grouping (against a slow per-head loop), activation
quantization, and one real-model check (SmolLM2 answers a question sensibly),
which is what catches a wrong RoPE pair layout.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import ggufgen
from conftest import chatml
from reference import Reference, align_rounding, quantize_activations_q8, rms_norm, rope, silu, softmax


# ---- the writer ----------------------------------------------------------------

@pytest.mark.parametrize("type_name", ggufgen.K_TYPES)
def test_k_quant_blocks_match_gguf_dequantize(type_name):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    raw, expected = ggufgen.quantize_k(x, type_name)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert deq.shape == x.shape
    # Our packing of the integers equals the package's unpacking, bit for bit.
    np.testing.assert_array_equal(deq, expected)
    # And the quantizer is a real one: errors stay within a fraction of the range.
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[type_name]
    assert np.abs(deq - x).max() < 2 * np.abs(x).max() / (2 ** bits - 1)


@pytest.mark.parametrize("type_name", ggufgen.ALL_TYPES)
def test_writer_types_shapes_and_metadata(tiny_spec, type_name):
    kw = ggufgen.k_type_dims(head_dim=128) if type_name in ggufgen.K_TYPES else dict(head_dim=32)
    spec = tiny_spec(arch="qwen3", matrix_type=type_name, embd_type="Q8_0", tied=False, **kw)
    r = gguf.GGUFReader(spec.path)
    f = lambda k: r.fields[k].contents()  # noqa: E731
    assert f("general.architecture") == "qwen3"
    assert f("qwen3.block_count") == spec.n_layer
    assert f("qwen3.embedding_length") == spec.n_embd
    assert f("qwen3.feed_forward_length") == spec.n_ff
    assert f("qwen3.attention.head_count") == spec.n_head
    assert f("qwen3.attention.head_count_kv") == spec.n_head_kv
    assert f("qwen3.attention.key_length") == spec.head_dim != spec.n_embd // spec.n_head
    assert f("qwen3.attention.value_length") == spec.head_dim
    assert f("qwen3.rope.dimension_count") == spec.head_dim
    assert f("qwen3.rope.freq_base") == pytest.approx(spec.rope_base)
    assert f("qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(spec.norm_eps)
    assert f("qwen3.context_length") == spec.n_ctx_train
    assert f("tokenizer.ggml.model") == "gpt2"
    assert len(f("tokenizer.ggml.tokens")) == spec.n_vocab
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == list(ggufgen.tensor_names("qwen3", spec.n_layer, tied=False))
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type.name == type_name
    assert [int(s) for s in q.shape] == [spec.n_embd, spec.n_head * spec.head_dim]  # ne = [n_in, n_out]
    assert [int(s) for s in tensors["blk.1.ffn_down.weight"].shape] == [spec.n_ff, spec.n_embd]
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type.name == "F32"


def test_writer_is_deterministic_in_seed(tmp_path):
    a = ggufgen.write_tiny_model(tmp_path / "a.gguf", seed=3).path
    b = ggufgen.write_tiny_model(tmp_path / "b.gguf", seed=3).path
    c = ggufgen.write_tiny_model(tmp_path / "c.gguf", seed=4).path
    read = lambda p: open(p, "rb").read()  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        ggufgen.write_tiny_model(tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="type"):
        ggufgen.write_tiny_model(tmp_path / "x.gguf", matrix_type="Q3_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        ggufgen.write_tiny_model(tmp_path / "x.gguf", matrix_type="Q4_K")  # n_embd 64
    with pytest.raises(ValueError, match="n_vocab"):
        ggufgen.write_tiny_model(tmp_path / "x.gguf", n_vocab=256)


# ---- building blocks -------------------------------------------------------------

def test_rope_rotates_known_vectors():
    d, base = 8, 10000.0
    theta = base ** (-2.0 * np.arange(d // 2) / d)
    pos = np.array([0, 3])
    x = np.zeros((2, 1, d))
    x[:, 0, 0] = 1.0          # llama: partner of element 0 is element 1
    y = rope(x, pos, base, d, neox=False)
    np.testing.assert_allclose(y[0, 0], x[0, 0])                       # position 0: identity
    np.testing.assert_allclose(y[1, 0, :2], [np.cos(3 * theta[0]), np.sin(3 * theta[0])])
    np.testing.assert_allclose(y[1, 0, 2:], 0.0)
    x = np.zeros((2, 1, d))
    x[:, 0, 1] = 1.0          # neox: partner of element 1 is element 1 + d/2 = 5
    y = rope(x, pos, base, d, neox=True)
    np.testing.assert_allclose(y[1, 0, [1, 5]], [np.cos(3 * theta[1]), np.sin(3 * theta[1])])
    np.testing.assert_allclose(np.delete(y[1, 0], [1, 5]), 0.0)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_keeps_norms_and_depends_on_relative_position(neox):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 16))
    dots = []
    for m in (5, 9, 40):
        rq = rope(q, np.array([m]), 1e4, 16, neox)
        rk = rope(k, np.array([m - 4]), 1e4, 16, neox)
        np.testing.assert_allclose(np.linalg.norm(rq), np.linalg.norm(q))
        dots.append(float(np.sum(rq * rk)))
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


def test_partial_rope_leaves_tail_dims():
    x = np.arange(1, 17, dtype=np.float64).reshape(1, 1, 16)
    for neox in (False, True):
        y = rope(x, np.array([7]), 1e4, 8, neox)
        np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
        assert not np.allclose(y[..., :8], x[..., :8])


def test_softmax_rows_sum_to_one_and_mask():
    rng = np.random.default_rng(2)
    s = rng.standard_normal((5, 7)) * 30
    s[:, 4:] = -np.inf
    p = softmax(s)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0)
    assert np.all(p[:, 4:] == 0)
    np.testing.assert_allclose(softmax(np.array([0.0, np.log(3.0)])), [0.25, 0.75])


def test_rms_norm_and_silu_values():
    np.testing.assert_allclose(rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), 0.0),
                               np.array([3.0, 8.0]) / np.sqrt(12.5))
    np.testing.assert_allclose(silu(np.array([0.0, 1.0])), [0.0, 1.0 / (1.0 + np.exp(-1.0))])


def test_activation_quantization_rounds_half_to_even():
    x = np.zeros(32, dtype=np.float32)
    x[:6] = [127.0, 0.5, 1.5, 2.5, -0.5, -3.25]      # d = 1, id = 1
    y = quantize_activations_q8(x)
    np.testing.assert_array_equal(y[:6], [127.0, 0.0, 2.0, 2.0, -0.0, -3.0])
    z = quantize_activations_q8(np.zeros(64, dtype=np.float32))   # d == 0 gives zeros, no NaN
    assert np.all(z == 0)
    r = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    yr = quantize_activations_q8(r)
    for b in range(2):  # error at most half a step of each block
        blk = r[b * 32:(b + 1) * 32]
        assert np.abs(yr[b * 32:(b + 1) * 32] - blk).max() <= np.abs(blk).max() / 127 / 2 * 1.0001


# ---- the forward pass -------------------------------------------------------------

def _naive_forward(R: Reference, tokens):
    """Slow, loop-per-token-and-head forward in float64, written apart from Reference.forward.

    RoPE is done with complex numbers, attention per head with explicit kv-head
    index h // (n_head / n_head_kv), the causal mask by slicing.
    """
    hp = R.hp
    W = R.weight
    x = np.stack([W("token_embd.weight")[t] for t in tokens]).astype(np.float64)
    n = len(tokens)
    half = hp.rope_dim // 2
    inv = hp.rope_base ** (-np.arange(half) * 2.0 / hp.rope_dim)

    def rot(v, p):
        v = v.copy()
        if hp.rope_neox:
            c = (v[:half] + 1j * v[half:hp.rope_dim]) * np.exp(1j * p * inv)
            v[:half], v[half:hp.rope_dim] = c.real, c.imag
        else:
            c = (v[0:hp.rope_dim:2] + 1j * v[1:hp.rope_dim:2]) * np.exp(1j * p * inv)
            v[0:hp.rope_dim:2], v[1:hp.rope_dim:2] = c.real, c.imag
        return v

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v) + hp.norm_eps) * w

    for il in range(hp.n_layer):
        p = f"blk.{il}."
        Q = np.zeros((n, hp.n_head, hp.head_dim))
        K = np.zeros((n, hp.n_head_kv, hp.head_dim))
        V = np.zeros((n, hp.n_head_kv, hp.head_dim))
        for t in range(n):
            h = norm(x[t], W(p + "attn_norm.weight"))
            q = W(p + "attn_q.weight") @ h
            k = W(p + "attn_k.weight") @ h
            v = W(p + "attn_v.weight") @ h
            if R.has(p + "attn_q.bias"):
                q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
            for hh in range(hp.n_head):
                qh = q[hh * hp.head_dim:(hh + 1) * hp.head_dim]
                if R.has(p + "attn_q_norm.weight"):
                    qh = norm(qh, W(p + "attn_q_norm.weight"))
                Q[t, hh] = rot(qh, t)
            for hh in range(hp.n_head_kv):
                kh = k[hh * hp.head_dim:(hh + 1) * hp.head_dim]
                if R.has(p + "attn_k_norm.weight"):
                    kh = norm(kh, W(p + "attn_k_norm.weight"))
                K[t, hh] = rot(kh, t)
                V[t, hh] = v[hh * hp.head_dim:(hh + 1) * hp.head_dim]
        att = np.zeros((n, hp.n_head * hp.head_dim))
        for t in range(n):
            for hh in range(hp.n_head):
                kv = hh // (hp.n_head // hp.n_head_kv)
                s = np.array([Q[t, hh] @ K[j, kv] for j in range(t + 1)]) / np.sqrt(hp.head_dim)
                pr = np.exp(s - s.max())
                pr /= pr.sum()
                att[t, hh * hp.head_dim:(hh + 1) * hp.head_dim] = sum(pr[j] * V[j, kv] for j in range(t + 1))
        for t in range(n):
            x[t] = x[t] + W(p + "attn_output.weight") @ att[t]
            h = norm(x[t], W(p + "ffn_norm.weight"))
            g, u = W(p + "ffn_gate.weight") @ h, W(p + "ffn_up.weight") @ h
            x[t] = x[t] + W(p + "ffn_down.weight") @ (g / (1 + np.exp(-g)) * u)
    out = W("token_embd.weight") if hp.tied else W("output.weight")
    return np.stack([out @ norm(x[t], W("output_norm.weight")) for t in range(n)])


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("qwen2", {"tied": False}),
    ("qwen3", {"head_dim": 32}),
    ("llama", {"n_head": 8, "n_head_kv": 2, "n_embd": 64}),
])
def test_forward_matches_naive_loop(tiny_model, arch, kw):
    R = Reference(tiny_model(arch=arch, matrix_type="F32", **kw), kv_f16=False)   # the naive loop keeps K, V float
    toks = [5, 77, 3, 200, 41, 9]
    np.testing.assert_allclose(R.forward(toks), _naive_forward(R, toks), rtol=0, atol=1e-9)


@pytest.mark.parametrize("arch", ggufgen.ARCHS)
def test_causal_later_tokens_do_not_change_earlier_logits(tiny_model, arch):
    R = Reference(tiny_model(arch=arch, matrix_type="Q8_0"), act_quant=True)
    a = R.forward([10, 11, 12, 13, 14, 15])
    b = R.forward([10, 11, 12, 99, 98, 97])
    np.testing.assert_array_equal(a[:3], b[:3])
    assert not np.allclose(a[3:], b[3:])


@pytest.mark.parametrize("arch", ggufgen.ARCHS)
def test_kv_cache_pieces_equal_one_call(tiny_model, arch):
    R = Reference(tiny_model(arch=arch, matrix_type="F16"))
    toks = [3, 50, 100, 150, 200, 250, 300, 7]
    full = R.forward(toks)
    c = R.new_cache()
    parts = [R.forward(toks[:3], c), R.forward(toks[3:4], c), R.forward(toks[4:], c)]
    assert c.n_past == len(toks)
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-10)


def test_tiny_model_is_deterministic_and_logits_are_o1(tiny_model):
    path = tiny_model(arch="qwen2", matrix_type="Q4_1")
    a = Reference(path).forward([1, 2, 3, 4])
    b = Reference(path).forward([1, 2, 3, 4])
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(a))
    assert 0.3 < a.std() < 10       # activations stay O(1): tolerances scale with this


def test_act_quant_changes_only_quantized_matmuls(tiny_model):
    toks = [4, 8, 15, 16, 23, 42]
    f = tiny_model(arch="llama", matrix_type="BF16")
    np.testing.assert_array_equal(Reference(f).forward(toks), Reference(f, act_quant=True).forward(toks))
    q = tiny_model(arch="llama", matrix_type="Q5_0")
    d = Reference(q).forward(toks) - Reference(q, act_quant=True).forward(toks)
    assert 0 < np.abs(d).max() < 0.5


def test_align_rounding_finds_an_inverted_rounding_and_nothing_else(tiny_model):
    """align_rounding recovers logits made with one inverted rounding, and cannot absorb any other error."""
    R = Reference(tiny_model(arch="qwen2", matrix_type="Q8_0", tied=False), act_quant=True)
    toks = [9, 8, 7, 6, 5, 4]
    R.near_half_threshold = 0.05
    plain = R.forward(toks)
    cand = min(c for c in R.near_half if c[2] == 2 and c[1][1] == "ffn_in")
    R.near_half_threshold = None
    R.flips = {cand[1]: {(cand[2], cand[3])}}
    target = R.forward(toks)
    R.flips = {}
    tol = 1e-9
    assert np.abs(target - plain).max() > 1e-4            # the flip matters...
    assert np.array_equal(target[:2], plain[:2])          # ...only from its own row on (causal)
    got, flips = align_rounding(R, toks, target, tol, near=0.05)
    assert [f[1:] for f in flips] == [cand[1:]]
    assert np.abs(got - target).max() <= tol
    assert R.flips == {} and R.near_half_threshold is None
    bumped = plain.copy()
    bumped[3, 17] += 0.01                                  # an error no rounding explains
    got, _ = align_rounding(R, toks, bumped, 1e-3, near=0.05)
    assert np.abs(got - bumped).max() > 1e-3


def test_greedy_follows_argmax_and_reports_margins(tiny_model):
    R = Reference(tiny_model(arch="qwen3", matrix_type="F32"))
    g = R.greedy([1, 2, 3], 5)
    toks = [1, 2, 3]
    for i in range(5):
        row = R.forward(toks)[-1]
        assert g.tokens[i] == int(np.argmax(row))
        s = np.sort(row)
        assert g.margins[i] == pytest.approx(s[-1] - s[-2], abs=1e-9)
        toks.append(g.tokens[i])


def test_reference_rejects_bad_tokens(tiny_model):
    R = Reference(tiny_model())
    with pytest.raises(ValueError):
        R.forward([R.hp.n_vocab])
    with pytest.raises(ValueError):
        R.forward([])


# ---- the real model -----------------------------------------------------------------

def test_reference_smollm2_answers_sensibly(smollm2_reference, smollm2_tokenizer):
    """The real-model check: a wrong RoPE layout or head grouping gives fluent-looking garbage here."""
    R = smollm2_reference
    assert (R.hp.arch, R.hp.n_layer, R.hp.n_head, R.hp.n_head_kv, R.hp.head_dim, R.hp.n_vocab) == \
        ("llama", 30, 9, 3, 64, 49152)
    # (Without "Answer in one sentence." the first token is a near-tie between "The" and "L".)
    ids = smollm2_tokenizer.encode(chatml("What is the capital of France? Answer in one sentence."))
    g = R.greedy(ids, 8)
    text = smollm2_tokenizer.decode(g.tokens)
    assert "Paris" in text, text


def test_kv_f16_rounds_the_cache_and_moves_logits_a_little(tiny_model):
    """kv_f16 (the default, as the engine's cache) stores float16 values; the logits move, by far less than O(1)."""
    path = tiny_model(arch="llama", matrix_type="F32")
    toks = [3, 50, 100, 150, 200, 7]
    R16, R32 = Reference(path), Reference(path, kv_f16=False)
    c16, c32 = R16.new_cache(), R32.new_cache()
    a, b = R16.forward(toks, c16), R32.forward(toks, c32)
    for arr in (c16.k[0], c16.v[0]):
        np.testing.assert_array_equal(arr, arr.astype(np.float16).astype(arr.dtype))
    assert not np.array_equal(c32.k[0], c32.k[0].astype(np.float16).astype(c32.k[0].dtype))
    assert 0 < np.abs(a - b).max() < 1e-2 * b.std()
