"""cffi out-of-line API-mode build of the echospec engine as ``echospec._engine``.

The cdef is read from engine_c/include/echospec_engine.h (between the
ES_CDEF_BEGIN / ES_CDEF_END markers), so the binding and the library cannot
disagree. The C sources are compiled into the extension module itself.

SIMD flags come from the environment variable ECHOSPEC_SIMD:
    auto (default)  x86-64: -march=native; aarch64: armv8.2-a+dotprod+fp16
    native          -march=native (x86-64) / -mcpu=native (aarch64)
    scalar          portable C, no intrinsics
    avx2, avx512    explicit x86-64 levels
    neon-a76        -mcpu=cortex-a76.cortex-a55 (the RK3588)
Run directly (``python engine_c/build_ffi.py``) to build in place.
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = HERE / "include" / "echospec_engine.h"


def _cdef() -> str:
    text = HEADER.read_text()
    m = re.search(r"/\* ES_CDEF_BEGIN \*/(.*)/\* ES_CDEF_END \*/", text, re.S)
    if not m:
        raise RuntimeError(f"{HEADER}: ES_CDEF markers not found")
    return m.group(1)


def simd_flags(mode: str | None = None) -> list[str]:
    mode = (mode or os.environ.get("ECHOSPEC_SIMD", "auto")).strip().lower()
    machine = platform.machine().lower()
    arm = machine in ("aarch64", "arm64")
    table = {
        "scalar": ["-DES_FORCE_SCALAR"],
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
        "neon-a76": ["-mcpu=cortex-a76.cortex-a55"],
        "native": ["-mcpu=native"] if arm else ["-march=native"],
        "auto": ["-march=armv8.2-a+dotprod+fp16"] if arm else ["-march=native"],
    }
    if mode not in table:
        raise RuntimeError(f"ECHOSPEC_SIMD={mode!r}: expected one of {sorted(table)}")
    return table[mode]


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
_sources = sorted(str(p.relative_to(HERE.parent)) for p in (HERE / "src").glob("*.c"))
ffibuilder.set_source(
    "echospec._engine",
    '#include "echospec_engine.h"',
    sources=_sources,
    include_dirs=[str((HERE / "include").relative_to(HERE.parent)), str((HERE / "src").relative_to(HERE.parent))],
    extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-D_GNU_SOURCE", "-pthread",
                        "-Wno-unused-parameter", *simd_flags()],
    extra_link_args=["-pthread", "-lm"],
)

if __name__ == "__main__":
    os.chdir(HERE.parent)
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
