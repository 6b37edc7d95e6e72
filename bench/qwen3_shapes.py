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

Shapes (from the models' config.json): 8 KV heads, head_dim 128, vocabulary 151936, tied head (no
output.weight), RoPE base 1e6 (NEOX layout), RMSNorm eps 1e-6, per-head RMSNorm of q and k.

    shape   hidden   ffn   layers  heads
    0.6B     1024    3072    28     16
    1.7B     2048    6144    28     16
    4B       2560    9728    36     32

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
    python bench/qwen3_shapes.py --list                           # the paths, made or not
Output: $ECHOSPEC_CACHE/bench/ (default ~/.cache/echospec/bench/), files named
qwen3-0.6B-shape.Q4_K_M.gguf, SmolLM2-135M-Instruct.Q8_0.gguf, ...; existing files are kept.
The paths of the files are printed on stdout, one a line; progress goes to stderr.
Exit status: 0; 2 with a message when llama-cpp-python or the default model is missing.

Needs: numpy, gguf, and llama-cpp-python (the `bench` extra). Disk: the F16 intermediate is 1.2 GB
(0.6B), 3.4 GB (1.7B), 8.0 GB (4B); memory: the largest tensor, token_embd (151936 x hidden,
float32 while it is drawn, about 1.6 GB for 4B).
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
    """Hyperparameters of one Qwen3 size (config.json names in comments)."""
    name: str
    n_embd: int        # hidden_size
    n_ff: int          # intermediate_size
    n_layer: int       # num_hidden_layers
    n_head: int        # num_attention_heads
    n_head_kv: int = 8     # num_key_value_heads
    head_dim: int = 128
    n_vocab: int = 151936
    rope_base: float = 1e6
    norm_eps: float = 1e-6
    n_ctx_train: int = 40960


SHAPES = {s.name: s for s in (
    Shape("0.6B", n_embd=1024, n_ff=3072, n_layer=28, n_head=16),
    Shape("1.7B", n_embd=2048, n_ff=6144, n_layer=28, n_head=16),
    Shape("4B", n_embd=2560, n_ff=9728, n_layer=36, n_head=32),
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
    return directory / f"qwen3-{shape.name}-shape.{type_name}.gguf"


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


# ---- the F16 file -------------------------------------------------------------------------------

def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape (n_out, n_in) or (n,), kind) of every tensor, in file order.

    kind: "embd" (token_embd, also the tied head), "mat" (block matrices), "norm" (F32 vectors).
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
            (p + "ffn_gate.weight", (s.n_ff, s.n_embd), "mat"),
            (p + "ffn_up.weight", (s.n_ff, s.n_embd), "mat"),
            (p + "ffn_down.weight", (s.n_embd, s.n_ff), "mat"),
        ]
    plan.append(("output_norm.weight", (s.n_embd,), "norm"))
    return plan


def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: str, n_embd: int) -> np.ndarray:
    """Random values for one tensor: F16 matrices, F32 norms.

    Scales keep activations finite and O(1) through every layer: block matrices
    N(0, 1) * 0.7 / sqrt(n_in); token_embd N(0, 1) * 2 / sqrt(n_embd) (so the tied head's logits
    have a std of about 2); norm weights 1 + 0.1 N(0, 1). Rows are drawn in chunks of 4096 so the
    float32 scratch stays small.
    """
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape[0], dtype=np.float32)).astype(np.float32)
    n_out, n_in = shape
    scale = np.float32(2.0 / np.sqrt(n_embd) if kind == "embd" else 0.7 / np.sqrt(n_in))
    out = np.empty(shape, dtype=np.float16)
    for r0 in range(0, n_out, 4096):
        r1 = min(n_out, r0 + 4096)
        block = rng.standard_normal((r1 - r0, n_in), dtype=np.float32)
        block *= scale
        out[r0:r1] = block
    return out


def write_f16(s: Shape, path: Path, seed: int = 0) -> None:
    """Write the random-weight F16 GGUF of shape s to path, one tensor in memory at a time."""
    import gguf

    rng = np.random.default_rng(seed)
    plan = tensor_plan(s)
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name(f"qwen3-{s.name}-shape (random weights)")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(float(s.rope_base))
    w.add_layer_norm_rms_eps(float(s.norm_eps))
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
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
    for name, shape, kind in plan:
        dtype = np.float32 if kind == "norm" else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.monotonic()
    for i, (name, shape, kind) in enumerate(plan):
        w.write_tensor_data(_values(rng, shape, kind, s.n_embd))
        if kind != "norm" and (i == 0 or name.endswith("ffn_down.weight")):
            log(f"  {path.name}: {name} written ({time.monotonic() - t0:.0f} s)")
    w.close()


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
    """Yield the path of shape s in every type, writing those that are missing."""
    todo = [t for t in types if not shape_path(s, t, directory).is_file()]
    for t in types:
        if t not in todo:
            log(f"qwen3-{s.name} {t}: exists, kept")
    f16 = directory / f"qwen3-{s.name}-shape.F16.gguf"
    if todo:
        _llama_cpp()   # fail before spending minutes on the F16 file
        if not f16.is_file():
            log(f"qwen3-{s.name}: writing the F16 file ({f16.name})")
            part = f16.with_name(f16.name + ".part")
            write_f16(s, part, seed)
            part.rename(f16)
    for t in types:
        dst = shape_path(s, t, directory)
        if t in todo:
            log(f"qwen3-{s.name}: quantizing to {t}")
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
                         f"(default: Q4_K_M,Q8_0)")
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
        args.plan = ([("smollm2", types)] if args.smollm2 else []) + [(s, types) for s in shapes]
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
