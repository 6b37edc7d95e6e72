#!/usr/bin/env python3
"""A76 estimate from the machine code: T and V(4)/T of Qwen3 Q4_K_M on the RK3588 (issue 13, item 6).

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
  2. instructions per forward (optional, --count MODEL.gguf): bench/a76_count.c (aarch64, one
     thread) runs under qemu-aarch64 with bench/a76_insn_plugin.so, which counts executed
     instructions; REPS = 2 minus REPS = 0, halved, is one forward (N = 1 and N = 5).
  3. the step model: per matrix of the Qwen3 shape (types as llama.cpp's Q4_K_M rule gives them),
     records x cycles per record at the tile size the driver uses (N = 1: nt 1; N = 5: one tile
     of 5), over 4 threads at 2.4 GHz, against the memory floor bytes / 20 GB/s (the RK3588's
     STREAM figure); a matrix takes the larger of the two (roofline per matrix), plus the rest of
     the step (norms, RoPE, attention at depth 64, activation quantization, the argmax) from the
     qemu count minus the matmul loops' instructions when given (else a rough count, see
     rest_instructions), at 1 and at 2 instructions per cycle over the 4 threads: a range, since
     that code (attention, norms, quantization of activations) was not put through llvm-mca.

Run (from the repository root; needs gcc-aarch64-linux-gnu, llvm-mca-14 or -19, and for --count
qemu-user and a Q4_K_M file such as bench/qwen3_shapes.py writes):
    python3 bench/a76_estimate.py
    python3 bench/a76_estimate.py --count ~/.cache/echospec/bench/qwen3-0.6B-shape.Q4_K_M.gguf
Prints the per-record cycle table and the estimates (markdown). These are estimates, not
measurements: see bench/README.md, "A76 estimate".
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine_c"
CC = "aarch64-linux-gnu-gcc"
CFLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fPIC", "-D_GNU_SOURCE", "-mcpu=cortex-a76.cortex-a55",
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


def compile_asm(out: Path) -> None:
    cmd = [CC, *CFLAGS, "-S", str(ENGINE / "src" / "quant_neon.c"), "-o", str(out)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)


def inner_loops(asm: str) -> dict[str, dict[int, list[str]]]:
    """{type: {nt: loop body instructions}} of the packed kernels' innermost loops."""
    lines = asm.split("\n")
    out: dict[str, dict[int, list[str]]] = {}
    for t in TYPES:
        fn = f"p_{t}"
        try:
            a = lines.index(f"{fn}:")
        except ValueError:
            continue
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
        for s, e in inner:
            body = [x.strip() for x in lines[s:e + 1]
                    if x.startswith("\t") and not x.strip().startswith((".", "//"))]
            sd = sum(1 for x in body if x.startswith("sdot"))
            if sd == 0 or sd % SDOT_PER_ROW[t]:
                continue
            nt = sd // SDOT_PER_ROW[t]
            if nt not in out.setdefault(t, {}) or len(body) > len(out[t][nt]):
                out[t][nt] = body
    return out


def mca_cycles(body: list[str], mca: str, cpu: str, tmp: Path) -> float:
    """Cycles per iteration of the loop body (llvm-mca, 200 iterations)."""
    src = tmp / "loop.s"
    src.write_text("\n".join(body) + "\n")
    r = subprocess.run([mca, "-mtriple=aarch64", f"-mcpu={cpu}", "-iterations=200", str(src)],
                       capture_output=True, text=True, check=True)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    return int(m.group(1)) / 200.0


def llama_q4_k_m_plan(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                      vocab: int) -> list[tuple[str, str, int, int, int]]:
    """(name, type, n_in, n_out, count) of the matrices of a Qwen3 Q4_K_M step.

    llama.cpp's rule (llama_tensor_get_type, LLAMA_FTYPE_MOSTLY_Q4_K_M): attn_v and ffn_down in
    Q6_K where use_more_bits(i, n) (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2), else Q4_K; the
    tied token_embd (used as the output head) in Q6_K; every other matrix Q4_K. With 8 KV heads of
    16 the GQA ratio is 2, below the rule's >= 4 case for attn_v."""
    def more(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
    n6 = sum(more(i, layers) for i in range(layers))
    return [
        ("attn_q", "q4_k", hidden, heads * head_dim, layers),
        ("attn_k", "q4_k", hidden, kv_heads * head_dim, layers),
        ("attn_v", "q6_k", hidden, kv_heads * head_dim, n6),
        ("attn_v", "q4_k", hidden, kv_heads * head_dim, layers - n6),
        ("attn_output", "q4_k", heads * head_dim, hidden, layers),
        ("ffn_gate", "q4_k", hidden, ffn, layers),
        ("ffn_up", "q4_k", hidden, ffn, layers),
        ("ffn_down", "q6_k", ffn, hidden, n6),
        ("ffn_down", "q4_k", ffn, hidden, layers - n6),
        ("output (tied token_embd)", "q6_k", hidden, vocab, 1),
    ]


SHAPES = {
    "Qwen3-0.6B": dict(hidden=1024, ffn=3072, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "Qwen3-1.7B": dict(hidden=2048, ffn=6144, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936),
}


def rest_instructions(s: dict, n: int, depth: int) -> float:
    """Instructions of a step outside the matmul inner loops, a rough count used when no qemu
    count is given: per layer and token 2 RMSNorms and the q/k norms and RoPE (~10 instructions
    per element), activation quantization of 4 inputs (~2 per element), attention over depth + n
    positions (~1 per multiply-add, 16-wide NEON sums: ~1/3), SwiGLU (~20 per element), and the
    argmax over the vocabulary (~1 per logit)."""
    per_tok_layer = (10 * (2 * s["hidden"] + (s["heads"] + s["kv_heads"]) * s["head_dim"])
                     + 2 * (3 * s["hidden"] + s["ffn"])
                     + (2 * s["heads"] * s["head_dim"] * (depth + n)) / 3
                     + 20 * s["ffn"])
    return n * (s["layers"] * per_tok_layer + s["vocab"])


def kv_bytes(s: dict, depth: int) -> int:
    return s["layers"] * s["kv_heads"] * s["head_dim"] * 2 * 4 * depth   # K and V, float32


def count_forward(model: Path, n: int, depth: int, tmp: Path, base: dict) -> int:
    """Guest instructions of one forward over n tokens (qemu-aarch64 + the counting plugin); the
    REPS = 0 run (load and prefill only) is made once per model and depth, in base."""
    lib = ENGINE / "build" / "aarch64-neon-a76" / "libechospec_engine.a"
    subprocess.run(["make", "-s", "-C", str(ENGINE), f"-j{os.cpu_count()}", "BUILD=build/aarch64-neon-a76",
                    f"CC={CC}", "SIMD=neon-a76", "build/aarch64-neon-a76/libechospec_engine.a"], check=True)
    exe, plugin = tmp / "a76_count", tmp / "a76_insn_plugin.so"
    if not exe.exists():
        subprocess.run([CC, "-O2", f"-I{ENGINE / 'include'}", str(ROOT / "bench" / "a76_count.c"), str(lib),
                        "-o", str(exe), "-lm", "-pthread"], check=True)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(ROOT / "bench" / "a76_insn_plugin.c"), "-o",
                        str(plugin)], check=True)
    counts = []
    for reps in (0, 2):
        if reps == 0 and (model, depth) in base:
            counts.append(base[(model, depth)])
            continue
        r = subprocess.run(["qemu-aarch64", "-cpu", "cortex-a76", "-L", "/usr/aarch64-linux-gnu", "-plugin",
                            str(plugin), str(exe), str(model), str(depth), str(n), str(reps)],
                           capture_output=True, text=True, check=True)
        counts.append(int(re.search(r"insns (\d+)", r.stderr).group(1)))
        log(f"  qemu: {model.name} depth {depth} N {n} reps {reps}: {counts[-1]} instructions")
    base[(model, depth)] = counts[0]
    return (counts[1] - counts[0]) // 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--asm", type=Path, help="use this assembly of quant_neon.c instead of compiling it")
    ap.add_argument("--count", type=Path, action="append", default=[],
                    help="a Qwen3-shaped Q4_K_M GGUF to count instructions per forward on under qemu "
                         "(the shape is told from its name: 0.6B or 1.7B); may be given twice")
    ap.add_argument("--insns", nargs=3, action="append", default=[], metavar=("SHAPE", "N", "MILLIONS"),
                    help="instructions per forward counted before (e.g. Qwen3-0.6B 1 345.1), instead of "
                         "--count; may be repeated")
    ap.add_argument("--depth", type=int, default=64, help="KV depth of the step (default 64)")
    ap.add_argument("--count-depth", type=int, default=None,
                    help="prefill depth of the qemu runs (default --depth; each run prefills it, which "
                         "is most of its time under qemu: 1.7B at depth 64 takes about 10 minutes a run)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        asm_path = args.asm or tmp / "quant_neon.s"
        if not args.asm:
            compile_asm(asm_path)
        loops = inner_loops(asm_path.read_text())
        models = [(m, c) for m, c in (("llvm-mca-14", "cortex-a76"), ("llvm-mca-19", "neoverse-n1"))
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

        counted: dict = {(sh, int(n)): float(m) * 1e6 for sh, n, m in args.insns}
        base: dict = {}
        for model in args.count:
            shape = "Qwen3-1.7B" if "1.7B" in model.name else "Qwen3-0.6B"
            for n in (1, 5):
                counted[(shape, n)] = count_forward(model, n, args.count_depth or args.depth, tmp, base)

        for mca, cpu in models:
            estimate_table(args, loops, cyc, counted, mca, cpu)
    return 0


def estimate_table(args: argparse.Namespace, loops: dict, cyc: dict, counted: dict, best: str, cpu: str) -> None:
    """The step estimate (markdown) with the cycles of llvm-mca `best` (-mcpu=cpu)."""
    print(f"\n## Estimate per step on the RK3588 (4 x A76 at 2.4 GHz, 20 GB/s), depth {args.depth}, "
          f"cycles from {best} -mcpu={cpu}\n")
    print("| model | N | weight MB/step | memory floor ms | matmul compute ms (4 thr) | matmul instr M "
          "| qemu instr/forward M | rest ms (IPC 1 / 2) | T or V(4) est. ms (IPC 1 / 2) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in SHAPES.items():
        plan = llama_q4_k_m_plan(**s)
        res: dict[int, tuple[float, float]] = {}
        for n in (1, 5):
            nt = n if n <= PTILE else None
            tot_ms = 0.0
            mem_ms_all = comp_ms_all = instr = 0.0
            wbytes = 0
            for _, t, n_in, n_out, count in plan:
                recs = (n_out + 15) // 16 * (n_in // ELEMS[t]) * count
                b = recs * 16 * BYTES[t]
                wbytes += b
                c_ms = recs * cyc[(best, t, nt)] / THREADS / (GHZ * 1e6)
                m_ms = b / (STREAM_GBS * 1e6)
                instr += recs * 4 * len(loops[t][nt])
                comp_ms_all += c_ms
                mem_ms_all += m_ms
                tot_ms += max(c_ms, m_ms)
            kvb = kv_bytes(s, args.depth)
            tot_ms += kvb / (STREAM_GBS * 1e6)
            q = counted.get((name, n))
            rest_instr = (q - instr) if q else rest_instructions(s, n, args.depth)
            if q and (args.count_depth or args.depth) != args.depth:
                log(f"note: {name}: the rest is counted at depth {args.count_depth}, not {args.depth}")
            # the rest at 1 and at 2 instructions per cycle, shared out by the pool's 4 threads
            rest_ms = [max(rest_instr, 0) / ipc / THREADS / (GHZ * 1e6) for ipc in (1, 2)]
            res[n] = (tot_ms + rest_ms[0], tot_ms + rest_ms[1])
            print(f"| {name} | {n} | {wbytes / 1e6:.0f} | {(wbytes + kvb) / (STREAM_GBS * 1e6):.1f} "
                  f"| {comp_ms_all:.1f} | {instr / 1e6:.0f} | {q / 1e6 if q else float('nan'):.0f} "
                  f"| {rest_ms[0]:.1f} / {rest_ms[1]:.1f} | {res[n][0]:.1f} / {res[n][1]:.1f} |")
        print(f"| {name} | V(4)/T | | | | | | | {res[5][0] / res[1][0]:.2f} / {res[5][1] / res[1][1]:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
