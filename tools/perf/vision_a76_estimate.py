#!/usr/bin/env python3
"""A76 estimate of the Qwen3-VL-2B vision encode (es_vision_encode) on the RK3588, from the machine code.

No A76 board is at hand, so the time of one image encode on the 4 Cortex-A76 cores (2.4 GHz, about
20 GB/s STREAM) is estimated:

  1. the micro-kernel: engine_c/src/vision.c is compiled as the neon-a76 build does
     (aarch64-linux-gnu-gcc -O3 -mcpu=cortex-a76.cortex-a55 -ffp-contract=off -S); the inner loops
     of vis_tile_h (F16 panels: the linear layers and the mergers) and vis_tile_f (F32: the patch
     embedding and the attention's two products) are found (the first loop of each function that
     branches back to its own label) and their instructions counted. One iteration is one k step of
     8 token rows x 8 output columns (16 fmla of 4 lanes: 64 multiply-adds). Cycles per iteration:
     the A76's pipeline bound (2 ASIMD pipes take the fmla and fcvtl, 2 load pipes the loads: the
     larger of the two counts halved), and llvm-mca's figure with the cortex-a76 model of the LLVM
     found (in LLVM 14 the Cortex-A57 model: 128-bit operations as two 64-bit halves, a
     pessimistic bound);
  2. the work: multiply-adds of the encode at the image size, per kernel, from the shapes
     (Qwen3-VL-2B's vision_config) and the engine's blocking (PW = 8 columns a panel on NEON, rows
     in chunks of chunk_rows(n_in));
  3. time = multiply-adds / 64 x cycles per iteration over 4 threads at 2.4 GHz, against the memory
     floor: the weights read once per row chunk (F16, the packed panels), the attention's keys and
     values once per 8-query block, at 20 GB/s; each matrix product takes the larger of the two
     (a roofline per product). The exp of the softmax (expv, 4 lanes) and the row operations are
     counted at 30 instructions per 4 scores and 1 instruction per cycle: a small term, stated.

Run (from the repository root; needs gcc-aarch64-linux-gnu and llvm-mca):
    python3 tools/perf/vision_a76_estimate.py                 # 448 x 448
    python3 tools/perf/vision_a76_estimate.py --size 896
These are estimates, not measurements: see bench/README.md, "Vision encoder: A76 estimate".
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from math import ceil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine_c"
CC = "aarch64-linux-gnu-gcc"
CFLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fPIC", "-D_GNU_SOURCE", f"-I{ENGINE / 'include'}",
          f"-I{ENGINE / 'src'}", "-mcpu=cortex-a76.cortex-a55"]
GHZ, THREADS, GBS = 2.4, 4, 20.0
VISION = dict(D=1024, F=4096, heads=16, layers=24, patch=16, merge=2, out=2048, deepstack=3)
PW, VIS_R, AW = 8, 8, 4      # the NEON build's panel width, rows per tile, lanes


def loop_body(asm: str, fn: str) -> list[str]:
    """The instructions of the first loop in fn that branches back to its own label."""
    m = re.search(rf"^{fn}:\n(.*?)^\t\.size\t{fn},", asm, re.S | re.M)
    if not m:
        raise SystemExit(f"{fn} not found in the assembly")
    lines = m.group(1).splitlines()
    for i, line in enumerate(lines):
        lab = re.match(r"^(\.L\d+):", line)
        if not lab:
            continue
        body = []
        for nxt in lines[i + 1:]:
            if re.match(r"^\.L\d+:", nxt):
                break
            if nxt.startswith("\t.") or not nxt.strip():
                continue
            body.append(nxt)
            if re.match(rf"^\tb\.?\w*\t{re.escape(lab.group(1))}$", nxt):
                return body
    raise SystemExit(f"no loop found in {fn}")


def pipeline_cycles(body: list[str]) -> float:
    """A76: fmla / fcvtl / dup on the 2 ASIMD pipes, loads on the 2 load pipes."""
    simd = sum(1 for l in body if re.match(r"^\t(fmla|fcvtl|dup|fmul|fadd)\t", l))
    loads = sum(1 for l in body if re.match(r"^\t(ldr|ld1r?|ldp)\t", l))
    return max(simd / 2, loads / 2)


def mca_cycles(body: list[str], mca: str) -> float | None:
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(body) + "\n")
    r = subprocess.run([mca, "-mtriple=aarch64", "-mcpu=cortex-a76", "-iterations=200", f.name],
                       capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    return int(m.group(1)) / 200 if m else None


def chunk_rows(n_in: int) -> int:
    """engine_c/src/vision.c's chunk_rows."""
    r = (128 * 1024 // 4) // max(n_in, 1) // VIS_R * VIS_R
    return VIS_R if r < VIS_R else min(r, 256)


def work(size: int) -> dict:
    """Multiply-adds per kernel and bytes per product at a size x size image."""
    v = VISION
    D, F, H, L = v["D"], v["F"], v["heads"], v["layers"]
    T = (size // v["patch"]) ** 2
    M2 = v["merge"] ** 2
    Tm, hd = T // M2, D // H
    Tp = ceil(T / PW) * PW
    pan = lambda n: ceil(n / PW) * PW

    def lin(n_in: int, n_out: int, rows: int, esz: int = 2) -> tuple[int, float]:
        return rows * n_in * pan(n_out), n_in * pan(n_out) * esz * ceil(rows / chunk_rows(n_in))

    prods = {"patch embedding": [lin(3 * v["patch"] ** 2, D, T, 4)]}
    layer = [lin(D, 3 * D, T), lin(D, D, T), lin(D, F, T), lin(F, D, T)]
    prods["linear layers"] = layer * L
    merger = [lin(D * M2, D * M2, Tm), lin(D * M2, v["out"], Tm)]
    prods["mergers"] = merger * (1 + v["deepstack"])
    qb = ceil(T / VIS_R)
    kv = H * qb * (hd * Tp + T * pan(hd)) * 4        # keys and values read once per query block
    prods["attention"] = [(H * T * (hd * Tp + T * pan(hd)), kv)] * L
    return {"T": T, "prods": prods, "exps": H * T * T * L}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=448)
    a = ap.parse_args()
    if not shutil.which(CC):
        print(f"vision_a76_estimate: {CC} is missing (apt-get install gcc-aarch64-linux-gnu)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "vision.s"
        subprocess.run([CC, *CFLAGS, "-S", str(ENGINE / "src" / "vision.c"), "-o", str(out)], check=True)
        asm = out.read_text()
    mca = shutil.which("llvm-mca") or next((shutil.which(f"llvm-mca-{v}") for v in (19, 18, 17, 16, 15, 14)
                                            if shutil.which(f"llvm-mca-{v}")), None)
    ver = subprocess.run([mca, "--version"], capture_output=True, text=True).stdout if mca else ""
    llvm = re.search(r"LLVM version (\d+)", ver)
    cyc = {}
    print("| kernel | fmla per iteration | instructions | A76 pipelines, cycles | llvm-mca "
          f"(LLVM {llvm.group(1) if llvm else '?'} cortex-a76), cycles |")
    print("|---|---:|---:|---:|---:|")
    for fn in ("vis_tile_h", "vis_tile_f"):
        body = loop_body(asm, fn)
        fmla = sum(1 for l in body if l.startswith("\tfmla\t"))
        if fmla != 2 * VIS_R:
            raise SystemExit(f"{fn}: {fmla} fmla in the loop, expected {2 * VIS_R}")
        pc, mc = pipeline_cycles(body), mca_cycles(body, mca) if mca else None
        cyc[fn] = (pc, mc)
        print(f"| {fn} | {fmla} | {len(body)} | {pc:.1f} | {mc if mc is not None else '-'} |")
    w = work(a.size)
    lanes = 2 * VIS_R * AW                                   # multiply-adds per iteration
    hz = GHZ * 1e9 * THREADS
    print(f"\n{a.size}x{a.size}: {w['T']} patches, 4 threads at {GHZ} GHz, {GBS:.0f} GB/s\n")
    print("| part | multiply-adds (G) | bytes read (GB) | compute ms (pipelines / llvm-mca) | memory ms |")
    print("|---|---:|---:|---:|---:|")
    tot = [0.0, 0.0]
    for name, prods in w["prods"].items():
        fn = "vis_tile_h" if name in ("linear layers", "mergers") else "vis_tile_f"
        pc, mc = cyc[fn]
        ma = sum(p[0] for p in prods)
        by = sum(p[1] for p in prods)
        c = [sum(p[0] / lanes * k / hz * 1e3 for p in prods) for k in (pc, mc or pc)]
        mem = by / (GBS * 1e9) * 1e3
        for i in range(2):   # a roofline per product
            tot[i] += sum(max(p[0] / lanes * (pc if i == 0 else (mc or pc)) / hz * 1e3,
                              p[1] / (GBS * 1e9) * 1e3) for p in prods)
        print(f"| {name} | {ma / 1e9:.1f} | {by / 1e9:.2f} | {c[0]:.0f} / {c[1]:.0f} | {mem:.0f} |")
    rest = w["exps"] / AW * 30 / (1e9 * THREADS) * 1e3 / GHZ
    print(f"| softmax exp and row ops | {w['exps'] / 1e9:.2f} G exps | - | {rest:.0f} | - |")
    print(f"\nestimate: {(tot[0] + rest) / 1e3:.1f} s (A76 pipelines); pessimistic bound "
          f"{(tot[1] + rest) / 1e3:.1f} s (llvm-mca's model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
