"""Write tiny random-weight GGUF models for the engine tests.

The files are written with the `gguf` package (gguf.GGUFWriter). Types the
package can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) go through
gguf.quants.quantize. The K-quant types (Q4_K, Q5_K, Q6_K) are quantized here
by a small numpy quantizer and packed into raw blocks; `pack_k_blocks` is
checked against gguf.quants.dequantize (see tests/test_reference_self.py), so
the byte layout is the one ggml reads, not one we invented.

Layout reminder (GGUF / ggml): a matrix W with n_out rows of n_in elements has
ne = [n_in, n_out]; in numpy it is shape (n_out, n_in), row r = output r.

Example:
    from ggufgen import write_tiny_model   # tests/ is on sys.path under pytest
    write_tiny_model("/tmp/m.gguf", arch="qwen3", matrix_type="Q4_K",
                     n_embd=256, n_ff=512, head_dim=128)
"""
from __future__ import annotations

from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from echospec.services.text.tokenizer import bytes_to_unicode

QK_K = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
GGUF_QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
ALL_TYPES = GGUF_QUANTIZABLE + K_TYPES
ARCHS = ("llama", "qwen2", "qwen3")

# Special tokens of the tiny tokenizer (ChatML-like, as SmolLM2 and Qwen use).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
N_SPECIAL = len(SPECIAL_TOKENS)
BOS_ID = 1
EOS_ID = 2
# A few byte-level BPE merges of common English pieces ("Ġ" is the space byte).
_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"),
    ("o", "n"), ("r", "e"), ("Ġ", "s"), ("a", "t"), ("e", "n"), ("o", "r"),
    ("Ġ", "w"), ("i", "s"), ("Ġ", "c"), ("e", "s"), ("Ġ", "o"), ("i", "t"),
    ("a", "n"), ("Ġ", "h"), ("in", "g"), ("Ġ", "b"), ("e", "d"), ("Ġ", "f"),
    ("a", "r"), ("o", "u"), ("l", "l"), ("Ġ", "m"), ("Ġ", "p"), ("Ġ", "d"),
)
MIN_VOCAB = N_SPECIAL + 256 + len(_MERGES)  # 289


@dataclass(frozen=True)
class TinySpec:
    """What write_tiny_model wrote (for tests that need the numbers)."""
    path: str
    arch: str
    matrix_type: str
    embd_type: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    tied: bool
    seed: int
    rope_base: float
    rope_dim: int
    n_ctx_train: int
    norm_eps: float

    def asdict(self) -> dict:
        return asdict(self)


def qtype(name: str | QT) -> QT:
    """GGMLQuantizationType for a name such as "Q4_K" (or pass one through)."""
    return name if isinstance(name, QT) else QT[name]


# ---- byte-level BPE vocabulary ---------------------------------------------

def tiny_vocab(n_vocab: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
               ) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the tiny gpt2-style tokenizer.

    Ids: 0..2 special (<|endoftext|>, <|im_start|>, <|im_end|>, or ``special_tokens``, three
    texts; type CONTROL),
    3..258 the 256 byte tokens (in byte order), then one token per merge, then
    "<|reserved_i|>" padding (type UNUSED) up to n_vocab.

    Raises:
        ValueError: n_vocab < MIN_VOCAB (289).
    """
    if n_vocab < MIN_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_VOCAB} for the tiny tokenizer, got {n_vocab}")
    b2u = bytes_to_unicode()
    if len(special_tokens) != N_SPECIAL:
        raise ValueError(f"special_tokens must be {N_SPECIAL} texts")
    tokens = list(special_tokens) + [b2u[b] for b in range(256)]
    types = [int(gguf.TokenType.CONTROL)] * N_SPECIAL + [int(gguf.TokenType.NORMAL)] * 256
    merges = []
    for a, b in _MERGES:
        assert a in tokens and b in tokens, (a, b)
        tokens.append(a + b)
        types.append(int(gguf.TokenType.NORMAL))
        merges.append(f"{a} {b}")
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"<|reserved_{i}|>")
        types.append(int(gguf.TokenType.UNUSED))
        i += 1
    return tokens, types, merges


# ---- K-quant blocks from raw bytes -----------------------------------------

def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into 12 bytes (ggml get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    return out


def quantize_k(x: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float rows to Q4_K / Q5_K / Q6_K with a simple min/max quantizer.

    Args:
        x: float array (n_rows, n_cols), n_cols a multiple of 256.
        type_name: "Q4_K", "Q5_K" or "Q6_K".
    Returns:
        (raw, expected): raw uint8 (n_rows, n_cols / 256 * block_bytes) in ggml's
        block layout, and expected float32 (n_rows, n_cols), the value of every
        weight computed here from the integers (d * sc * q - dmin * m for
        Q4_K/Q5_K, d * sc * (q - 32) for Q6_K) with f16 d/dmin.
    """
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"{type_name} needs rows that are a multiple of 256, got {cols}")
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK_K)
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, -1, 32 if type_name != "Q6_K" else 16)
    if type_name in ("Q4_K", "Q5_K"):
        qmax = 15 if type_name == "Q4_K" else 31
        lo = np.minimum(sub.min(axis=-1), 0.0)          # (nb, 8), <= 0
        hi = sub.max(axis=-1)
        scale = np.maximum((hi - lo) / qmax, 1e-8)      # per sub-block step
        mins = -lo                                      # >= 0
        d = _f16(scale.max(axis=-1) / 63).astype(np.float32)     # (nb,)
        dmin = _f16(np.maximum(mins.max(axis=-1), 1e-8) / 63).astype(np.float32)
        d = np.where(d == 0, np.float32(6e-8), d)
        dmin = np.where(dmin == 0, np.float32(6e-8), dmin)
        sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)
        m = np.clip(np.rint(mins / dmin[:, None]), 0, 63).astype(np.uint8)
        step = (d[:, None] * sc).astype(np.float32)      # (nb, 8)
        off = (dmin[:, None] * m).astype(np.float32)
        q = np.clip(np.rint((sub + off[..., None]) / step[..., None]), 0, qmax).astype(np.uint8)
        expected = (step[..., None] * q.astype(np.float32) - off[..., None]).reshape(rows, cols)
        qf = q.reshape(nb, QK_K)
        nib = qf & 0xF
        qs = np.zeros((nb, 128), dtype=np.uint8)
        for g in range(4):  # 32 bytes per pair of sub-blocks: low nibble 2g, high nibble 2g+1
            qs[:, g * 32:(g + 1) * 32] = nib[:, (2 * g) * 32:(2 * g + 1) * 32] \
                | (nib[:, (2 * g + 1) * 32:(2 * g + 2) * 32] << 4)
        parts = [d.astype(np.float16).view(np.uint8).reshape(nb, 2),
                 dmin.astype(np.float16).view(np.uint8).reshape(nb, 2),
                 _pack_k_scales(sc, m)]
        if type_name == "Q5_K":
            qh = np.zeros((nb, 32), dtype=np.uint8)
            for j in range(8):  # bit j of qh[l] is the 5th bit of element 32*j + l
                qh |= ((qf[:, j * 32:(j + 1) * 32] >> 4) & 1) << j
            parts.append(qh)
        parts.append(qs)
        raw = np.concatenate(parts, axis=1)
    elif type_name == "Q6_K":
        amax = np.abs(sub).max(axis=-1)                 # (nb, 16)
        scale = np.maximum(amax / 31, 1e-8)
        d = _f16(scale.max(axis=-1) / 127).astype(np.float32)
        d = np.where(d == 0, np.float32(6e-8), d)
        sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
        step = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
        q = np.clip(np.rint(sub / step[..., None]), -32, 31).astype(np.int32) + 32  # 0..63
        expected = (step[..., None] * (q - 32).astype(np.float32)).reshape(rows, cols)
        qf = q.reshape(nb, QK_K).astype(np.uint8)
        ql = np.zeros((nb, 128), dtype=np.uint8)
        qh = np.zeros((nb, 64), dtype=np.uint8)
        for h in range(2):            # two halves of 128 elements
            e = qf[:, h * 128:(h + 1) * 128]
            ql[:, h * 64:(h + 1) * 64] = (e[:, 0:64] & 0xF) | ((e[:, 64:128] & 0xF) << 4)
            for k in range(4):        # 2 high bits of element h*128 + 32k + l at bits 2k of qh[h*32 + l]
                qh[:, h * 32:(h + 1) * 32] |= ((e[:, k * 32:(k + 1) * 32] >> 4) & 3) << (2 * k)
        raw = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(nb, 2)],
                             axis=1)
    else:
        raise ValueError(f"not a K type: {type_name}")
    block_bytes = gguf.GGML_QUANT_SIZES[QT[type_name]][1]
    assert raw.shape == (nb, block_bytes), (raw.shape, block_bytes)
    return raw.reshape(rows, -1), expected.astype(np.float32)


def encode_tensor(x: np.ndarray, type_name: str) -> np.ndarray:
    """Encode float rows (n_rows, n_cols) as `type_name` bytes/values for GGUFWriter.add_tensor.

    Returns an array to pass with raw_dtype=qtype(type_name) (F32 arrays are
    float32, F16 float16, all other types uint8 rows of blocks).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if type_name in K_TYPES:
        return quantize_k(x, type_name)[0]
    return gguf.quants.quantize(x, qtype(type_name))


# ---- the model writer --------------------------------------------------------

def write_tiny_model(path: str | Path, arch: str = "llama", matrix_type: str = "F32",
                     embd_type: str | None = None, n_layer: int = 2, n_embd: int = 64,
                     n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None,
                     n_ff: int = 128, n_vocab: int = 320, tied: bool = True, seed: int = 0,
                     rope_base: float = 10000.0, rope_dim: int | None = None,
                     n_ctx_train: int = 512, norm_eps: float = 1e-5,
                     output_type: str | None = None, tokenizer_pre: str = "gpt2",
                     special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> TinySpec:
    """Write a random-weight GGUF model of the llama, qwen2 or qwen3 architecture.

    Args:
        path: file to write.
        arch: "llama" (normal RoPE), "qwen2" (NEOX RoPE, q/k/v biases) or
            "qwen3" (NEOX RoPE, per-head RMSNorm of q and k, head_dim free).
        matrix_type: type of every block matrix (attn_q/k/v/output, ffn_*), or
            "Q4_K_M": Q4_K with Q6_K attn_v and ffn_down (the tensor types of
            llama.cpp's Q4_K_M files, whose token_embd and output are Q6_K by default).
        embd_type: type of token_embd.weight (default: matrix_type; Q6_K for Q4_K_M).
        head_dim: per-head size (default n_embd // n_head); written as
            attention.key_length / value_length.
        n_ff: SwiGLU hidden size. K types need every row length (n_embd,
            n_head * head_dim, n_ff) to be a multiple of 256.
        n_vocab: vocabulary size, >= 289 (specials + 256 bytes + merges).
        tied: omit output.weight (the output projection reuses token_embd).
        output_type: type of output.weight when not tied (default matrix_type).
        seed: numpy RNG seed; the same arguments give the same bytes.
        special_tokens: the three control tokens' texts (ids 0..2; default ChatML's).
    Returns:
        TinySpec with the hyperparameters written.
    Raises:
        ValueError: bad architecture, type name, or a row length the type cannot hold.

    Weights: matrices N(0, 1) * 0.7 / sqrt(n_in), token_embd and output N(0, 1) * 2 / sqrt(n_embd)
    (logits then have a std of about 1-3), norm weights 1 + 0.1 N(0, 1),
    qwen2 biases 0.1 N(0, 1). Activations stay O(1).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    mixed = matrix_type == "Q4_K_M"
    embd_type = embd_type or ("Q6_K" if mixed else matrix_type)
    output_type = output_type or ("Q6_K" if mixed else matrix_type)
    for t in ("Q4_K" if mixed else matrix_type, embd_type, output_type):
        if t not in ALL_TYPES:
            raise ValueError(f"unknown tensor type {t!r}")
    head_dim = head_dim or n_embd // n_head
    rope_dim = rope_dim or head_dim
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    rng = np.random.default_rng(seed)
    path = str(path)

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-{matrix_type}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope_base))
    w.add_rope_dimension_count(rope_dim)
    w.add_layer_norm_rms_eps(float(norm_eps))
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))

    tokens, types, merges = tiny_vocab(n_vocab, special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)

    def mat(n_out: int, n_in: int, scale: float | None = None) -> np.ndarray:
        s = 0.7 / np.sqrt(n_in) if scale is None else scale
        return (rng.standard_normal((n_out, n_in)) * s).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, x: np.ndarray, type_name: str) -> None:
        if type_name == "Q4_K_M":
            type_name = "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight")) else "Q4_K"
        if x.ndim == 1:  # norms and biases are always F32
            w.add_tensor(name, x.astype(np.float32))
            return
        data = encode_tensor(x, type_name)
        if type_name in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype(type_name))

    q_out = n_head * head_dim
    kv_out = n_head_kv * head_dim
    add("token_embd.weight", mat(n_vocab, n_embd, 2.0 / np.sqrt(n_embd)), embd_type)
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(n_embd), "F32")
        add(p + "attn_q.weight", mat(q_out, n_embd), matrix_type)
        add(p + "attn_k.weight", mat(kv_out, n_embd), matrix_type)
        add(p + "attn_v.weight", mat(kv_out, n_embd), matrix_type)
        if arch == "qwen2":
            add(p + "attn_q.bias", (0.1 * rng.standard_normal(q_out)).astype(np.float32), "F32")
            add(p + "attn_k.bias", (0.1 * rng.standard_normal(kv_out)).astype(np.float32), "F32")
            add(p + "attn_v.bias", (0.1 * rng.standard_normal(kv_out)).astype(np.float32), "F32")
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", norm(head_dim), "F32")
            add(p + "attn_k_norm.weight", norm(head_dim), "F32")
        add(p + "attn_output.weight", mat(n_embd, q_out), matrix_type)
        add(p + "ffn_norm.weight", norm(n_embd), "F32")
        add(p + "ffn_gate.weight", mat(n_ff, n_embd), matrix_type)
        add(p + "ffn_up.weight", mat(n_ff, n_embd), matrix_type)
        add(p + "ffn_down.weight", mat(n_embd, n_ff), matrix_type)
    add("output_norm.weight", norm(n_embd), "F32")
    if not tied:
        add("output.weight", mat(n_vocab, n_embd, 2.0 / np.sqrt(n_embd)), output_type)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinySpec(path=path, arch=arch, matrix_type=matrix_type, embd_type=embd_type,
                    n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                    head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, tied=tied, seed=seed,
                    rope_base=float(rope_base), rope_dim=rope_dim, n_ctx_train=n_ctx_train,
                    norm_eps=float(norm_eps))


def k_type_dims(head_dim: int | None = None) -> dict:
    """Model sizes whose every row length is a multiple of 256 (for Q4_K/Q5_K/Q6_K)."""
    d = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
    if head_dim is not None:
        d["head_dim"] = head_dim
    return d


def encode_tokens(text: str, n_vocab: int = MIN_VOCAB) -> list[int]:
    """Byte-level ids of `text` in the tiny vocabulary (no merges applied; a valid, if long, tokenization)."""
    return [N_SPECIAL + b for b in text.encode("utf-8")]


def tensor_names(arch: str, n_layer: int, tied: bool) -> Sequence[str]:
    """Names of the tensors write_tiny_model writes, in order."""
    names = ["token_embd.weight"]
    for i in range(n_layer):
        p = f"blk.{i}."
        names += [p + "attn_norm.weight", p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        if arch == "qwen2":
            names += [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        if arch == "qwen3":
            names += [p + "attn_q_norm.weight", p + "attn_k_norm.weight"]
        names += [p + "attn_output.weight", p + "ffn_norm.weight", p + "ffn_gate.weight",
                  p + "ffn_up.weight", p + "ffn_down.weight"]
    names.append("output_norm.weight")
    if not tied:
        names.append("output.weight")
    return names


def write_tokenizer_gguf(path: Path, tokens: list[str], token_types: list[int], merges: list[str],
                         pre: str | None = "qwen2", model: str = "gpt2", bos_id: int | None = 0,
                         eos_id: int | None = 2, chat_template: str | None = None,
                         scores: list[float] | None = None, unk_id: int | None = None,
                         add_space_prefix: bool | None = None, arch: str = "qwen2") -> Path:
    """Write a tokenizer-only GGUF file (architecture arch, no tensors); a field left None (merges:
    empty) is not written."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    for value, add in ((pre, w.add_tokenizer_pre), (tokens, w.add_token_list), (token_types, w.add_token_types),
                       (scores, w.add_token_scores), (unk_id, w.add_unk_token_id),
                       (add_space_prefix, w.add_add_space_prefix), (merges or None, w.add_token_merges),
                       (bos_id, w.add_bos_token_id), (eos_id, w.add_eos_token_id),
                       (chat_template, w.add_chat_template)):
        if value is not None:
            add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
