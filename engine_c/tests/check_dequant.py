"""Check the engine's row dequantizers against the `gguf` package's.

For every supported tensor type this writes random, valid blocks (sane f16
scales, random quant bits) to a file, dequantizes them with a tiny C program
built from engine_c/src (es_dequantize_row), and compares the float32 rows
with gguf.quants.dequantize. Exit status 0 when every type matches within
1e-6 relative (K types' products may round differently in numpy), 1 otherwise.

    python engine_c/tests/check_dequant.py [--cc gcc]

check(cc) is importable so the Python tests can call it.
"""
from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

ENGINE = Path(__file__).resolve().parent.parent

C_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include "internal.h"
/* argv: in out ; in = u32 type, i64 n, bytes ; out = float32[n] */
int main(int argc, char **argv) {
    FILE *f = fopen(argv[1], "rb");
    unsigned type; long long n;
    if (!f || fread(&type, 4, 1, f) != 1 || fread(&n, 8, 1, f) != 1) return 2;
    long pos = ftell(f); fseek(f, 0, SEEK_END); long sz = ftell(f) - pos; fseek(f, pos, SEEK_SET);
    unsigned char *src = malloc(sz ? sz : 1); float *dst = malloc(sizeof(float) * (n ? n : 1));
    if (fread(src, 1, sz, f) != (size_t)sz) return 2;
    es_dequantize_row(type, src, dst, n);
    FILE *o = fopen(argv[2], "wb");
    fwrite(dst, sizeof(float), n, o);
    fclose(o);
    return 0;
}
"""

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[n_blocks, block_bytes] of valid blocks with moderate scales."""
    be, bb = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    if qtype == T.F32:
        return rng.uniform(-1, 1, n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if qtype == T.F16:
        return f16(rng.uniform(-1, 1, n_blocks))
    if qtype == T.BF16:
        u = rng.uniform(-1, 1, n_blocks).astype(np.float32).view(np.uint32) >> 16
        return u.astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.Q6_K:
        raw[:, 208:210] = f16(rng.uniform(-0.002, 0.002, n_blocks))
        return raw
    raw[:, 0:2] = f16(rng.uniform(-0.02, 0.02, n_blocks))
    if qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K):
        raw[:, 2:4] = f16(rng.uniform(-0.05, 0.05, n_blocks))
    return raw


def check(cc: str = "cc", n_blocks: int = 64, seed: int = 1) -> list[str]:
    """Returns a list of failure messages (empty when every type matches)."""
    rng = np.random.default_rng(seed)
    failures = []
    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        (tdp / "main.c").write_text(C_MAIN)
        srcs = [str(ENGINE / "src" / f) for f in ("quant.c", "matmul.c", "quant_avx512.c", "quant_avx2.c", "quant_neon.c",
                                                   "threadpool.c", "util.c")]
        exe = tdp / "dq"
        subprocess.run([cc, "-std=c11", "-O1", "-ffp-contract=off", "-D_GNU_SOURCE", "-DES_FORCE_SCALAR",
                        f"-I{ENGINE / 'include'}", f"-I{ENGINE / 'src'}", str(tdp / "main.c"), *srcs,
                        "-o", str(exe), "-lm", "-pthread"], check=True)
        for qtype in TYPES:
            be, bb = GGML_QUANT_SIZES[qtype]
            blocks = random_blocks(qtype, n_blocks, rng)
            n = n_blocks * be
            inp, out = tdp / "in.bin", tdp / "out.bin"
            inp.write_bytes(struct.pack("<Iq", int(qtype), n) + blocks.tobytes())
            subprocess.run([str(exe), str(inp), str(out)], check=True)
            got = np.fromfile(out, dtype=np.float32)
            want = dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)
            err = np.abs(got.astype(np.float64) - want) / (np.abs(want) + 1e-12)
            bad = np.flatnonzero(err > 1e-6)
            if got.shape != want.shape or bad.size:
                i = int(bad[0]) if bad.size else 0
                failures.append(f"{qtype.name}: {bad.size} of {n} differ, e.g. [{i}] {got[i]!r} vs {want[i]!r}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()
    failures = check(args.cc)
    for f in failures:
        print("FAIL", f)
    print("dequantizers: %d types checked, %d failed" % (len(TYPES), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
