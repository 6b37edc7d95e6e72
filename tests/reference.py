"""A plain numpy forward pass over a GGUF file: the reference the C engine is checked against.

Independent of engine_c: the file is read with gguf.GGUFReader and every
weight is dequantized with gguf.quants.dequantize (the `gguf` package's own
decoders). Each weight matrix is dequantized once and kept as a float array
(SmolLM2-135M: about 0.55 GB in float32, 1.1 GB in float64).

Arithmetic: float64 by default (dtype=np.float64), so the reference is closer
to exact than the engine (float32) and the tolerances in the tests measure the
engine's error, not ours. float32 is available for speed.

act_quant=True emulates the engine's activation quantization before every
matmul whose weight is a quantized (block) type: per block of 32 activations
(per super-block of 256 for the K types Q4_K, Q5_K, Q6_K),
    d = max|x| / 127,  id = 1 / d (0 when d == 0),  q = rint(x * id),  x' = q * d
computed in float32 (rint: round half to even), once per stage input (the
q/k/v input, the attention output, the FFN input, the down-projection input,
the output-norm output) and activation block size. The engine does this (as
llama.cpp does with q8_0 activations, and q8_K ones for the K types).
Without it the reference and the engine part by about 5% of the logit std
on tiny models; with it by about 1e-6 of the logit std, so the tolerances
can be tight enough to catch a subtly wrong kernel.
F32, F16 and BF16 weights multiply the float activations unchanged.

Rounding boundaries: when x * id lies within about 1e-5 of k + 1/2, the
engine's float32 activations (a few ulps away from ours) may round it the other
way. One such flip moves the logits by up to a few % of their std. Such
elements are rare but do occur (about one 10-token tiny-model forward in 30).
`align_rounding` finds them: it inverts, one at a time, roundings that lie
within `near` of a boundary until the reference meets the other
implementation's logits within the tight tolerance, and reports the flips it
needed, so a test stays tight and still says exactly what it allowed.
The float16 KV cache (kv_f16) has the same kind of boundary: a key or value
within a few float32 ulps (NEAR_F16) of the midpoint of two float16 neighbours; those are
candidates for align_rounding too (stage keys (layer, "k_f16" | "v_f16")).
On a 30-layer real model (SmolLM2) flips happen in every token and add up:
two correct float32 / float64 implementations of the same int8 scheme then
differ by ~0.2 rms / ~0.9 max logit units, and no reference can be tighter
than that (see tests/test_engine_smollm2.py for the measured figures).

Model semantics:
  x = token_embd[tokens]
  per layer:  h = RMSNorm(x) * attn_norm
              q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)       (biases: qwen2)
              q, k = RMSNorm per head (* q_norm / k_norm)               (qwen3)
              q, k = RoPE(q, k, pos)   llama: pairs (2i, 2i+1); qwen2/3: pairs (i, i + rope_dim/2);
                                       theta_i = base^(-2i / rope_dim), angle = pos * theta_i
              k, v = float16(k), float16(v)   the KV cache's type (kv_f16=True, the default)
              a = softmax(q k^T / sqrt(head_dim) + causal mask) v      (GQA: head h uses kv head h // (n_head / n_head_kv))
                  KV eviction (kv_window W > 0, kv_sinks S): the query at p also masks every key
                  j with S <= j <= p - W: it attends [0, S) U (p - W, p] (absolute positions)
                  sparse attention (sparse_topk K > 0, a call of <= 8 tokens past K + 3 blocks): every
                  query of the call also masks the keys outside the blocks chosen per KV head
                  (the class's docstring)
              x = x + a Wo^T
              h = RMSNorm(x) * ffn_norm
              x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
  logits = (RMSNorm(x) * output_norm) Wout^T       (Wout = token_embd when output.weight is absent)

Mixture of experts (qwen3moe, qwen3vlmoe; keys expert_count E, expert_used_count k,
expert_feed_forward_length): the feed-forward is replaced by
              p = softmax(h Wr^T)                  Wr = ffn_gate_inp [E, n_embd] (F32 in llama.cpp's files)
              top = the k largest p (ties: the lower expert index first)
              w = p[top] / sum(p[top])             (norm_topk_prob; qwen3moe files carry no key for it:
                                                     llama.cpp always renormalises for these architectures)
              x = x + sum_j w_j (silu(h Wg_e^T) * (h Wu_e^T)) Wd_e^T      e = top[j]; ffn_{gate,up,down}_exps[e]

Multimodal RoPE (qwen3vl, qwen3vlmoe; key rope.dimension_sections [s_t, s_h, s_w, s_e], in rotation
pairs, summing to head_dim / 2): every token has positions (t, h, w) (and e, 0 for text); pair i of the
NEOX layout rotates by pos_c * theta_i where the component c is chosen interleaved (llama.cpp's IMROPE,
transformers' apply_interleaved_mrope):
              c = h if i % 3 == 1 and i < 3 s_h;  w if i % 3 == 2 and i < 3 s_w;  t if i % 3 == 0 and i < 3 s_t;
                  else e
(the pairs left over, e.g. 61 and 62 of [24, 20, 20, 0], take e in ggml; transformers gives them t.
llama.cpp sets e = t = h = w for text tokens; given (t, h, w) only, the reference takes e = t, as
transformers does.) A text token at position n has t = h = w = n, which makes it plain NEOX RoPE.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe")
NEOX_ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe")
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16, QT.F64)
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)   # activations quantized per 256 (the engine's es_q8k_block)
NEAR_F16 = 4 * 2.0 ** -13   # float16 ulps: four float32 ulps from a float16 midpoint (see align_rounding)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * w. Shapes: x [..., n], w [n]."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (rows sum to 1; -inf entries get 0)."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope(x: np.ndarray, pos: np.ndarray, base: float, rope_dim: int, neox: bool) -> np.ndarray:
    """Rotate the first rope_dim dims of every head.

    Args:
        x: [n_tokens, n_heads, head_dim]
        pos: int [n_tokens] absolute positions
        base: freq_base (theta); theta_i = base^(-2i / rope_dim), i in [0, rope_dim/2)
        neox: False -> pairs (2i, 2i+1) (llama); True -> pairs (i, i + rope_dim/2) (qwen2/3)
    Returns:
        rotated copy, same shape and dtype. Dims >= rope_dim are passed through.
    """
    half = rope_dim // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / rope_dim)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]          # [n_tokens, half]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)
    sin = np.sin(ang)[:, None, :].astype(x.dtype)
    out = x.copy()
    if neox:
        x0, x1 = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:rope_dim] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
        out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    return out


def mrope_component(rope_dim: int, sections: Sequence[int]) -> np.ndarray:
    """Which position component (0 t, 1 h, 2 w, 3 e) rotates each pair i in [0, rope_dim/2) (interleaved)."""
    s = list(sections) + [0] * (4 - len(sections))
    n_sect = sum(s)
    comp = np.empty(rope_dim // 2, dtype=np.int64)
    for i in range(rope_dim // 2):
        sec = i % n_sect if n_sect else i
        if sec % 3 == 1 and sec < 3 * s[1]:
            comp[i] = 1
        elif sec % 3 == 2 and sec < 3 * s[2]:
            comp[i] = 2
        elif sec % 3 == 0 and sec < 3 * s[0]:
            comp[i] = 0
        else:
            comp[i] = 3
    return comp


def rope_multi(x: np.ndarray, pos: np.ndarray, base: float, rope_dim: int, sections: Sequence[int]) -> np.ndarray:
    """Interleaved multimodal RoPE (NEOX pairs (i, i + rope_dim/2)) of Qwen3-VL.

    Args:
        x: [n_tokens, n_heads, head_dim]
        pos: int [n_tokens, 3] (t, h, w; e = t) or [n_tokens, 4] (t, h, w, e) positions per token
        sections: [s_t, s_h, s_w(, s_e)] in rotation pairs (rope.dimension_sections)
    Returns:
        rotated copy, same shape and dtype.
    """
    pos = np.asarray(pos, dtype=np.float64)
    if pos.ndim != 2 or pos.shape[1] not in (3, 4):
        raise ValueError("pos must be [n_tokens, 3] or [n_tokens, 4]")
    if pos.shape[1] == 3:
        pos = np.concatenate([pos, pos[:, :1]], axis=1)
    half = rope_dim // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / rope_dim)
    comp = mrope_component(rope_dim, sections)
    ang = pos[:, comp] * inv[None, :]                                 # [n_tokens, half]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)
    sin = np.sin(ang)[:, None, :].astype(x.dtype)
    out = x.copy()
    x0, x1 = x[..., :half], x[..., half:rope_dim]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:rope_dim] = x0 * sin + x1 * cos
    return out


def route_experts(router_logits: np.ndarray, k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of Qwen3-MoE.

    Args:
        router_logits: [n_tokens, n_expert] (h Wr^T)
        k: experts per token (expert_used_count)
        normalize: divide the k weights by their sum (norm_topk_prob)
    Returns:
        (ids [n_tokens, k] int64, best first, ties to the lower index;
         weights [n_tokens, k]: the softmax probabilities of those experts, renormalised when normalize)
    """
    p = softmax(router_logits, axis=-1)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / np.sum(w, axis=-1, keepdims=True)
    return ids, w


def quantize_activations_q8(x: np.ndarray, block: int = 32,
                             flip: set[tuple[int, int]] | None = None) -> np.ndarray:
    """Emulate int8 activation quantization per `block` elements of the last axis (float32 arithmetic).

    d = max|x| / 127, id = 1/d (0 if d == 0), q = rint(x * id), return q * d
    (float32 values, cast back to x.dtype). x is [n_rows, n] or [n] with n a
    multiple of block.

    flip: optional set of (row, col) elements whose rounding goes the other way
    (q = the other neighbour of x * id). Used to follow an implementation whose
    float32 activations put x * id on the other side of a rounding boundary
    (see near_half_elements).
    """
    x32 = np.asarray(x, dtype=np.float32)
    shp = x32.shape
    b = x32.reshape(-1, block)
    d = (np.max(np.abs(b), axis=1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idd = np.where(d == 0, np.float32(0), np.float32(1.0) / d).astype(np.float32)
    v = b * idd
    q = np.rint(v).astype(np.float32)
    if flip:
        v2 = v.reshape(shp[0] if x32.ndim == 2 else 1, -1)
        q2 = q.reshape(v2.shape)
        for r, c in flip:
            lo = np.floor(v2[r, c])
            q2[r, c] = lo + 1 if q2[r, c] == lo else lo
    return (q * d).reshape(shp).astype(x.dtype)


def near_half_elements(x: np.ndarray, block: int, threshold: float) -> list[tuple[float, int, int]]:
    """Elements of x [n_rows, n] whose scaled value x * id lies within `threshold` of k + 1/2.

    Returns (distance, row, col) triples. Those roundings may legitimately go
    either way in another implementation whose float32 activations differ from
    ours by a few ulps.
    """
    x32 = np.asarray(x, dtype=np.float32)
    x2 = x32.reshape(-1, x32.shape[-1])
    b = x2.reshape(-1, block)
    d = (np.max(np.abs(b), axis=1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idd = np.where(d == 0, np.float32(0), np.float32(1.0) / d).astype(np.float32)
    v = (b * idd).reshape(x2.shape).astype(np.float64)
    dist = np.abs(v - np.floor(v) - 0.5)
    rows, cols = np.nonzero(dist < threshold)
    return [(float(dist[r, c]), int(r), int(c)) for r, c in zip(rows, cols)]


def round_f16(x: np.ndarray, flip: set[tuple[int, int]] | None = None) -> np.ndarray:
    """x [n_rows, n] rounded to float16 from float32 (to nearest even), as x.dtype.

    flip: optional set of (row, col) elements rounded to the other float16
    neighbour instead (see near_f16_elements)."""
    x32 = np.asarray(x, dtype=np.float32)
    h = x32.astype(np.float16)
    if flip:
        for r, c in flip:
            up = h[r, c].astype(np.float64) <= float(x32[r, c])
            h[r, c] = np.nextafter(h[r, c], np.float16(np.inf if up else -np.inf))
    return h.astype(x.dtype)


def near_f16_elements(x: np.ndarray, threshold: float) -> list[tuple[float, int, int]]:
    """Elements of x [n_rows, n] whose float32 value lies within `threshold` float16 ulps of the
    midpoint between two float16 neighbours: (distance in ulps, row, col) triples. Another
    implementation whose float32 values differ from ours by a few float32 ulps may round those the
    other way."""
    x32 = np.asarray(x, dtype=np.float32)
    v = x32.astype(np.float64)
    h = x32.astype(np.float16)
    hf = h.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        other = np.nextafter(h, np.where(hf <= v, np.float16(np.inf), np.float16(-np.inf)).astype(np.float16))
        of = other.astype(np.float64)
        dist = np.abs(np.abs(v - hf) / np.abs(of - hf) - 0.5)
    rows, cols = np.nonzero(np.isfinite(dist) & (dist < threshold))
    return [(float(dist[r, c]), int(r), int(c)) for r, c in zip(rows, cols)]


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"GGUF key {key!r} missing")
        return default
    return f.contents()


@dataclass
class Hparams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_dim: int
    rope_neox: bool
    norm_eps: float
    n_ctx_train: int
    tied: bool
    n_expert: int = 0                   # MoE (qwen3moe, qwen3vlmoe); 0: dense SwiGLU
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = True            # renormalise the top-k weights (always, for these architectures)
    rope_sections: tuple | None = None  # qwen3vl, qwen3vlmoe: [s_t, s_h, s_w, s_e] (interleaved MRoPE)
    n_deepstack: int = 0                # qwen3vl, qwen3vlmoe: vision layers fed into the first blocks


@dataclass
class KVCache:
    """Per-layer keys and values: k[l], v[l] are [n_head_kv, n_past, head_dim]."""
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    n_past: int = 0


class Reference:
    """Numpy forward pass over a GGUF model (llama, qwen2, qwen3, qwen3moe, qwen3vl, qwen3vlmoe; text only).

    Args:
        path: GGUF file.
        dtype: compute dtype, np.float64 (default) or np.float32.
        act_quant: emulate the engine's int8 activation quantization (block 32)
            before matmuls with quantized weights (see module docstring).
        kv_f16: store keys (after RoPE) and values in the KV cache rounded to
            IEEE float16 as the engine's cache does (rounded from float32, to
            nearest even); False keeps them in the compute dtype.
        kv_sinks, kv_window: KV eviction as the engine's es_session_params (kv_window 0:
            none): every layer's query at position p attends keys [0, kv_sinks) and
            (p - kv_window, p] only. The reference keeps every key and masks the rest.
        sparse_topk: sparse attention as the engine's es_session_params (0: none): a forward
            of at most 8 tokens whose last position p is in block last = p // 64 with last + 1
            > sparse_topk + 3 attends, per layer and KV head, blocks 0, last - 1, last and the
            sparse_topk others of the largest sum over the head's query heads of
            sum_d max(q_d * min_d, q_d * max_d) (the last query; min / max of the block's cached
            keys; ties to the lower block), every query of the call the same blocks (masked
            like the future keys). ``last_sparse[layer]`` holds the last call's choice per KV
            head (empty when dense).
    Raises:
        KeyError / ValueError: a key or tensor the architecture needs is missing.
    """

    def __init__(self, path: str, dtype=np.float64, act_quant: bool = False, act_block: int = 32,
                 kv_f16: bool = True, kv_sinks: int = 0, kv_window: int = 0, sparse_topk: int = 0):
        self.path = str(path)
        self.kv_sinks, self.kv_window = kv_sinks, kv_window
        self.sparse_topk = sparse_topk
        self.last_sparse: dict[int, list[list[int]]] = {}
        self.kv_f16 = kv_f16
        self.dtype = np.dtype(dtype)
        self.act_quant = act_quant
        self.act_block = act_block
        # Rounding-boundary bookkeeping (act_quant only); see near_half_elements.
        # flips: stage key -> {(row, col)} roundings to invert; a stage key is
        # (layer, "attn_in" | "attn_out_in" | "ffn_in" | "ffn_down_in") or (-1, "output_in") (+ "_k" for the
        # K types' 256-blocks), or
        # (layer, "k_f16" | "v_f16") for the float16 KV cache (kv_f16).
        self.flips: dict[tuple[int, str], set[tuple[int, int]]] = {}
        self.near_half_threshold: float | None = None
        self.near_f16_threshold: float = NEAR_F16
        self.near_half: list[tuple[float, tuple[int, str], int, int]] = []   # filled by each forward
        # MoE: layer -> (expert ids [n, k], weights [n, k]) of the last forward's new tokens
        self.last_routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        r = gguf.GGUFReader(self.path)
        arch = _field(r, "general.architecture")
        if arch not in ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}")
        n_embd = int(_field(r, f"{arch}.embedding_length"))
        n_head = int(_field(r, f"{arch}.attention.head_count"))
        head_dim = int(_field(r, f"{arch}.attention.key_length", n_embd // n_head))
        self.tensors = {t.name: t for t in r.tensors}
        tok = self.tensors["token_embd.weight"]
        self.hp = Hparams(
            arch=arch,
            n_vocab=int(tok.shape[1]),
            n_embd=n_embd,
            n_layer=int(_field(r, f"{arch}.block_count")),
            n_head=n_head,
            n_head_kv=int(_field(r, f"{arch}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(_field(r, f"{arch}.feed_forward_length", 0)),
            rope_base=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(_field(r, f"{arch}.rope.dimension_count", head_dim)),
            rope_neox=arch in NEOX_ARCHS,
            norm_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
            n_ctx_train=int(_field(r, f"{arch}.context_length")),
            tied="output.weight" not in self.tensors,
            n_expert=int(_field(r, f"{arch}.expert_count", 0)),
            n_expert_used=int(_field(r, f"{arch}.expert_used_count", 0)),
            n_ff_exp=int(_field(r, f"{arch}.expert_feed_forward_length", 0)),
            rope_sections=(tuple(int(v) for v in _field(r, f"{arch}.rope.dimension_sections"))
                           if f"{arch}.rope.dimension_sections" in r.fields else None),
            n_deepstack=int(_field(r, f"{arch}.n_deepstack_layers", 0)),
        )
        if self.hp.n_expert and not 0 < self.hp.n_expert_used <= self.hp.n_expert:
            raise ValueError(f"expert_used_count {self.hp.n_expert_used} of {self.hp.n_expert} experts")
        self._w: dict[str, np.ndarray] = {}
        self._quantized: dict[str, bool] = {}
        self._block: dict[str, int] = {}   # activation block of a quantized weight: 256 for K types
        for name, t in self.tensors.items():
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            n_el = int(np.prod([int(s) for s in t.shape]))
            if a.size != n_el:
                raise ValueError(f"{name}: dequantized {a.size} elements, expected {n_el}")
            if len(t.shape) == 2:
                a = a.reshape(int(t.shape[1]), int(t.shape[0]))   # ne = [n_in, n_out] -> (n_out, n_in)
            elif len(t.shape) == 3:   # experts: ne = [n_in, n_out, n_expert] -> (n_expert, n_out, n_in)
                a = a.reshape(int(t.shape[2]), int(t.shape[1]), int(t.shape[0]))
            else:
                a = a.reshape(-1)
            self._w[name] = np.ascontiguousarray(a, dtype=self.dtype)
            self._quantized[name] = t.tensor_type not in FLOAT_TYPES
            self._block[name] = 256 if t.tensor_type in K_TYPES else act_block
        self._out_name = "token_embd.weight" if self.hp.tied else "output.weight"

    # ---- building blocks ------------------------------------------------------

    def weight(self, name: str) -> np.ndarray:
        """Dequantized weight: 2-D (n_out, n_in) or 1-D, in the compute dtype."""
        return self._w[name]

    def has(self, name: str) -> bool:
        return name in self._w

    def act(self, x: np.ndarray, key: tuple[int, str], names: Sequence[str]) -> dict[int, np.ndarray] | np.ndarray:
        """The activation row block `x` [n, n_in] as the quantized matmuls `names` see it (x itself
        without act_quant): a dict activation block size -> quantized rows.

        One stage input is quantized once per block size and shared by the matmuls that read it
        (q/k/v; gate/up), as the engine does. The stage key of the 256-blocks (K types) is
        (layer, stage + "_k").
        """
        if not self.act_quant:
            return x
        out = {}
        for blk in sorted({self._block[nm] for nm in names if self._quantized[nm]}):
            k = key if blk == self.act_block else (key[0], key[1] + "_k")
            if self.near_half_threshold is not None:
                self.near_half += [(dist, k, r, c) for dist, r, c in
                                   near_half_elements(x, blk, self.near_half_threshold)]
            out[blk] = quantize_activations_q8(x, blk, self.flips.get(k))
        return out

    def kv_round(self, x: np.ndarray, key: tuple[int, str]) -> np.ndarray:
        """Keys or values x [n, kv_dim] rounded to float16 as the engine's cache stores them,
        with the flips of `key` ((layer, "k_f16" | "v_f16")); candidates for flips (float16
        midpoints within near_f16_threshold float16 ulps) are collected like act()'s."""
        if self.near_half_threshold is not None:
            self.near_half += [(dist, key, r, c) for dist, r, c in near_f16_elements(x, self.near_f16_threshold)]
        return round_f16(x, self.flips.get(key))

    def matmul(self, x: np.ndarray, name: str, xq: dict[int, np.ndarray] | np.ndarray | None = None,
               expert: int | None = None) -> np.ndarray:
        """x [n, n_in] @ W^T -> [n, n_out] (W = the expert's matrix of a 3-D tensor when expert is given).

        With act_quant and a quantized W, multiplies xq[W's activation block] (from act();
        computed here without flips when None) instead of x.
        """
        if self.act_quant and self._quantized[name]:
            blk = self._block[name]
            x = quantize_activations_q8(x, blk) if not isinstance(xq, dict) else xq[blk]
        w = self._w[name] if expert is None else self._w[name][expert]
        return x @ w.T

    def moe(self, h: np.ndarray, il: int) -> np.ndarray:
        """The mixture-of-experts feed-forward of layer il for normed rows h [n, n_embd] (see the module doc).

        Activation quantization (act_quant): the input h once per block size (stage (il, "ffn_in"),
        shared by the router, if quantized, and every expert's gate/up), the down-projection input per
        expert over the rows routed to it (stage (il, "ffn_down_in_e<e>"), row = index among those rows).
        """
        hp = self.hp
        p = f"blk.{il}."
        names = [p + "ffn_gate_inp.weight", p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]
        hq = self.act(h, (il, "ffn_in"), names)
        ids, w = route_experts(self.matmul(h, names[0], hq), hp.n_expert_used, hp.expert_norm)
        self.last_routing[il] = (ids, w)
        out = np.zeros_like(h)
        for e in range(hp.n_expert):
            rows, slot = np.nonzero(ids == e)
            if rows.size == 0:
                continue
            he = h[rows]
            hqe = {b: v[rows] for b, v in hq.items()} if isinstance(hq, dict) else he
            g = self.matmul(he, names[1], hqe, expert=e)
            u = self.matmul(he, names[2], hqe, expert=e)
            gu = silu(g) * u
            dn = p + "ffn_down_exps.weight"
            y = self.matmul(gu, dn, self.act(gu, (il, f"ffn_down_in_e{e}"), [dn]), expert=e)
            np.add.at(out, rows, w[rows, slot][:, None] * y)
        return out

    def new_cache(self) -> KVCache:
        hp = self.hp
        e = np.zeros((hp.n_head_kv, 0, hp.head_dim), dtype=self.dtype)
        return KVCache(k=[e] * hp.n_layer, v=[e] * hp.n_layer, n_past=0)

    # ---- forward ---------------------------------------------------------------

    def forward(self, tokens: Sequence[int], cache: KVCache | None = None,
                pos_thw: np.ndarray | None = None) -> np.ndarray:
        """Logits for new tokens appended after `cache` (a fresh sequence when None).

        Args:
            tokens: ints in [0, n_vocab), length n >= 1.
            cache: KV cache to extend in place (n_past grows by n).
            pos_thw: multimodal RoPE only (rope.dimension_sections): int [n, 3] (t, h, w) positions of
                the new tokens; None gives text positions t = h = w = n_past + i. The causal mask
                follows the sequence order whatever the positions.
        Returns:
            logits [n, n_vocab] in the compute dtype.
        Raises:
            ValueError: a token id out of range or no tokens.
        """
        hp = self.hp
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise ValueError("no tokens")
        if toks.min() < 0 or toks.max() >= hp.n_vocab:
            raise ValueError("token id out of range")
        if cache is None:
            cache = self.new_cache()
        self.near_half = []
        self.last_routing = {}
        n = toks.size
        pos = np.arange(cache.n_past, cache.n_past + n)
        if pos_thw is None:
            pos_thw = np.repeat(pos[:, None], 3, axis=1)
        elif hp.rope_sections is None:
            raise ValueError("pos_thw given for a model without multimodal RoPE")
        pos_thw = np.asarray(pos_thw, dtype=np.int64)
        if pos_thw.shape != (n, 3):
            raise ValueError(f"pos_thw must be [{n}, 3]")
        x = self._w["token_embd.weight"][toks].astype(self.dtype)       # [n, n_embd]
        group = hp.n_head // hp.n_head_kv
        scale = float(1.0 / np.sqrt(hp.head_dim))   # a Python float keeps float32 math float32
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            # attention
            h = rms_norm(x, self._w[p + "attn_norm.weight"], hp.norm_eps)
            hq = self.act(h, (il, "attn_in"), [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
            q = self.matmul(h, p + "attn_q.weight", hq)
            k = self.matmul(h, p + "attn_k.weight", hq)
            v = self.matmul(h, p + "attn_v.weight", hq)
            if self.has(p + "attn_q.bias"):
                q = q + self._w[p + "attn_q.bias"]
                k = k + self._w[p + "attn_k.bias"]
                v = v + self._w[p + "attn_v.bias"]
            q = q.reshape(n, hp.n_head, hp.head_dim)
            k = k.reshape(n, hp.n_head_kv, hp.head_dim)
            v = v.reshape(n, hp.n_head_kv, hp.head_dim)
            if self.has(p + "attn_q_norm.weight"):
                q = rms_norm(q, self._w[p + "attn_q_norm.weight"], hp.norm_eps)
                k = rms_norm(k, self._w[p + "attn_k_norm.weight"], hp.norm_eps)
            if hp.rope_sections is not None:
                q = rope_multi(q, pos_thw, hp.rope_base, hp.rope_dim, hp.rope_sections)
                k = rope_multi(k, pos_thw, hp.rope_base, hp.rope_dim, hp.rope_sections)
            else:
                q = rope(q, pos, hp.rope_base, hp.rope_dim, hp.rope_neox)
                k = rope(k, pos, hp.rope_base, hp.rope_dim, hp.rope_neox)
            if self.kv_f16:   # the engine's F16 cache
                k = self.kv_round(k.reshape(n, -1), (il, "k_f16")).reshape(k.shape)
                v = self.kv_round(v.reshape(n, -1), (il, "v_f16")).reshape(v.shape)
            K = np.concatenate([cache.k[il], k.transpose(1, 0, 2)], axis=1)   # [n_kv, T, hd]
            V = np.concatenate([cache.v[il], v.transpose(1, 0, 2)], axis=1)
            cache.k[il], cache.v[il] = K, V
            T = K.shape[1]
            qh = q.transpose(1, 0, 2).reshape(hp.n_head_kv, group * n, hp.head_dim)  # heads of a group stacked
            s = (qh @ K.transpose(0, 2, 1)) * scale                               # [n_kv, group*n, T]
            s = s.reshape(hp.n_head_kv, group, n, T)
            mask = np.arange(T)[None, :] > pos[:, None]                            # [n, T] future keys
            if self.kv_window > 0:                                                 # evicted keys
                j = np.arange(T)[None, :]
                mask |= (j >= self.kv_sinks) & (j <= pos[:, None] - self.kv_window)
            s = np.where(mask[None, None], -np.inf, s)
            self.last_sparse[il] = []
            if self.sparse_topk > 0 and n <= 8 and pos[-1] // 64 + 1 > self.sparse_topk + 3:
                keep = self.sparse_blocks(q[-1], K)                              # [n_kv][blocks]
                self.last_sparse[il] = keep
                blk = np.arange(T) // 64
                for g, kb in enumerate(keep):
                    s[g] = np.where(np.isin(blk, kb)[None, None], s[g], -np.inf)
            a = softmax(s, axis=-1).reshape(hp.n_head_kv, group * n, T) @ V        # [n_kv, group*n, hd]
            a = a.reshape(hp.n_head, n, hp.head_dim).transpose(1, 0, 2).reshape(n, hp.n_head * hp.head_dim)
            x = x + self.matmul(a, p + "attn_output.weight", self.act(a, (il, "attn_out_in"), [p + "attn_output.weight"]))
            # feed-forward (SwiGLU; a mixture of SwiGLU experts for the MoE architectures)
            h = rms_norm(x, self._w[p + "ffn_norm.weight"], hp.norm_eps)
            if hp.n_expert:
                x = x + self.moe(h, il)
                continue
            hq = self.act(h, (il, "ffn_in"), [p + "ffn_gate.weight", p + "ffn_up.weight"])
            g = self.matmul(h, p + "ffn_gate.weight", hq)
            u = self.matmul(h, p + "ffn_up.weight", hq)
            gu = silu(g) * u
            x = x + self.matmul(gu, p + "ffn_down.weight", self.act(gu, (il, "ffn_down_in"), [p + "ffn_down.weight"]))
        cache.n_past += n
        h = rms_norm(x, self._w["output_norm.weight"], hp.norm_eps)
        return self.matmul(h, self._out_name, self.act(h, (-1, "output_in"), [self._out_name]))

    def sparse_blocks(self, q_last: np.ndarray, K: np.ndarray) -> list[list[int]]:
        """Sparse attention's blocks per KV head (see the class): q_last [n_head, hd], the
        call's last query; K [n_kv, T, hd], every cached key (T - 1 is that query's position)."""
        hp = self.hp
        group, T = hp.n_head // hp.n_head_kv, K.shape[1]
        last = (T - 1) // 64
        out = []
        for g in range(hp.n_head_kv):
            qg = q_last[g * group:(g + 1) * group]                                 # [group, hd]
            scores = []
            for b in range(1, last - 1):
                kb = K[g, 64 * b:64 * (b + 1)]
                lo, hi = kb.min(axis=0), kb.max(axis=0)
                scores.append((-float(np.maximum(qg * lo, qg * hi).sum()), b))
            chosen = [b for _, b in sorted(scores)[:self.sparse_topk]]
            out.append(sorted([0, last - 1, last] + chosen))
        return out

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [n_tokens, n_vocab] of a fresh sequence."""
        return self.forward(tokens)

    def greedy(self, prompt: Sequence[int], n: int, force: Sequence[int] | None = None,
               keep_logits: bool = False):
        """Greedy continuation with a KV cache.

        Args:
            prompt: prompt token ids (prefilled in one call).
            n: tokens to generate.
            force: optional token sequence to feed instead of the reference's own
                argmax (to follow another implementation's path and read the
                reference's margins along it); its length must be >= n - 1.
        Returns:
            GreedyResult with tokens (the reference's argmax at each step),
            margins (top-1 minus top-2 logit at each step), top2 (the two best ids)
            logits_first (the logits row after the prompt) and, with
            keep_logits, every step's logits row ([n, n_vocab]; else None).
        """
        cache = self.new_cache()
        row = self.forward(prompt, cache)[-1]
        logits_first = row.copy()
        toks, margins, top2, rows = [], [], [], []
        for i in range(n):
            if keep_logits:
                rows.append(row.copy())
            order = np.argsort(-row, kind="stable")[:2]
            t = int(order[0])
            toks.append(t)
            margins.append(float(row[order[0]] - row[order[1]]))
            top2.append((int(order[0]), int(order[1])))
            if i == n - 1:
                break
            nxt = t if force is None else int(force[i])
            row = self.forward([nxt], cache)[-1]
        return GreedyResult(tokens=toks, margins=margins, top2=top2, logits_first=logits_first,
                            logits=np.stack(rows) if keep_logits else None)


@dataclass
class GreedyResult:
    tokens: list[int]                   # argmax per step
    margins: list[float]                # top-1 minus top-2 logit per step (logit units)
    top2: list[tuple[int, int]]         # (best, second) ids per step
    logits_first: np.ndarray            # [n_vocab] after the prompt
    logits: np.ndarray | None = None    # [n, n_vocab] per step (keep_logits=True)


def align_rounding(R: Reference, tokens: Sequence[int], target: np.ndarray, tol_abs: float,
                   near: float = 1e-4, max_flips: int = 3, max_tries: int = 60, near_f16: float | None = None):
    """Reference logits of `tokens` (fresh sequence) aligned to `target` by rounding flips.

    Args:
        R: a Reference with act_quant=True or kv_f16=True (the roundings it may invert: the
            int8 activations' and the float16 KV cache's).
        tokens: the token ids.
        target: logits [n_tokens, n_vocab] of the implementation under test.
        tol_abs: per-element tolerance (logit units) a row must meet.
        near: only roundings with |x * id - (k + 1/2)| < near (int8 activations) may be
            inverted, and KV cache roundings within near_f16 float16 ulps of a midpoint.
        near_f16: float16 ulps; the default, NEAR_F16, is four float32 ulps (a float32 value
            lies a multiple of 2^-13 float16 ulps from a float16 midpoint).
        max_flips: at most this many inverted roundings.
    Returns:
        (logits [n_tokens, n_vocab], flips) where flips lists
        (distance, stage key, row, col) of the roundings inverted (usually []).
        The logits may still miss tol_abs: the caller asserts.

    Method: find the first row over tolerance; try the candidate roundings of
    rows <= that row, closest to a boundary first; keep the one that brings the
    rows up to that one within tolerance; repeat.
    """
    if not (R.act_quant or R.kv_f16):
        raise ValueError("align_rounding needs act_quant=True or kv_f16=True")
    R.flips, R.near_half_threshold = {}, near
    R.near_f16_threshold = NEAR_F16 if near_f16 is None else near_f16
    try:
        L = R.forward(tokens)
        used: list = []
        while True:
            bad = np.nonzero(np.abs(target - L).max(axis=1) > tol_abs)[0]
            if bad.size == 0 or len(used) >= max_flips:
                return L, used
            r = int(bad[0])
            cands = sorted(c for c in R.near_half if c[2] <= r and c[1:] not in {u[1:] for u in used})
            best = None
            for cand in cands[:max_tries]:
                R.flips = {}
                for _, key, rr, cc in used + [cand]:
                    R.flips.setdefault(key, set()).add((rr, cc))
                L2 = R.forward(tokens)
                # row r and every row before it: a flip that mends row r may break an earlier one
                # (a float16 K or V rounding reaches every later position)
                e = float(np.abs(target[:r + 1] - L2[:r + 1]).max())
                if best is None or e < best[0]:
                    best = (e, cand, L2)
            if best is None or best[0] > tol_abs:
                return L, used
            used.append(best[1])
            L = best[2]
    finally:
        R.flips, R.near_half_threshold = {}, None
