"""Random Q4_K / Q6_K blocks and llama.cpp's Q4_K_M type choice, for files too big to quantize.

qwen3_shapes.py writes most board-shaped files as F16 and lets llama.cpp's quantizer pick the types.
A 30B-A3B model's F16 file would be 61 GB, so that shape is written directly in quantized blocks:
random quants with f16 scales chosen so that the weights have about the standard deviation the F16
files use (mean 0, std 0.7 / sqrt(n_in)), and the per-tensor types llama.cpp's Q4_K_M recipe gives
(src/llama-quant.cpp, llama_tensor_get_type_impl), see q4_k_m_type.

Block layouts (ggml-common.h), 256 weights per block:
    Q4_K  144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales sc[8] and mins m[8],
          128 bytes of nibbles; weight = d * sc[j] * q - dmin * m[j].
          Here sc[j] = m[j] (random, 16..63) and dmin = 7.5 d, so weight = d * sc[j] * (q - 7.5).
    Q6_K  210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 sub-block scales, f16 d;
          weight = d * scale[j] * (q - 32). Here scale[j] random in 16..63.
"""
from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
_SC_LO, _SC_HI = 16, 64            # sub-block scales drawn from [16, 64)
_SC_MEAN = (_SC_LO + _SC_HI - 1) / 2
_Q4_STD = np.sqrt((16 ** 2 - 1) / 12)   # std of a uniform nibble, 4.61
_Q6_STD = np.sqrt((64 ** 2 - 1) / 12)   # std of a uniform 6-bit value, 18.5


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers Q4_K_M gives more bits (half of them)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int, n_expert: int) -> str:
    """The ggml type llama.cpp's Q4_K_M recipe gives tensor `name` of a model with an untied head and
    n_expert != 8 (the rules for 8-expert models differ), as its quantizer would from an F16 file.

    1-D tensors (norms) and ffn_gate_inp stay F32; output.weight Q6_K; attn_v and ffn_down(_exps) Q6_K
    in the layers use_more_bits picks; everything else (token_embd included) Q4_K. Row lengths must
    be multiples of 256 (no fallback types here).
    """
    if n_expert == 8:
        raise ValueError("the Q4_K_M rules for 8-expert models (Q8_0 attn_k/attn_v) are not implemented")
    if name.endswith("_norm.weight") or "ffn_gate_inp" in name:
        return "F32"
    if name == "output.weight":
        return "Q6_K"
    if "attn_v.weight" in name or "ffn_down" in name:
        i_layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(i_layer, n_layer) else "Q4_K"
    return "Q4_K"


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(rng: np.random.Generator, type_name: str, n_rows: int, n_in: int, std: float) -> np.ndarray:
    """(n_rows, n_in / 256 * block bytes) uint8: random blocks of type_name whose weights have mean
    about 0 and standard deviation about std (each block's d is std / (mean scale * quant std),
    times a random factor in [0.75, 1.25))."""
    if n_in % QK_K:
        raise ValueError(f"row length {n_in} is not a multiple of {QK_K}")
    nb = n_rows * (n_in // QK_K)
    size = BLOCK_BYTES[type_name]
    blocks = np.frombuffer(rng.bytes(nb * size), dtype=np.uint8).reshape(nb, size).copy()
    jitter = rng.uniform(0.75, 1.25, nb).astype(np.float32)
    if type_name == "Q4_K":
        d = np.float32(std / (_SC_MEAN * _Q4_STD)) * jitter
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(d * np.float32(7.5))
        sc = rng.integers(_SC_LO, _SC_HI, size=(nb, 8), dtype=np.uint8)
        blocks[:, 4:16] = pack_q4_k_scales(sc, sc)
    elif type_name == "Q6_K":
        d = np.float32(std / (_SC_MEAN * _Q6_STD)) * jitter
        blocks[:, 192:208] = rng.integers(_SC_LO, _SC_HI, size=(nb, 16), dtype=np.uint8)
        blocks[:, 208:210] = _f16_bytes(d)
    else:
        raise ValueError(f"no random blocks for {type_name}")
    return blocks.reshape(n_rows, -1)


def pack_q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of Q4_K's 6-bit scales and mins (ggml's get_scale_min_k4, inverted).

    Bytes 0-3: sc[0..3] low 6 bits | (sc[4..7] >> 4) << 6; bytes 4-7: m[0..3] | (m[4..7] >> 4) << 6;
    bytes 8-11: (sc[4..7] & 15) | (m[4..7] & 15) << 4.
    """
    sc = sc.astype(np.uint8) & 63
    m = m.astype(np.uint8) & 63
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out
