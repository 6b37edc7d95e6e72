"""Board-shaped benchmark files: random-weight GGUF models with the real Qwen3 shapes.

The board's users run Qwen3 0.6B-8B as Q4_K_M. Decode speed depends on the shapes, the tensor types
and the bytes read per step, not on the weight values, so a random-weight file with the real shapes,
quantized by llama.cpp's own quantizer, runs at the real model's speed. Such files are written here:

    1. an F16 GGUF (architecture qwen3) with random weights, written tensor by tensor with
       gguf.GGUFWriter so that at most one tensor is in memory;
    2. quantized to each requested type with llama.cpp's quantizer (llama_cpp.llama_model_quantize,
       default parameters, ftype LLAMA_FTYPE_MOSTLY_Q4_K_M / _Q8_0 / ...), which picks the per-tensor
       types exactly as for a real model (Q4_K_M: Q4_K with some tensors in Q6_K, the tied head
       included);
    3. the F16 intermediate is deleted.

Shapes (from the models' config.json; text_config for Qwen3-VL): head_dim 128, vocabulary 151936,
RMSNorm eps 1e-6, per-head RMSNorm of q and k.

    shape       arch      hidden  ffn    layers  heads/KV  head  RoPE base  file
    0.6B        qwen3      1024   3072     28     16/8     tied    1e6     qwen3-0.6B-shape.*
    1.7B        qwen3      2048   6144     28     16/8     tied    1e6     qwen3-1.7B-shape.*
    4B          qwen3      2560   9728     36     32/8     tied    1e6     qwen3-4B-shape.*
    VL-2B       qwen3vl    2048   6144     28     16/8     tied    5e6     qwen3vl-2B-shape.*
    VL-8B       qwen3vl    4096  12288     36     32/8     untied  5e6     qwen3vl-8B-shape.*
    30B-A3B     qwen3moe   2048  128 x 768 48     32/4     untied  1e6     qwen3moe-30B-A3B-shape.Q4_K_M
    30B-A3B-L8  qwen3moe   as 30B-A3B, 8 of its 48 layers                  qwen3moe-30B-A3B-L8-shape.Q4_K_M

qwen3vl (the text decoder of Qwen3-VL; no vision tower or projector) adds rope.dimension_sections
[24, 20, 20, 0] (interleaved M-RoPE; for text, all sections see the same position) and
n_deepstack_layers 3. qwen3moe has 128 experts of FFN 768, 8 used per token, a router
(ffn_gate_inp, F32) and the 3-D expert tensors ffn_gate_exps / ffn_up_exps / ffn_down_exps.

The 30B-A3B shapes are not quantized by llama.cpp (their F16 file would be 61 GB): they are written
directly in Q4_K / Q6_K blocks with random quants and f16 scales that give the weights about the F16
files' standard deviation, in the per-tensor types llama.cpp's Q4_K_M recipe gives such a model
(bench/kquant_blocks.py: output Q6_K; attn_v and ffn_down_exps Q6_K in half of the layers; the rest
Q4_K; norms and router F32). Their only type is Q4_K_M; they need no llama-cpp-python.

llama.cpp loads a file only with a vocabulary of the embedding's size, so a stand-in byte-level BPE
vocabulary is written: tokenizer model gpt2, pre qwen2, 151936 tokens (the 256 byte tokens, one
merged token, filler tokens, and Qwen's special tokens at their real ids), token types and one merge.
It tokenizes text as bytes; the text it makes is nonsense. Use these files for speed only.

With --smollm2 the default model (SmolLM2-135M-Instruct Q4_1, from scripts/fetch_model.py) is also
requantized to the requested types (allow_requantize; its rows of 576 are not a multiple of 256, so
llama.cpp stores those matrices in its fallback types, Q5_0 / Q8_0, as it would for the real model).

Usage:
    python bench/qwen3_shapes.py                                  # 0.6B Q4_K_M + Q8_0, 1.7B Q4_K_M, SmolLM2
    python bench/qwen3_shapes.py --shapes 0.6B,1.7B,4B --types Q4_K_M,Q8_0 --smollm2
    python bench/qwen3_shapes.py --shapes 30B-A3B,30B-A3B-L8,VL-2B,VL-8B --types Q4_K_M
    python bench/qwen3_shapes.py --list                           # the paths, made or not
Output: $ECHOSPEC_CACHE/bench/ (default ~/.cache/echospec/bench/), files named
qwen3-0.6B-shape.Q4_K_M.gguf, SmolLM2-135M-Instruct.Q8_0.gguf, ...; existing files are kept.
The paths of the files are printed on stdout, one a line; progress goes to stderr.
Exit status: 0; 2 with a message when llama-cpp-python or the default model is missing, or a type
other than Q4_K_M is asked of a 30B-A3B shape.

Needs: numpy, gguf, and llama-cpp-python (the `bench` extra). Disk: the F16 intermediate is 1.2 GB
(0.6B), 3.4 GB (1.7B), 8.0 GB (4B), 3.4 GB (VL-2B, the 1.7B shape), 16.4 GB (VL-8B); the 30B-A3B file itself is
17.3 GiB (the L8 copy 3.2 GiB). Memory: the largest tensor (token_embd, 151936 x hidden, float32
while it is drawn: 2.5 GB for VL-8B).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from echospec.services.text.tokenizer import bytes_to_unicode

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    """Hyperparameters of one model size (config.json names in comments; text_config for Qwen3-VL)."""
    name: str
    n_embd: int        # hidden_size
    n_ff: int          # intermediate_size
    n_layer: int       # num_hidden_layers
    n_head: int        # num_attention_heads
    n_head_kv: int = 8     # num_key_value_heads
    head_dim: int = 128
    n_vocab: int = 151936
    rope_base: float = 1e6     # rope_theta
    norm_eps: float = 1e-6     # rms_norm_eps
    n_ctx_train: int = 40960   # max_position_embeddings
    arch: str = "qwen3"        # GGUF general.architecture
    tied: bool = True          # tie_word_embeddings (no output.weight)
    rope_sections: tuple[int, ...] = ()   # qwen3vl: rope_scaling.mrope_section, padded to 4
    n_deepstack: int = 0       # qwen3vl: len(vision_config.deepstack_visual_indexes)
    n_expert: int = 0          # qwen3moe: num_experts
    n_expert_used: int = 0     # qwen3moe: num_experts_per_tok
    n_ff_exp: int = 0          # qwen3moe: moe_intermediate_size
    stem: str = ""             # file names' start (default "<arch>-<name>")

    @property
    def label(self) -> str:
        return self.stem or f"{self.arch}-{self.name}"

    @property
    def direct(self) -> bool:
        """Written directly in Q4_K_M blocks (an F16 intermediate would be too big), not quantized."""
        return self.n_expert > 0


_MOE = dict(n_ff=6144, n_head=32, n_head_kv=4, arch="qwen3moe", tied=False, n_expert=128,
            n_expert_used=8, n_ff_exp=768)
_VL = dict(arch="qwen3vl", rope_base=5e6, n_ctx_train=262144, rope_sections=(24, 20, 20, 0), n_deepstack=3)
SHAPES = {s.name: s for s in (
    Shape("0.6B", n_embd=1024, n_ff=3072, n_layer=28, n_head=16),
    Shape("1.7B", n_embd=2048, n_ff=6144, n_layer=28, n_head=16),
    Shape("4B", n_embd=2560, n_ff=9728, n_layer=36, n_head=32),
    Shape("30B-A3B", n_embd=2048, n_layer=48, **_MOE),
    Shape("30B-A3B-L8", n_embd=2048, n_layer=8, **_MOE),   # 8 of the 48 layers, same per-layer shapes
    Shape("VL-2B", n_embd=2048, n_ff=6144, n_layer=28, n_head=16, stem="qwen3vl-2B", **_VL),
    Shape("VL-8B", n_embd=4096, n_ff=12288, n_layer=36, n_head=32, tied=False, stem="qwen3vl-8B", **_VL),
)}

# ftype names accepted by --types -> llama_cpp constant names
TYPES = {
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
}

# Qwen's special tokens and their ids (tokenizer_config.json); the rest of the ids up to 151935 are
# padding in the real vocabulary and fillers here.
QWEN_SPECIAL_FIRST = 151643
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
EOS_ID = QWEN_SPECIAL_FIRST + 2   # <|im_end|>
PAD_ID = QWEN_SPECIAL_FIRST       # <|endoftext|>


class ShapesError(RuntimeError):
    """A setup problem the user must fix (llama-cpp-python or the default model missing); exit 2."""


def log(msg: str) -> None:
    print(f"[qwen3_shapes] {msg}", file=sys.stderr, flush=True)


def out_dir() -> Path:
    base = os.environ.get("ECHOSPEC_CACHE") or str(Path.home() / ".cache" / "echospec")
    return Path(base) / "bench"


def shape_path(shape: Shape, type_name: str, directory: Path) -> Path:
    return directory / f"{shape.label}-shape.{type_name}.gguf"


def smollm2_path(type_name: str, directory: Path) -> Path:
    return directory / f"SmolLM2-135M-Instruct.{type_name}.gguf"


# ---- the stand-in vocabulary ------------------------------------------------------------------

def stand_in_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE vocabulary of exactly n_vocab entries.

    Ids 0..255: the byte tokens in byte order; 256: "Ġt" (the one merge, "Ġ t"); then fillers
    "tok<id>" (printable ASCII, so llama.cpp's byte decoder accepts them) up to Qwen's special
    tokens at ids 151643.. (type CONTROL), then fillers to n_vocab. Fillers are NORMAL tokens that
    no merge produces.
    """
    import gguf

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + ["Ġt"]
    merges = ["Ġ t"]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    specials = {QWEN_SPECIAL_FIRST + i: s for i, s in enumerate(QWEN_SPECIALS)} \
        if n_vocab >= QWEN_SPECIAL_FIRST + len(QWEN_SPECIALS) else {}
    for i in range(len(tokens), n_vocab):
        if i in specials:
            tokens.append(specials[i])
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(f"tok{i}")
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types, merges


# ---- the files ------------------------------------------------------------------------------------

def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) of every tensor, in file order. Numpy shapes are the reverse of
    ggml's: (n_out, n_in) for matrices, (n_expert, n_out, n_in) for the experts, (n,) for vectors.

    kind: "embd" (token_embd, the tied head, output.weight when untied), "mat" (block matrices and
    experts), "router" (ffn_gate_inp, F32 like the converter writes it), "norm" (F32 vectors).
    """
    q_out, kv_out = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    plan = [("token_embd.weight", (s.n_vocab, s.n_embd), "embd")]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (s.n_embd,), "norm"),
            (p + "attn_q.weight", (q_out, s.n_embd), "mat"),
            (p + "attn_k.weight", (kv_out, s.n_embd), "mat"),
            (p + "attn_v.weight", (kv_out, s.n_embd), "mat"),
            (p + "attn_q_norm.weight", (s.head_dim,), "norm"),
            (p + "attn_k_norm.weight", (s.head_dim,), "norm"),
            (p + "attn_output.weight", (s.n_embd, q_out), "mat"),
            (p + "ffn_norm.weight", (s.n_embd,), "norm"),
        ]
        if s.n_expert:
            e, f = s.n_expert, s.n_ff_exp
            plan += [
                (p + "ffn_gate_inp.weight", (e, s.n_embd), "router"),
                (p + "ffn_gate_exps.weight", (e, f, s.n_embd), "mat"),
                (p + "ffn_up_exps.weight", (e, f, s.n_embd), "mat"),
                (p + "ffn_down_exps.weight", (e, s.n_embd, f), "mat"),
            ]
        else:
            plan += [
                (p + "ffn_gate.weight", (s.n_ff, s.n_embd), "mat"),
                (p + "ffn_up.weight", (s.n_ff, s.n_embd), "mat"),
                (p + "ffn_down.weight", (s.n_embd, s.n_ff), "mat"),
            ]
    plan.append(("output_norm.weight", (s.n_embd,), "norm"))
    if not s.tied:
        plan.append(("output.weight", (s.n_vocab, s.n_embd), "embd"))
    return plan


def _std(kind: str, shape: tuple[int, ...], n_embd: int) -> float:
    """Standard deviation of a matrix's random weights: 2 / sqrt(n_embd) for the embedding and the
    head (logits with a std of about 2), 0.7 / sqrt(n_in) for the rest (activations stay O(1))."""
    return 2.0 / np.sqrt(n_embd) if kind == "embd" else 0.7 / np.sqrt(shape[-1])


def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: str, n_embd: int) -> np.ndarray:
    """Random values for one tensor: F16 matrices, F32 norms and router.

    Matrices N(0, _std); norm weights 1 + 0.1 N(0, 1). Rows are drawn in chunks of 4096 so the
    float32 scratch stays small.
    """
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape[0], dtype=np.float32)).astype(np.float32)
    n_in = shape[-1]
    scale = np.float32(_std(kind, shape, n_embd))
    out = np.empty(shape, dtype=np.float32 if kind == "router" else np.float16)
    rows = out.reshape(-1, n_in)
    for r0 in range(0, rows.shape[0], 4096):
        r1 = min(rows.shape[0], r0 + 4096)
        block = rng.standard_normal((r1 - r0, n_in), dtype=np.float32)
        block *= scale
        rows[r0:r1] = block
    return out


def _writer(s: Shape, path: Path, file_type: int):
    """A GGUFWriter for path with the hyperparameters and the stand-in vocabulary of shape s.

    Keys as llama.cpp's converter writes them: the qwen3 set; qwen3vl adds rope.dimension_sections
    (int32[4]) and n_deepstack_layers; qwen3moe adds expert_count, expert_used_count and
    expert_feed_forward_length (feed_forward_length stays config.json's intermediate_size).
    """
    import gguf

    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"{s.label}-shape (random weights)")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    if s.rope_sections:
        w.add_rope_dimension_sections(list(s.rope_sections))
    w.add_rope_freq_base(float(s.rope_base))
    w.add_layer_norm_rms_eps(float(s.norm_eps))
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_file_type(file_type)
    if s.n_expert:
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.arch == "qwen3vl":
        w.add_num_deepstack_layers(s.n_deepstack)
    tokens, types, merges = stand_in_vocab(s.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if s.n_vocab > EOS_ID:   # Qwen's special ids (a smaller test vocabulary has none)
        w.add_eos_token_id(EOS_ID)
        w.add_pad_token_id(PAD_ID)
        w.add_bos_token_id(PAD_ID)
    w.add_add_bos_token(False)
    return w


def _write(w, plan, data, path: Path) -> None:
    """Write the tensors of plan; data(i) gives the i-th tensor's array (one in memory at a time)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.monotonic()
    for i, (name, shape, kind) in enumerate(plan):
        w.write_tensor_data(data(i))
        if kind == "embd" or name.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
            log(f"  {path.name}: {name} written ({time.monotonic() - t0:.0f} s)")
    w.close()


def write_f16(s: Shape, path: Path, seed: int = 0) -> None:
    """Write the random-weight F16 GGUF of shape s to path, one tensor in memory at a time."""
    import gguf

    rng = np.random.default_rng(seed)
    plan = tensor_plan(s)
    w = _writer(s, path, int(gguf.LlamaFileType.MOSTLY_F16))
    for name, shape, kind in plan:
        dtype = np.dtype(np.float16 if kind in ("embd", "mat") else np.float32)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    _write(w, plan, lambda i: _values(rng, plan[i][1], plan[i][2], s.n_embd), path)


def q4_k_m_types(s: Shape) -> list[str]:
    """The type of every tensor of tensor_plan(s) under llama.cpp's Q4_K_M recipe (see kquant_blocks)."""
    kq = _kquant_blocks()
    return [kq.q4_k_m_type(name, s.n_layer, s.n_expert) for name, _, _ in tensor_plan(s)]


def write_q4_k_m(s: Shape, path: Path, seed: int = 0) -> None:
    """Write shape s directly as a Q4_K_M GGUF: random Q4_K / Q6_K blocks (weights of about the F16
    files' standard deviation), F32 norms and router, the types from q4_k_m_types."""
    import gguf

    kq = _kquant_blocks()
    rng = np.random.default_rng(seed)
    plan, types = tensor_plan(s), q4_k_m_types(s)
    w = _writer(s, path, int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    for (name, shape, kind), t in zip(plan, types):
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            nbytes = shape[-1] // kq.QK_K * kq.BLOCK_BYTES[t]
            w.add_tensor_info(name, shape[:-1] + (nbytes,), np.dtype(np.uint8),
                              int(np.prod(shape[:-1])) * nbytes, raw_dtype=gguf.GGMLQuantizationType[t])

    def data(i: int) -> np.ndarray:
        name, shape, kind = plan[i]
        if types[i] == "F32":
            return _values(rng, shape, kind, s.n_embd).astype(np.float32)
        n_rows = int(np.prod(shape[:-1]))
        return kq.random_blocks(rng, types[i], n_rows, shape[-1], _std(kind, shape, s.n_embd))

    _write(w, plan, data, path)


def _kquant_blocks():
    """bench/kquant_blocks.py, loaded by path (this file runs as a script and is loaded by path)."""
    mod = sys.modules.get("kquant_blocks")
    if mod is None:
        spec = importlib.util.spec_from_file_location("kquant_blocks", Path(__file__).with_name("kquant_blocks.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kquant_blocks"] = mod
        spec.loader.exec_module(mod)
    return mod


# ---- llama.cpp's quantizer ------------------------------------------------------------------------

_LLAMA_LOG: list = []   # the log callback installed by quiet_llama_cpp (kept alive while it is set)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise ShapesError(
            f"llama-cpp-python is not installed ({e}); it provides llama.cpp's quantizer. Install the "
            f"bench extra: `pip install -e .[bench]` (or a prebuilt wheel: pip install "
            f"llama_cpp_python-*.whl)") from e
    return llama_cpp


def quiet_llama_cpp() -> None:
    """Drop llama.cpp's log (a line per tensor while quantizing); errors still reach us as status codes."""
    lc = _llama_cpp()
    if not _LLAMA_LOG:
        _LLAMA_LOG.append(lc.llama_log_callback(lambda level, text, user_data: None))
        lc.llama_log_set(_LLAMA_LOG[0], ctypes.c_void_p(0))


def quantize(src: Path, dst: Path, type_name: str, allow_requantize: bool = False) -> None:
    """llama_model_quantize(src -> dst) with default parameters and the ftype of type_name.

    Writes to dst + ".part" and renames, so an interrupted run leaves no file that looks finished.
    Raises ShapesError when llama.cpp returns non-zero.
    """
    lc = _llama_cpp()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, TYPES[type_name])
    params.allow_requantize = allow_requantize
    params.nthread = os.cpu_count() or 1
    part = dst.with_name(dst.name + ".part")
    t0 = time.monotonic()
    rc = lc.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0:
        part.unlink(missing_ok=True)
        raise ShapesError(f"llama_model_quantize({src.name} -> {type_name}) returned {rc}")
    part.rename(dst)
    log(f"  {dst.name}: {dst.stat().st_size / 2**20:.0f} MiB ({time.monotonic() - t0:.0f} s)")


def make_shape(s: Shape, types: Sequence[str], directory: Path, seed: int, keep_f16: bool) -> Iterator[Path]:
    """Yield the path of shape s in every type, writing those that are missing.

    Shapes with experts (s.direct) are written directly as Q4_K_M (write_q4_k_m), the only type
    they have; the others as F16, then quantized by llama.cpp.
    """
    label = s.label
    if s.direct and list(types) != ["Q4_K_M"]:
        raise ShapesError(f"{label} is written directly in Q4_K_M blocks; it has no type {', '.join(types)}")
    todo = [t for t in types if not shape_path(s, t, directory).is_file()]
    for t in types:
        if t not in todo:
            log(f"{label} {t}: exists, kept")
    if s.direct:
        for t in todo:
            dst = shape_path(s, t, directory)
            log(f"{label}: writing {dst.name} directly in quantized blocks")
            part = dst.with_name(dst.name + ".part")
            write_q4_k_m(s, part, seed)
            part.rename(dst)
            log(f"  {dst.name}: {dst.stat().st_size / 2**20:.0f} MiB")
        yield from (shape_path(s, t, directory) for t in types)
        return
    f16 = directory / f"{label}-shape.F16.gguf"
    if todo:
        _llama_cpp()   # fail before spending minutes on the F16 file
        if not f16.is_file():
            log(f"{label}: writing the F16 file ({f16.name})")
            part = f16.with_name(f16.name + ".part")
            write_f16(s, part, seed)
            part.rename(f16)
    for t in types:
        dst = shape_path(s, t, directory)
        if t in todo:
            log(f"{label}: quantizing to {t}")
            quantize(f16, dst, t)
        yield dst
    if todo and not keep_f16:
        f16.unlink(missing_ok=True)


def make_smollm2(types: Sequence[str], directory: Path) -> Iterator[Path]:
    """Requantize the default SmolLM2 Q4_1 file to every type (allow_requantize)."""
    todo = [t for t in types if not smollm2_path(t, directory).is_file()]
    src = None
    if todo:
        _llama_cpp()
        spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
        fm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fm)
        try:
            src = Path(fm.fetch())
        except (RuntimeError, OSError) as e:
            raise ShapesError(f"the default model is unavailable: {e} (run scripts/fetch_model.py)") from e
    for t in types:
        dst = smollm2_path(t, directory)
        if t in todo:
            log(f"SmolLM2: requantizing {src.name} to {t}")
            quantize(src, dst, t, allow_requantize=True)
        else:
            log(f"SmolLM2 {t}: exists, kept")
        yield dst


def _names(arg: str, known: Sequence[str], what: str) -> list[str]:
    out = [x.strip() for x in arg.split(",") if x.strip()]
    for x in out:
        if x not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {x!r} (known: {', '.join(known)})")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=lambda a: _names(a, list(SHAPES), "shape"), default=None,
                    help=f"comma-separated shapes from {', '.join(SHAPES)} (default: 0.6B,1.7B)")
    ap.add_argument("--types", type=lambda a: _names(a, list(TYPES), "type"), default=None,
                    help=f"comma-separated llama.cpp file types from {', '.join(TYPES)} "
                         f"(default: Q4_K_M,Q8_0; Q4_K_M only for the 30B-A3B shapes)")
    ap.add_argument("--smollm2", action="store_true",
                    help="also requantize the default SmolLM2-135M-Instruct Q4_1 to --types")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: $ECHOSPEC_CACHE/bench or ~/.cache/echospec/bench)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 intermediates")
    ap.add_argument("--list", action="store_true", help="print the paths only; make nothing")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log (a line per tensor)")
    args = ap.parse_args(argv)
    if args.shapes is None and args.types is None and not args.smollm2:
        # the default set: what the table needs first
        args.plan = [("smollm2", ["Q4_K_M", "Q8_0"]), ("0.6B", ["Q4_K_M", "Q8_0"]), ("1.7B", ["Q4_K_M"])]
    else:
        shapes = args.shapes if args.shapes is not None else ["0.6B", "1.7B"]
        types = args.types or ["Q4_K_M", "Q8_0"]
        direct = [s for s in shapes if SHAPES[s].direct]
        if direct and args.types is not None and args.types != ["Q4_K_M"]:
            ap.error(f"{', '.join(direct)}: written directly as Q4_K_M, the only --types they take")
        args.plan = ([("smollm2", types)] if args.smollm2 else []) + \
            [(s, ["Q4_K_M"] if SHAPES[s].direct else types) for s in shapes]
    args.out = args.out or out_dir()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.list and not args.verbose:
            try:
                quiet_llama_cpp()
            except ShapesError:
                pass   # reported by the first step that needs llama.cpp, if any does
        for what, types in args.plan:
            if args.list:
                paths = [smollm2_path(t, args.out) if what == "smollm2" else shape_path(SHAPES[what], t, args.out)
                         for t in types]
            elif what == "smollm2":
                paths = make_smollm2(types, args.out)
            else:
                paths = make_shape(SHAPES[what], types, args.out, args.seed, args.keep_f16)
            for p in paths:
                print(p, flush=True)
    except ShapesError as e:
        print(f"qwen3_shapes: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
