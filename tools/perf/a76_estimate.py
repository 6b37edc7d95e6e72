#!/usr/bin/env python3
"""A76 estimate from the machine code: T and V(K)/T of Qwen3 Q4_K_M models on the RK3588.

No A76 board is at hand, so the time of a decode step (T) and of a verify over 5 tokens (V(4)) is
estimated from the aarch64 machine code of the NEON kernels:

  1. kernel cycles: engine_c/src/quant_neon.c is compiled as the neon-a76 build does
     (aarch64-linux-gnu-gcc -O3 -mcpu=cortex-a76.cortex-a55 -ffp-contract=off -S); in each packed
     kernel (p_q4_0 ... p_q6_k) the innermost loops are found (a backward branch; no loop inside)
     and told apart by their sdot count: one iteration is one record quarter (4 weight rows x one
     block, or one super-block for the K types) for a tile of nt activation rows, so
     sdot = 8 nt (Q4_0, Q4_1, Q8_0) or 64 nt (K types). Each loop body goes through llvm-mca;
     cycles per record (16 rows) = 4 x cycles per iteration.
     Scheduling models: LLVM's "cortex-a76" is the Cortex-A57 model in LLVM 14 and 19 (3-wide,
     one load pipe, 128-bit ASIMD as two 64-bit halves): a pessimistic bound. LLVM 19's
     "neoverse-n1" model describes the Neoverse N1, the server version of the A76 core (same
     pipelines: 2 load, 2 ASIMD V0/V1, 3 integer). The step estimate is printed for each model
     found (the N1 one is the estimate; the A57 one a pessimistic bound).
  2. attention loops: engine_c/src/attention.c is compiled the same way; the inner loops of the
     attention over the F16 KV cache (block_partial, inlined into attend_unit: the score slices of
     1..4 queries, the p.v accumulation of 1..2 queries, expv) go through llvm-mca too; their
     cost per attended position follows from how a unit groups the queries (attention_per_position).
  3. instructions per forward (--count MODEL.gguf, or --insns from an earlier run):
     tools/perf/a76_count.c (aarch64, one thread) runs under qemu-aarch64 with tools/perf/a76_insn_plugin.so,
     which counts executed instructions and prints the count at marker system calls the program
     makes around its N = 1 and N = 5 forwards (after the prefill). A depth not counted for one
     shape is derived from another shape with the same attention (derive_counts).
  4. the step model, per depth: per matrix of the Qwen3 shape (types as llama.cpp's Q4_K_M rule
     gives them), records x cycles per record at the tile size the driver uses (N = 1: nt 1;
     N = 5: one tile of 5), over 4 threads at 2.4 GHz, against the memory floor bytes / 20 GB/s
     (the RK3588's STREAM figure); a matrix takes the larger of the two (roofline per matrix);
     the attention likewise takes the larger of its loops' cycles over 4 threads and the F16 KV
     cache's bytes / 20 GB/s; plus the rest of the step (norms, RoPE, activation quantization,
     SwiGLU, the argmax, loop overheads) = the qemu count minus the matmul and attention loops'
     instructions (else a rough count, rest_instructions), at 1 and at 2 instructions per cycle
     over the 4 threads: a range, since that code was not put through llvm-mca.
  5. more models (--models: Qwen3-VL-2B and -8B's text decoders, Qwen3-30B-A3B) and a speculation
     table: T, V(K)/T, decode tokens/s, and the smallest per-token acceptance p for which some
     K in 1..8 pays (V(K) + overhead < (p + ... + p^K + 1) T). A call over N = K + 1 rows runs
     the packed kernels in tiles of at most 6 rows (9 rows: 5 + 4). In a MoE layer the router
     (F32) takes the F32 kernel's loop, and each of the two expert dispatches (gate and up of every
     chosen expert; down) takes the larger of its summed compute and its bytes, over the expected
     distinct experts per layer: independent uniform routing, 128 (1 - (1 - 8/128)^N), and, with
     --measure-experts (or --experts), the count the engine reports on a MoE file; the rows per
     chosen expert follow a zero-truncated Poisson of mean 8 N / distinct.

Run (from the repository root; needs gcc-aarch64-linux-gnu, llvm-mca-14 and/or -19, and for --count
qemu-user and the Q4_K_M files bench/qwen3_shapes.py writes):
    python3 tools/perf/a76_estimate.py                      # loops and the estimate, rest counted roughly
    python3 tools/perf/a76_estimate.py --count ~/.cache/echospec/bench/qwen3-0.6B-shape.Q4_K_M.gguf \
        --count ~/.cache/echospec/bench/qwen3-1.7B-shape.Q4_K_M.gguf --count-depths 64
    python3 tools/perf/a76_estimate.py --insns Qwen3-0.6B 1 64 263.54 ...   # counts from an earlier run
    .venv/bin/python tools/perf/a76_estimate.py --models new --depths 64,2048 \
        --measure-experts ~/.cache/echospec/bench/qwen3moe-30B-A3B-L8-shape.Q4_K_M.gguf
    python3 tools/perf/a76_estimate.py --check    # only: are the loops still found (.ci/aarch64.sh runs it)
Prints the per-record cycle table and the estimates (markdown). These are estimates, not
measurements: see bench/README.md, "A76 estimate".
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE = ROOT / "engine_c"
CC = "aarch64-linux-gnu-gcc"
CFLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fPIC", "-D_GNU_SOURCE", "-pthread", "-mcpu=cortex-a76.cortex-a55",
          f"-I{ENGINE / 'include'}", f"-I{ENGINE / 'src'}"]
TYPES = ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"]
SDOT_PER_ROW = {"q4_0": 8, "q4_1": 8, "q8_0": 8, "q4_k": 64, "q5_k": 64, "q6_k": 64}
ELEMS = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210}   # per block, one row

GHZ = 2.4
THREADS = 4
STREAM_GBS = 20.0
PTILE = 6   # NEON packed tile (quant_neon.c)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_asm(src: Path, out: Path) -> None:
    """src to aarch64 assembly with the neon-a76 build's flags (engine_c/Makefile)."""
    cmd = [CC, *CFLAGS, "-S", str(src), "-o", str(out)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)


def inner_loops(asm: str) -> dict[str, dict[int, list[str]]]:
    """{type: {nt: loop body instructions}} of the packed kernels' innermost loops."""
    out: dict[str, dict[int, list[str]]] = {}
    for t in TYPES:
        for body in innermost_loops(asm, f"p_{t}"):
            sd = sum(1 for x in body if x.startswith("sdot"))
            if sd == 0 or sd % SDOT_PER_ROW[t]:
                continue
            nt = sd // SDOT_PER_ROW[t]
            if nt not in out.setdefault(t, {}) or len(body) > len(out[t][nt]):
                out[t][nt] = body
    for body in innermost_loops(asm, "k_f32"):   # the F32 kernel (the MoE router): 16 weights x one row
        ops = [x.split()[0] for x in body]
        if ops.count("fmul") == 4 and ops.count("fadd") == 4 and "bl" not in ops:
            out.setdefault("f32", {1: body})
    return out


def mca_cycles(body: list[str], mca: str, cpu: str, tmp: Path) -> float:
    """Cycles per iteration of the loop body (llvm-mca, 200 iterations)."""
    src = tmp / "loop.s"
    src.write_text("\n".join(body) + "\n")
    r = subprocess.run([mca, "-mtriple=aarch64", f"-mcpu={cpu}", "-iterations=200", str(src)],
                       capture_output=True, text=True, check=True)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    return int(m.group(1)) / 200.0


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers of n whose attn_v / ffn_down Q4_K_M puts in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def llama_q4_k_m_plan(s: dict) -> list[tuple[str, str, int, int, int]]:
    """(name, type, n_in, n_out, count) of the matrices of a Q4_K_M step of shape s (count: layers).

    llama.cpp's rule (llama_tensor_get_type, LLAMA_FTYPE_MOSTLY_Q4_K_M): attn_v and ffn_down (the
    experts' ffn_down_exps too) in Q6_K where use_more_bits(i, n_layer), else Q4_K; the output head
    (the tied token_embd, or output.weight) in Q6_K; the router ffn_gate_inp stays F32; every other
    matrix Q4_K (the untied token_embd is Q4_K too, but a step reads one row of it: not counted).
    The expert counts and the 128-expert model's types checked against the files qwen3_shapes.py
    makes. Expert matrices are named "expert ..." with count = layers; a step reads them only for
    the experts its rows chose (moe_ffn_ms)."""
    layers = s["layers"]
    n6 = sum(use_more_bits(i, layers) for i in range(layers))
    hidden, qd, kvd = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    plan = [
        ("attn_q", "q4_k", hidden, qd, layers),
        ("attn_k", "q4_k", hidden, kvd, layers),
        ("attn_v", "q6_k", hidden, kvd, n6),
        ("attn_v", "q4_k", hidden, kvd, layers - n6),
        ("attn_output", "q4_k", qd, hidden, layers),
    ]
    if s.get("n_expert"):
        ff = s["ffn_exp"]
        plan += [
            ("router ffn_gate_inp", "f32", hidden, s["n_expert"], layers),
            ("expert ffn_gate", "q4_k", hidden, ff, layers),
            ("expert ffn_up", "q4_k", hidden, ff, layers),
            ("expert ffn_down", "q6_k", ff, hidden, n6),
            ("expert ffn_down", "q4_k", ff, hidden, layers - n6),
        ]
    else:
        plan += [
            ("ffn_gate", "q4_k", hidden, s["ffn"], layers),
            ("ffn_up", "q4_k", hidden, s["ffn"], layers),
            ("ffn_down", "q6_k", s["ffn"], hidden, n6),
            ("ffn_down", "q4_k", s["ffn"], hidden, layers - n6),
        ]
    plan.append(("output (tied token_embd)" if s.get("tied", True) else "output", "q6_k", hidden, s["vocab"], 1))
    return plan


# Shapes (config.json of each model). The Qwen3-VL entries are their text decoders (the vision
# encoder runs once per image, not per step); Qwen3-VL-2B's decoder has Qwen3-1.7B's shape.
SHAPES = {
    "Qwen3-0.6B": dict(hidden=1024, ffn=3072, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "Qwen3-1.7B": dict(hidden=2048, ffn=6144, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "Qwen3-VL-2B": dict(hidden=2048, ffn=6144, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "Qwen3-VL-8B": dict(hidden=4096, ffn=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                        tied=False),
    "Qwen3-30B-A3B": dict(hidden=2048, ffn=0, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                          tied=False, n_expert=128, n_expert_used=8, ffn_exp=768),
}
DEFAULT_MODELS = "Qwen3-0.6B,Qwen3-1.7B"
NEW_MODELS = "Qwen3-VL-2B,Qwen3-VL-8B,Qwen3-30B-A3B"
FILE_SHAPES = [("qwen3vl-2B", "Qwen3-VL-2B"), ("qwen3vl-8B", "Qwen3-VL-8B"), ("qwen3-1.7B", "Qwen3-1.7B"),
               ("qwen3-0.6B", "Qwen3-0.6B")]   # --count: shape from the name qwen3_shapes.py gives a file


def shape_of_file(path: Path) -> str:
    for key, shape in FILE_SHAPES:
        if path.name.startswith(key):
            return shape
    if "1.7B" in path.name:
        return "Qwen3-1.7B"
    if "0.6B" in path.name:
        return "Qwen3-0.6B"
    raise SystemExit(f"a76_estimate: --count {path.name}: shape not known from the name "
                     f"(known: {', '.join(k for k, _ in FILE_SHAPES)})")


def rest_instructions(s: dict, n: int) -> float:
    """Instructions of a step outside the matmul and attention inner loops, a rough count used when
    no qemu count is given: per layer and token 2 RMSNorms and the q/k norms and RoPE (~10
    instructions per element), activation quantization of 4 inputs (~2 per element), SwiGLU (~20
    per element), and the argmax over the vocabulary (~1 per logit). A MoE layer quantizes and
    SwiGLUs per chosen expert, and adds per token the router's softmax (~30 per expert), the top-k
    (~8 per expert and pick), the gather of the rows and the weighted sum (~4 per element and
    expert)."""
    if s.get("n_expert"):
        k, ff = s["n_expert_used"], s["ffn_exp"]
        ffn = (2 * s["hidden"] + 2 * k * (s["hidden"] + ff) + 20 * k * ff + 30 * s["n_expert"]
               + 8 * k * s["n_expert"] + 4 * k * s["hidden"])
    else:
        ffn = 2 * (s["hidden"] + s["ffn"]) + 20 * s["ffn"]
    per_tok_layer = (10 * (2 * s["hidden"] + (s["heads"] + s["kv_heads"]) * s["head_dim"])
                     + 2 * (s["hidden"] + s["heads"] * s["head_dim"]) + ffn)
    return n * (s["layers"] * per_tok_layer + s["vocab"])


def kv_bytes(s: dict, depth: int) -> int:
    """Bytes of the F16 KV cache a step reads at this depth (K and V of every layer and KV head)."""
    return s["layers"] * s["kv_heads"] * s["head_dim"] * 2 * 2 * depth


def innermost_loops(asm: str, fn: str) -> list[list[str]]:
    """The bodies of the innermost loops (a backward branch with no loop inside) of function fn."""
    lines = asm.split("\n")
    if f"{fn}:" not in lines:
        return []
    a = lines.index(f"{fn}:")
    b = next(i for i in range(a, len(lines)) if lines[i].strip().startswith(".size"))
    labels = {}
    for i in range(a, b):
        m = re.match(r"^(\.L\w+):", lines[i])
        if m:
            labels[m.group(1)] = i
    loops = []
    for i in range(a, b):
        f = lines[i].split()
        if f and (f[0].startswith("b") or f[0] in ("cbz", "cbnz", "tbz", "tbnz")):
            tgt = f[-1]
            if tgt in labels and labels[tgt] < i:
                loops.append((labels[tgt], i))
    inner = [L for L in loops if not any(o != L and L[0] <= o[0] and o[1] <= L[1] for o in loops)]
    return [[x.strip() for x in lines[s:e + 1] if x.startswith("\t") and not x.strip().startswith((".", "//"))]
            for s, e in inner]


SCORE_Q, AXPY_Q, AXPY_D, AW = 4, 2, 32, 4   # attention.c's NEON values


def attention_loops(asm: str) -> dict[tuple[str, int], list[str]]:
    """The attention's inner loops in attention.c's NEON build (block_partial, inlined into
    attend_unit), told apart by their F16 conversions and fused multiply-adds:
      ("scores", nj): one dimension d of 2 * AW = 8 positions for nj queries: 2 fcvtl, 2 nj fmla;
      ("axpy", nj):  one position of AXPY_D = 32 dimensions for nj queries: 8 fcvtl, 8 nj fmla;
      ("exp", AW):   expv on AW = 4 scores (exp_sub_row): fcvtzs and scvtf, no fcvtl.
    (one fcvtl converts 4 halves: an AW-lane load is AW / 4 of them)"""
    out: dict[tuple[str, int], list[str]] = {}
    # block_partial inlined into attend_unit, or kept apart (the Q8_0 KV cache's kernels made it larger)
    for body in innermost_loops(asm, "attend_unit") + innermost_loops(asm, "block_partial"):
        ops = [x.split()[0] for x in body]
        cv, mul = sum(o.startswith("fcvtl") for o in ops), ops.count("fmla")
        sv = 2 * AW // 4   # fcvtl (and fmla per query) of a score step
        if cv == sv and mul % sv == 0 and 1 <= mul // sv <= SCORE_Q:
            key = ("scores", mul // sv)
        elif cv == 8 and mul % 8 == 0 and 1 <= mul // 8 <= AXPY_Q:
            key = ("axpy", mul // 8)
        elif cv == 0 and "fcvtzs" in ops and "scvtf" in ops:
            key = ("exp", AW)
        else:
            continue
        if key not in out or len(body) > len(out[key]):
            out[key] = body
    return out


def attention_per_position(s: dict, n: int, per_iter: dict) -> float:
    """Cycles (or instructions) of the attention loops per layer, KV head and attended position of a
    call over n tokens, from per_iter {loop key: cycles per iteration}: the n * (heads / kv_heads)
    queries of a KV group (one unit) take score slices of up to SCORE_Q queries (head_dim / 16
    iterations each per 16 positions), axpy pairs (head_dim / AXPY_D iterations each) and expv
    over their scores (one iteration per AW)."""
    nq = n * (s["heads"] // s["kv_heads"])
    hd = s["head_dim"]
    slices = [SCORE_Q] * (nq // SCORE_Q) + ([nq % SCORE_Q] if nq % SCORE_Q else [])
    c = sum(per_iter[("scores", j)] for j in slices) * hd / (2 * AW)
    # the pair loop, where the compiler did not keep it innermost: two single-query iterations
    pair = per_iter.get(("axpy", AXPY_Q), AXPY_Q * per_iter[("axpy", 1)])
    c += ((nq // AXPY_Q) * pair + (nq % AXPY_Q) * per_iter[("axpy", 1)]) * hd / AXPY_D
    c += nq * per_iter[("exp", AW)] / AW
    return c


def count_forward(model: Path, depth: int, ns: list[int], reps: int, tmp: Path) -> dict[int, int]:
    """{N: guest instructions of one forward over N tokens} at KV depth `depth`, from one qemu-aarch64
    run of tools/perf/a76_count.c with the counting plugin (it prints the count at marker system calls
    around each N's REPS forwards; the load and the prefill fall outside)."""
    lib = ENGINE / "build" / "aarch64-neon-a76" / "libechospec_engine.a"
    subprocess.run(["make", "-s", "-C", str(ENGINE), f"-j{os.cpu_count()}", "BUILD=build/aarch64-neon-a76",
                    f"CC={CC}", "SIMD=neon-a76", "build/aarch64-neon-a76/libechospec_engine.a"], check=True)
    exe, plugin = tmp / "a76_count", tmp / "a76_insn_plugin.so"
    if not exe.exists():
        subprocess.run([CC, "-O2", f"-I{ENGINE / 'include'}", str(HERE / "a76_count.c"), str(lib),
                        "-o", str(exe), "-lm", "-pthread"], check=True)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(HERE / "a76_insn_plugin.c"), "-o",
                        str(plugin)], check=True)
    cmd = ["nice", "qemu-aarch64", "-cpu", "cortex-a76", "-L", "/usr/aarch64-linux-gnu", "-plugin", str(plugin),
           str(exe), str(model), str(depth), str(reps), *map(str, ns)]
    log(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    marks = [(int(a), int(b)) for a, b in re.findall(r"mark (\d+) insns (\d+)", r.stderr)]
    out = {}
    for k, n in enumerate(ns):
        (n0, c0), (n1, c1) = marks[2 * k], marks[2 * k + 1]
        assert n0 == n1 == n, marks
        out[n] = (c1 - c0) // reps
        log(f"  qemu: {model.name} depth {depth} N {n}: {out[n]} instructions per forward")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=Path, action="append", default=[],
                    help="a Qwen3-shaped Q4_K_M GGUF to count instructions per forward on under qemu "
                         "(the shape is told from its name: 0.6B or 1.7B); may be repeated")
    ap.add_argument("--count-depths", default=None,
                    help="comma-separated depths of the qemu runs (default: --depths); each run prefills "
                         "its depth, which is most of its time under qemu")
    ap.add_argument("--reps", type=int, default=1, help="forwards per N in a qemu run (the count is exact: 1)")
    ap.add_argument("--insns", nargs=4, action="append", default=[], metavar=("SHAPE", "N", "DEPTH", "MILLIONS"),
                    help="instructions per forward counted before (e.g. Qwen3-0.6B 1 64 263.54), instead of "
                         "--count; may be repeated")
    ap.add_argument("--depths", default="64,2048", help="comma-separated KV depths of the estimate")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated shapes of the estimate, or 'new' ({NEW_MODELS}) or 'all' "
                         f"(of {', '.join(SHAPES)}; default {DEFAULT_MODELS})")
    ap.add_argument("--ks", default="1,2,4,8", help="drafts K whose V(K)/T the speculation table shows")
    ap.add_argument("--overhead", type=float, default=0.5,
                    help="ms a verify costs besides V(K) (drafting, the service), in the gain condition")
    ap.add_argument("--experts", nargs=3, action="append", default=[], metavar=("SHAPE", "N", "DISTINCT"),
                    help="distinct experts per layer of a call over N tokens, measured before (e.g. "
                         "Qwen3-30B-A3B 5 14.9); the speculation table shows them beside uniform routing")
    ap.add_argument("--measure-experts", type=Path, default=None,
                    help="a qwen3moe GGUF (e.g. the layer-reduced qwen3moe-30B-A3B-L8-shape.Q4_K_M.gguf) "
                         "to measure distinct experts per layer on with the engine (pseudo-random tokens "
                         "at depth 64, N = 1..9), for Qwen3-30B-A3B; needs the built package")
    ap.add_argument("--measure-reps", type=int, default=24, help="forwards per N of --measure-experts")
    ap.add_argument("--check", action="store_true",
                    help="only compile and check that every loop the estimate needs is found (no llvm-mca, "
                         "no qemu); exit 1 with the missing ones listed otherwise")
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    names = {"all": list(SHAPES), "new": NEW_MODELS.split(",")}.get(args.models, args.models.split(","))
    unknown = [x for x in names if x not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    ks = [int(k) for k in args.ks.split(",")]
    if any(not 1 <= k <= 8 for k in ks):
        ap.error("--ks: K in 1..8")
    count_depths = [int(d) for d in args.count_depths.split(",")] if args.count_depths else depths

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        compile_asm(ENGINE / "src" / "quant_neon.c", tmp / "quant_neon.s")
        compile_asm(ENGINE / "src" / "attention.c", tmp / "attention.s")
        loops = inner_loops((tmp / "quant_neon.s").read_text())
        aloops = attention_loops((tmp / "attention.s").read_text())
        missing = [f"{t} nt {nt}" for t in TYPES for nt in range(1, PTILE + 1) if nt not in loops.get(t, {})]
        missing += [] if "f32" in loops else ["f32 (k_f32)"]
        # ("axpy", AXPY_Q) may be missing: it is then costed as AXPY_Q single-query iterations
        missing += [f"attention {k[0]} {k[1]}" for k in [("scores", j) for j in range(1, SCORE_Q + 1)]
                    + [("axpy", 1), ("exp", AW)] if k not in aloops]
        if ("axpy", AXPY_Q) not in aloops:
            log(f"a76_estimate: no {AXPY_Q}-query axpy loop in the NEON build (not innermost since the "
                f"Q8_0 KV kernels); costed as {AXPY_Q} single-query iterations")
        if missing:
            log("a76_estimate: loops not found in the NEON build's assembly (the kernels changed; update "
                "inner_loops / attention_loops): " + ", ".join(missing))
            return 1
        if args.check:
            log(f"a76_estimate: all {sum(len(v) for v in loops.values())} matmul and {len(aloops)} attention "
                "loops found")
            return 0
        models = [(m, c) for m, c in (("llvm-mca-19", "neoverse-n1"), ("llvm-mca-14", "cortex-a76"))
                  if shutil.which(m)]
        if not models:
            log("no llvm-mca-14 or llvm-mca-19 on PATH")
            return 2
        cyc: dict[tuple[str, str, int], float] = {}
        print("## Cycles per packed record (16 rows x one block / super-block), per activation row tile\n")
        print("| type | nt | instr/record | " + " | ".join(f"{m} {c} cyc/record" for m, c in models)
              + " | bytes/record |")
        print("|---|---|---|" + "---|" * len(models) + "---|")
        for t in TYPES:
            for nt in sorted(loops.get(t, {})):
                body = loops[t][nt]
                row = [f"{4 * len(body)}"]
                for m, c in models:
                    cyc[(m, t, nt)] = 4 * mca_cycles(body, m, c, tmp)
                    row.append(f"{cyc[(m, t, nt)]:.0f}")
                print(f"| {t} | {nt} | " + " | ".join(row) + f" | {16 * BYTES[t]} |")
        for m, c in models:   # the F32 loop: one iteration is 16 weights x one activation row
            cyc[(m, "f32", 1)] = mca_cycles(loops["f32"][1], m, c, tmp)
        print("| f32 (16 weights x 1 row) | 1 | " + " | ".join([str(len(loops["f32"][1]))] + [
            f"{cyc[(m, 'f32', 1)]:.1f}" for m, _ in models]) + " | 64 |")

        acyc: dict[str, dict] = {m: {} for m, _ in models}
        ains = {k: float(len(b)) for k, b in aloops.items()}
        print("\n## Attention loops (attention.c, F16 KV cache), cycles per iteration\n")
        print("| loop | queries | multiply-adds/iter | instr/iter | loads | stores | "
              + " | ".join(f"{m} {c}" for m, c in models) + " |")
        print("|---|---|---|---|---|---|" + "---|" * len(models))
        for key in sorted(aloops):
            body = aloops[key]
            ops = [x.split()[0] for x in body]
            ld = sum(o.startswith("ld") for o in ops)
            st = sum(o.startswith("st") for o in ops)
            macs = {"scores": 2 * AW * key[1], "axpy": AXPY_D * key[1], "exp": 0}[key[0]]
            row = []
            for m, c in models:
                acyc[m][key] = mca_cycles(body, m, c, tmp)
                row.append(f"{acyc[m][key]:.1f}")
            print(f"| {key[0]} | {key[1]} | {macs or '-'} | {len(body)} | {ld} | {st} | " + " | ".join(row) + " |")

        counted: dict = {(sh, int(n), int(d)): float(m) * 1e6 for sh, n, d, m in args.insns}
        for model in args.count:
            shape = shape_of_file(model)
            for d in count_depths:
                for n, c in count_forward(model, d, [1, 5], args.reps, tmp).items():
                    counted[(shape, n, d)] = c
        if counted:
            print("\n## Instructions per forward (qemu-aarch64, NEON build, 1 thread), millions\n")
            print("| shape | N | depth | instructions |")
            print("|---|---|---|---|")
            for k in sorted(counted):
                print(f"| {k[0]} | {k[1]} | {k[2]} | {counted[k] / 1e6:.2f} |")
        derive_counts(counted, depths)

        experts = {(sh, int(n)): float(d) for sh, n, d in args.experts}
        if args.measure_experts:
            experts.update({("Qwen3-30B-A3B", n): d for n, d in
                            measure_experts(args.measure_experts, 64, args.measure_reps).items()})
        if experts:
            print("\n## Distinct experts per layer (measured: --experts / --measure-experts; uniform routing)\n")
            print("| shape | N | measured | uniform |")
            print("|---|---|---|---|")
            for (sh, n), d in sorted(experts.items()):
                print(f"| {sh} | {n} | {d:.2f} | {experts_uniform(SHAPES[sh], n):.2f} |")

        for mca, cpu in models:
            mcyc = {k[1:]: v for k, v in cyc.items() if k[0] == mca}
            for d in depths:
                estimate_table(d, names, loops, mcyc, acyc[mca], ains, counted, experts, mca, cpu)
            speculation_table(depths, names, ks, loops, mcyc, acyc[mca], ains, counted, experts, args.overhead,
                              mca, cpu)
    return 0


def derive_counts(counted: dict, depths: list[int]) -> None:
    """Fill a missing (shape, N, depth) count from another depth of the same shape plus the growth
    another shape with the same attention (layers, heads, KV heads, head_dim) showed between those
    depths (the steps differ only in attention, which does not depend on the weights); else linear
    in the depth from the two deepest counts of the same shape (a decode step's attention grows by
    the same loops per attended position)."""
    def att(sh: str) -> tuple:
        s = SHAPES[sh]
        return (s["layers"], s["heads"], s["kv_heads"], s["head_dim"])

    def across() -> None:
        for sh in SHAPES:
            for n in (1, 5):
                for d in depths:
                    if (sh, n, d) in counted:
                        continue
                    for (sh2, n2, d2), c2 in list(counted.items()):
                        if (n2 == n and d2 != d and sh2 != sh and att(sh2) == att(sh)
                                and (sh, n, d2) in counted and (sh2, n, d) in counted):
                            counted[(sh, n, d)] = counted[(sh, n, d2)] + counted[(sh2, n, d)] - c2
                            log(f"note: {sh} N {n} depth {d}: counted at depth {d2} plus {sh2}'s growth "
                                f"from {d2} to {d}")
                            break

    def linear() -> None:
        for sh in SHAPES:
            for n in (1, 5):
                have = sorted(d for (s2, n2, d) in counted if s2 == sh and n2 == n)
                for d in depths:
                    if (sh, n, d) in counted or len(have) < 2:
                        continue
                    d1, d2 = have[-2], have[-1]
                    c1, c2 = counted[(sh, n, d1)], counted[(sh, n, d2)]
                    counted[(sh, n, d)] = c1 + (c2 - c1) * (d - d1) / (d2 - d1)
                    log(f"note: {sh} N {n} depth {d}: linear in the depth from the counts at {d1} and {d2}")

    across()
    linear()
    across()


def tiles(n: int) -> list[int]:
    """The activation row tiles a packed kernel runs n rows in (quant.h ES_PACKED_KERNEL: as few
    tiles of at most PTILE as can be, of balanced sizes: 9 rows are 5 + 4)."""
    out = []
    while n > 0:
        left = (n + PTILE - 1) // PTILE
        nt = (n + left - 1) // left
        out.append(nt)
        n -= nt
    return out


def experts_uniform(s: dict, n: int) -> float:
    """Expected distinct experts per layer of n rows under independent uniform routing."""
    ne, k = s["n_expert"], s["n_expert_used"]
    return ne * (1 - (1 - k / ne) ** n)


def rows_per_expert(n: int, k: int, distinct: float) -> dict[int, float]:
    """{m: expected experts with m rows} of a layer whose n rows chose k experts each, `distinct`
    of them: a zero-truncated Poisson (at most n rows per expert) with mean n k / distinct."""
    mean = n * k / distinct
    if mean <= 1.0 + 1e-9:
        return {1: distinct}
    lo, hi = 1e-9, float(n * k)
    for _ in range(100):   # lambda / (1 - exp(-lambda)) = mean (the truncation at n ignored in the fit)
        lam = (lo + hi) / 2
        lo, hi = (lam, hi) if lam / (1 - math.exp(-lam)) < mean else (lo, lam)
    w = {m: lam ** m / math.factorial(m) for m in range(1, n + 1)}
    tot = sum(w.values())
    return {m: distinct * v / tot for m, v in w.items()}


def step_ms(name: str, n: int, depth: int, loops: dict, cyc: dict, acyc: dict, ains: dict, counted: dict,
            experts: dict) -> dict:
    """The step model of one call over n tokens at a KV depth (ms; cycles from cyc / acyc).

    Per dense matrix the larger of compute (records x cycles per record over the tiles of n rows,
    over THREADS at GHZ) and memory (bytes / STREAM_GBS). A MoE layer's two expert dispatches (gate
    and up of every chosen expert; down) each take the larger of their summed compute and summed
    bytes, over the expected distinct experts `experts[(name, n)]` (else experts_uniform) with
    their rows per expert from rows_per_expert. The router (F32) at the F32 loop's cycles. The
    attention the larger of its loops' cycles and the F16 cache's bytes; the rest at IPC 1 and 2."""
    s = SHAPES[name]
    mm_ms = mem_all = comp_all = instr = 0.0
    wbytes = 0
    moe = bool(s.get("n_expert"))
    d_exp = experts.get((name, n), experts_uniform(s, n)) if moe else 0.0
    dist = rows_per_expert(n, s["n_expert_used"], d_exp) if moe else {}
    disp: dict[str, list[float]] = {}   # per expert dispatch: [compute ms, memory ms]
    for mname, t, n_in, n_out, count in llama_q4_k_m_plan(s):
        if t == "f32":
            b = n_in * n_out * 4 * count
            cycles = n * n_in * n_out / 16 * cyc[("f32", 1)] * count   # the F32 loop: 16 weights x one row
            ins = n * n_in * n_out / 16 * len(loops["f32"][1]) * count
            c_ms, m_ms = cycles / THREADS / (GHZ * 1e6), b / (STREAM_GBS * 1e6)
            wbytes += b
        else:
            recs = (n_out + 15) // 16 * (n_in // ELEMS[t]) * count
            rec_bytes = 16 * BYTES[t]
            if mname.startswith("expert"):
                b = d_exp * recs * rec_bytes
                cycles = sum(ne * recs * sum(cyc[(t, nt)] for nt in tiles(m)) for m, ne in dist.items())
                ins = sum(ne * recs * sum(4 * len(loops[t][nt]) for nt in tiles(m)) for m, ne in dist.items())
            else:
                b = recs * rec_bytes
                cycles = recs * sum(cyc[(t, nt)] for nt in tiles(n))
                ins = recs * sum(4 * len(loops[t][nt]) for nt in tiles(n))
            c_ms, m_ms = cycles / THREADS / (GHZ * 1e6), b / (STREAM_GBS * 1e6)
            wbytes += b
            if mname.startswith("expert"):
                d = disp.setdefault("down" if "down" in mname else "gate_up", [0.0, 0.0])
                d[0] += c_ms
                d[1] += m_ms
                comp_all += c_ms
                mem_all += m_ms
                instr += ins
                continue
        instr += ins
        comp_all += c_ms
        mem_all += m_ms
        mm_ms += max(c_ms, m_ms)
    mm_ms += sum(max(c, m) for c, m in disp.values())
    kvb = kv_bytes(s, depth)
    units = s["layers"] * s["kv_heads"] * (depth + n)   # attended positions x KV heads x layers
    a_comp = units * attention_per_position(s, n, acyc) / THREADS / (GHZ * 1e6)
    a_mem = kvb / (STREAM_GBS * 1e6)
    a_instr = units * attention_per_position(s, n, ains)
    q = counted.get((name, n, depth))
    if q:
        rest_instr = q - instr - a_instr
    elif n not in (1, 5) and (name, 1, depth) in counted and (name, 5, depth) in counted:
        r1, r5 = (step_ms(name, k, depth, loops, cyc, acyc, ains, counted, experts)["rest_instr"] for k in (1, 5))
        rest_instr = r1 + (r5 - r1) * (n - 1) / 4   # linear in the tokens between the counted N = 1 and 5
    else:
        rest_instr = rest_instructions(s, n)
    # the rest at 1 and at 2 instructions per cycle, shared out by the pool's 4 threads
    rest_ms = [max(rest_instr, 0) / ipc / THREADS / (GHZ * 1e6) for ipc in (1, 2)]
    base = mm_ms + max(a_comp, a_mem)
    return dict(wbytes=wbytes, mem=mem_all, comp=comp_all, instr=instr, kvb=kvb, a_mem=a_mem, a_comp=a_comp,
                a_instr=a_instr, q=q, rest_instr=rest_instr, rest_ms=rest_ms, experts=d_exp,
                ms=(base + rest_ms[0], base + rest_ms[1]))


def estimate_table(depth: int, names: list[str], loops: dict, cyc: dict, acyc: dict, ains: dict, counted: dict,
                   experts: dict, mca: str, cpu: str) -> None:
    """The step estimate (markdown) at a KV depth with the cycles of llvm-mca `mca` (-mcpu=cpu)."""
    print(f"\n## Estimate per step on the RK3588 (4 x A76 at 2.4 GHz, 20 GB/s), depth {depth}, "
          f"cycles from {mca} -mcpu={cpu}\n")
    print("| model | N | weight MB | matmul: memory / compute ms | KV MB | attention: memory / compute ms "
          "| qemu instr M (matmul + attention loops + rest) | rest ms (IPC 1 / 2) | step ms (IPC 1 / 2) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        res = {}
        for n in (1, 5):
            r = step_ms(name, n, depth, loops, cyc, acyc, ains, counted, experts)
            res[n] = r["ms"]
            q, instr, a_instr, rest_instr = r["q"], r["instr"], r["a_instr"], r["rest_instr"]
            qs = (f"{q / 1e6:.0f} ({instr / 1e6:.0f} + {a_instr / 1e6:.0f} + {rest_instr / 1e6:.0f})" if q
                  else f"- ({instr / 1e6:.0f} + {a_instr / 1e6:.0f} + ~{rest_instr / 1e6:.0f} rough)")
            print(f"| {name} | {n} | {r['wbytes'] / 1e6:.0f} | {r['mem']:.1f} / {r['comp']:.1f} | {r['kvb'] / 1e6:.1f} "
                  f"| {r['a_mem']:.1f} / {r['a_comp']:.1f} | {qs} | {r['rest_ms'][0]:.1f} / {r['rest_ms'][1]:.1f} "
                  f"| {res[n][0]:.1f} / {res[n][1]:.1f} |")
        print(f"| {name} | V(4)/T | | | | | | | {res[5][0] / res[1][0]:.2f} / {res[5][1] / res[1][1]:.2f} |")


def expected_accepted(p: float, k: int) -> float:
    """E[accepted] of K drafts under the geometric model: p + p^2 + ... + p^K."""
    return sum(p ** i for i in range(1, k + 1))


def needed_acceptance(t: float, v: dict[int, float], overhead: float) -> tuple[float | None, int | None]:
    """The smallest per-token acceptance p for which some K in v pays: V(K) + overhead <
    (E[accepted] + 1) T; (p, that K), or (None, None) when no K pays even at p = 1."""
    best: tuple[float | None, int | None] = (None, None)
    for k, vk in sorted(v.items()):
        need = (vk + overhead) / t - 1
        if need >= k:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_accepted(mid, k) < need else (lo, mid)
        if best[0] is None or hi < best[0]:
            best = (hi, k)
    return best


def span(a: float, b: float, digits: int = 2) -> str:
    """A range 'lo-hi' (one figure when both round alike)."""
    lo, hi = f"{min(a, b):.{digits}f}", f"{max(a, b):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def speculation_table(depths: list[int], names: list[str], ks: list[int], loops: dict, cyc: dict, acyc: dict,
                      ains: dict, counted: dict, experts: dict, overhead: float, mca: str, cpu: str) -> None:
    """T, V(K)/T, decode tokens/s and the acceptance a workload needs (markdown), per model and depth;
    ranges are the rest at IPC 1 / 2. The needed p is over K = 1..8, whatever --ks shows."""
    print(f"\n## Speculation on the RK3588 (cycles from {mca} -mcpu={cpu}; overhead {overhead} ms per verify)\n")
    print("| model | depth | experts per layer | T ms | " + " | ".join(f"V({k})/T" for k in ks)
          + " | decode tok/s | needed p (best K) |")
    print("|---|---:|---|---:|" + "---:|" * len(ks) + "---:|---:|")
    for name in names:
        moe = bool(SHAPES[name].get("n_expert"))
        for d in depths:
            for src in (["uniform", "measured"] if moe else ["-"]):
                ex = experts if src == "measured" else {}
                if src == "measured":
                    gaps = [n for n in range(1, 10) if (name, n) not in experts]
                    if len(gaps) == 9:
                        continue
                    if gaps:
                        log(f"note: {name}: no measured experts for N = {gaps}: no measured row (give N 1..9)")
                        continue
                t = step_ms(name, 1, d, loops, cyc, acyc, ains, counted, ex)["ms"]
                v = {k: step_ms(name, k + 1, d, loops, cyc, acyc, ains, counted, ex)["ms"] for k in range(1, 9)}
                vt = [span(v[k][0] / t[0], v[k][1] / t[1]) for k in ks]
                need = [needed_acceptance(t[i], {k: v[k][i] for k in v}, overhead) for i in (0, 1)]
                ns = ("none" if need[0][0] is None or need[1][0] is None else
                      span(need[0][0], need[1][0]) + " (K " + "/".join(sorted({str(need[0][1]), str(need[1][1])})) + ")")
                exs = "-" if not moe else src + " (" + ", ".join(
                    f"{(ex.get((name, k + 1)) or experts_uniform(SHAPES[name], k + 1)):.1f}" for k in ks) + ")"
                print(f"| {name} Q4_K_M | {d} | {exs} | {span(t[0], t[1], 1)} | " + " | ".join(vt)
                      + f" | {span(1000 / t[0], 1000 / t[1], 1)} | {ns} |")


def measure_experts(path: Path, depth: int, reps: int) -> dict[int, float]:
    """{n: distinct experts per layer} of the engine's forwards of n pseudo-random tokens at a KV
    depth on a MoE file (the mean of reps forwards each rolled back; needs the built package)."""
    import numpy as np
    from echospec.services.verifier.engine import Model
    m = Model(str(path))
    sess = m.new_session(n_ctx=depth + 16, n_threads=0)
    rng = np.random.default_rng(1)
    sess.forward(rng.integers(0, m.info.n_vocab, depth))
    out = {}
    for n in range(1, 10):
        vals = []
        for _ in range(reps):
            sess.forward(rng.integers(0, m.info.n_vocab, n))
            vals.append(sess.experts_read / m.info.n_layer)
            sess.rollback(depth)
        out[n] = sum(vals) / len(vals)
        log(f"  engine: {path.name} depth {depth} N {n}: {out[n]:.2f} distinct experts per layer")
    sess.close()
    m.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
