"""Build facts of the C engine: it links against libc, libm and pthreads only,
and the stripped shared library stays within 0.8 MB."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 800 * 1000  # bytes


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("engine-build")
    subprocess.run(["make", "-s", "-C", str(ROOT / "engine_c"), f"BUILD={build}",
                    str(build / "libechospec_engine.so")], check=True, capture_output=True, text=True)
    lib = build / "libechospec_engine.so"
    stripped = build / "stripped.so"
    subprocess.run(["strip", "-o", str(stripped), str(lib)], check=True)
    return stripped


def test_stripped_library_size(built_lib):
    size = built_lib.stat().st_size
    print(f"stripped libechospec_engine.so: {size} bytes (limit {LIMIT})")
    assert size <= LIMIT


def test_links_only_libc_libm_pthreads(built_lib):
    out = subprocess.run(["readelf", "-d", str(built_lib)], check=True, capture_output=True, text=True).stdout
    needed = {line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line}
    allowed = {"libc.so.6", "libm.so.6", "libpthread.so.0", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
    assert needed and needed <= allowed, needed


# the packed kernels of the 32-element block types and their scalar reference (quant.c, step 3);
# the attention's score and value sums (attention.c, the contract above attend_unit); the vision
# encoder's micro-kernel and its scalar twin (vision.c: one fused chain per output element)
FMA_ALLOWED = re.compile(r"(?:p_q[458]_[01]|ref_quant|ref_q[458]_[01]"
                         r"|attend_unit|block_partial|scores_v|axpy_qd|axpy_row|fma_a"
                         r"|vis_tile_[hf]1?|vis_ref_dot)(?:\.\w+)*")


def fma_by_function(disassembly: str, x86: bool) -> dict[str, int]:
    """FMA instructions per function of an `objdump -d` listing."""
    # x86-64: vfmadd*, vfmsub*, vfnmadd*, vfnmsub*, vfmaddsub*; aarch64: fmla, fmls, fmadd, fmsub, fnmadd, fnmsub
    insn = re.compile(r"\tv(?:fn?m(?:add|sub)\w*)\s" if x86 else r"\t(?:fml[as]|fn?m(?:add|sub))\s")
    head = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
    found: dict[str, int] = {}
    fn = "?"
    for line in disassembly.splitlines():
        m = head.match(line)
        if m:
            fn = m.group(1)
        elif insn.search(line + " "):
            found[fn] = found.get(fn, 0) + 1
    return found


def test_fused_multiply_add_only_where_the_contract_has_it(built_lib):
    """Every build must compute the same bits as the scalar one: -ffp-contract=off
    everywhere, so the compiler fuses nothing (GCC 12 emits vfmaddsub for interleaved
    a*b -/+ c*d loops even under -ffp-contract=off), and the only fused steps are the
    explicit ones of the contracts: the matmul's (quant.c, step 3: the packed kernels of
    the 32-element block types and their scalar reference), the attention's sums and the
    vision encoder's micro-kernel and its scalar twin (vision.c)."""
    import platform
    x86 = platform.machine() in ("x86_64", "AMD64")
    unstripped = built_lib.parent / "libechospec_engine.so"
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(unstripped)], check=True,
                         capture_output=True, text=True).stdout
    found = fma_by_function(dis, x86)
    stray = {fn: n for fn, n in found.items() if not FMA_ALLOWED.fullmatch(fn)}
    assert not stray, f"FMA instructions outside the matmul kernels: {stray}"
    if x86 and "fma" in Path("/proc/cpuinfo").read_text().split():
        # the native build's packed kernels use them: the check sees real instructions
        assert any(fn.startswith("p_q4_1") for fn in found), found


def test_the_fma_check_reads_both_architectures():
    x86 = ("0000000000001000 <p_q4_1>:\n    1000:\tvfmadd231ps %ymm1,%ymm2,%ymm3\n"
           "0000000000002000 <rope_head>:\n    2000:\tvfmaddsub132ps %ymm1,%ymm2,%ymm3\n"
           "    2004:\tvmulps %ymm1,%ymm2,%ymm3\n")
    assert fma_by_function(x86, True) == {"p_q4_1": 1, "rope_head": 1}
    a64 = ("0000000000001000 <ref_quant.constprop.0>:\n    1000:\tfmadd\ts0, s2, s0, s1\n"
           "0000000000002000 <rmsnorm>:\n    2000:\tfmla\tv0.4s, v1.4s, v2.4s\n    2004:\tfmul\tv0.4s, v1.4s, v2.4s\n")
    assert fma_by_function(a64, False) == {"ref_quant.constprop.0": 1, "rmsnorm": 1}
    assert not FMA_ALLOWED.fullmatch("rmsnorm") and FMA_ALLOWED.fullmatch("ref_quant.constprop.2")


def test_constants_come_from_the_header(tmp_path):
    """Status names and session limits are read through cffi, and the engine enforces them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ggufgen import write_tiny_model

    from echospec._engine import lib
    from echospec.services.verifier import engine
    assert engine.STATUS_NAMES[lib.ES_OK] == "ES_OK"
    assert engine.STATUS_NAMES[lib.ES_ERR_CAPACITY] == "ES_ERR_CAPACITY" and len(engine.STATUS_NAMES) == 10
    assert (engine.MAX_CTX, engine.MAX_THREADS) == (lib.ES_MAX_CTX, lib.ES_MAX_THREADS)
    assert engine.SWA_SLACK == lib.ES_SWA_SLACK == 256
    write_tiny_model(tmp_path / "m.gguf", arch="llama", n_vocab=320, seed=1)
    with engine.Model(str(tmp_path / "m.gguf")) as m:
        for kw in ({"n_ctx": engine.MAX_CTX + 1}, {"n_threads": engine.MAX_THREADS + 1}):
            with pytest.raises(engine.EngineError) as ei:
                m.new_session(**kw)
            assert ei.value.status == lib.ES_ERR_INVALID_ARG, kw
        m.new_session(n_ctx=64, n_threads=1).close()


def test_the_cli_loads_fetch_model_without_touching_sys_path(monkeypatch):
    from echospec import cli
    before = list(sys.path)
    monkeypatch.delitem(sys.modules, "fetch_model", raising=False)
    path = cli._default_model()      # the model is in the cache after setup: no download
    assert Path(path).is_file()
    assert sys.path == before and "fetch_model" not in sys.modules


def test_license_is_an_spdx_expression():
    """pyproject's license is the PEP 639 string, and the installed metadata carries it."""
    import re
    from importlib.metadata import metadata
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"', text, re.M), "license is not an SPDX string"
    assert metadata("echospec")["License-Expression"] == "Apache-2.0"


def test_services_install_under_the_echospec_import_root(tmp_path):
    """services/ is installed as echospec.services: no bare `services` module outside the tree."""
    import re
    root = Path(__file__).resolve().parents[1]
    text = (root / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(echospec\.services[\w.]*)"', text.split("packages = [", 1)[1].split("]")[0]))
    on_disk = {"echospec.services" + ("." + ".".join(p.parent.relative_to(root / "services").parts)
                                      if p.parent != root / "services" else "")
               for p in (root / "services").rglob("__init__.py")}
    assert listed == on_disk
    probe = ("import importlib.util, echospec.services.coordinator.server as s; "
             "print(importlib.util.find_spec('services') is None, s.__name__)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "echospec.services.coordinator.server"]
