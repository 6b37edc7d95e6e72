"""Smoke test of bench/engine_bench.py on a tiny random-weight model (not a timed test).

It checks the command-line contract users script against: `--json` prints exactly one JSON object
with decode_tok_s, prefill_tok_s, verify_ratio (K -> V(K)/T) and peer, the numbers are positive
and finite, and a missing model gives a clear error and exit status 2. No speed is asserted.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ggufgen import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "engine_bench.py"
KS = ("1", "2", "4", "8", "16")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_json_on_tiny_model(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    r = _run("--model", str(model), "--quick", "--no-peer", "--json", "--threads", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object: anything else on stdout fails here
    assert isinstance(out, dict)

    for key in ("decode_tok_s", "prefill_tok_s", "T_ms"):
        assert _positive(out[key]), (key, out[key])
    assert sorted(out["verify_ratio"], key=int) == list(KS)
    assert sorted(out["V_ms"], key=int) == list(KS)
    for k in KS:
        assert _positive(out["verify_ratio"][k]), (k, out["verify_ratio"][k])
        assert _positive(out["V_ms"][k])
    assert out["peer"] is None
    assert "--no-peer" in out["peer_error"]
    assert out["ratios"] is None
    assert out["threads"] == 2
    assert out["depth"] == 64
    assert out["simd"] in ("avx512", "avx2", "neon-dotprod", "neon", "scalar")
    assert out["model"] == str(model)
    assert "[engine_bench]" in r.stderr  # progress goes to stderr


def test_bench_table_and_peer_absent_or_present(tmp_path):
    """The default (human) output is a table; the peer column is '-' with --no-peer."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="qwen2", matrix_type="F16", seed=3)
    r = _run("--model", str(model), "--quick", "--no-peer", "--ks", "1,4")
    assert r.returncode == 0, r.stderr
    assert "decode tok/s" in r.stdout
    assert "V(4)/T" in r.stdout
    assert "V(8)" not in r.stdout
    assert "peer: none (disabled by --no-peer)" in r.stdout


def test_bench_missing_model_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    r = _run("--model", str(missing), "--json", "--no-peer")
    assert r.returncode == 2
    assert r.stdout == ""
    assert "model file not found" in r.stderr and str(missing) in r.stderr


def test_bench_unloadable_model_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)  # truncated after the version
    r = _run("--model", str(bad), "--json", "--no-peer")
    assert r.returncode == 2
    assert r.stdout == ""
    assert "cannot load" in r.stderr and "ES_ERR_" in r.stderr


def test_forward_ab_compares_two_builds(tmp_path):
    """bench/forward_ab.c compiles, loads two engine builds side by side and times both on a tiny
    model (no speed asserted); bad arguments give a usage error, not a crash."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    engine = ROOT / "engine_c"
    subprocess.run(["make", "-s", "-C", str(engine), "BUILD=build/native",
                    "build/native/libechospec_engine.so"], check=True, timeout=1200)
    exe = tmp_path / "forward_ab"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-I", str(engine / "include"),
                    str(ROOT / "bench" / "forward_ab.c"), "-o", str(exe), "-ldl"], check=True, timeout=300)
    lib = engine / "build" / "native" / "libechospec_engine.so"
    lib2 = tmp_path / "copy.so"
    shutil.copy(lib, lib2)

    r = subprocess.run([str(exe), str(model), "3", str(lib), str(lib2)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == [str(lib), str(lib2)]
    for line in lines:
        m = re.search(r"T ([\d.]+) ms  V\(4\) ([\d.]+) ms  V\(4\)/T ([\d.]+)", line)
        assert m, line
        assert all(_positive(float(v)) for v in m.groups()), line

    deep = subprocess.run([str(exe), str(model), "2", "-d", "150", str(lib)], capture_output=True, text=True,
                          timeout=300)
    assert deep.returncode == 0 and "depth 150 " in deep.stdout, deep.stderr
    for depth in ("0", "x"):
        bad = subprocess.run([str(exe), str(model), "2", "-d", depth, str(lib)], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and "DEPTH" in bad.stderr, (depth, bad.stderr)

    usage = subprocess.run([str(exe), str(model)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    for rounds in ("0", "10abc", "1500000000"):
        bad = subprocess.run([str(exe), str(model), rounds, str(lib)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "ROUNDS" in bad.stderr, (rounds, bad.stderr)
    libm = subprocess.run([str(exe), str(model), "2", "libm.so.6"], capture_output=True, text=True, timeout=60)
    assert libm.returncode == 1 and "not an echospec engine build" in libm.stderr, libm.stderr
    missing = subprocess.run([str(exe), str(tmp_path / "missing.gguf"), "2", str(lib)],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "missing.gguf" in missing.stderr
    nolib = subprocess.run([str(exe), str(model), "2", str(tmp_path / "none.so")],
                           capture_output=True, text=True, timeout=60)
    assert nolib.returncode == 1 and "none.so" in nolib.stderr


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed -1"),
    (["--depth", "100000"], "at most 8192"),
    (["--ks", "100000"], "at most 8192"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--threads", "300"], "at most 256 threads"),
])
def test_bench_argument_errors(tmp_path, args, message):
    """Found by the second new-user trial: these crashed, ran for minutes, or were overridden by --quick."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    r = _run("--model", str(model), "--quick", "--no-peer", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_quick_keeps_explicit_flags(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    r = _run("--model", str(model), "--quick", "--no-peer", "--json", "--rounds", "3", "--ks", "1,2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["rounds"] == 3 and out["inner"] == 2   # --rounds given, --inner from --quick


def test_step_cpu_times_builds_at_depths(tmp_path):
    """bench/step_cpu.c compiles and prints one CPU-time line per build and depth on a tiny model
    (no speed asserted); bad arguments give a usage error."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    engine = ROOT / "engine_c"
    subprocess.run(["make", "-s", "-C", str(engine), "BUILD=build/native",
                    "build/native/libechospec_engine.so"], check=True, timeout=1200)
    exe = tmp_path / "step_cpu"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-I", str(engine / "include"),
                    str(ROOT / "bench" / "step_cpu.c"), "-o", str(exe), "-ldl"], check=True, timeout=300)
    lib = engine / "build" / "native" / "libechospec_engine.so"
    r = subprocess.run([str(exe), str(model), "1", "3", "1", "10", "200", "--", str(lib)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [int(re.search(r"depth +(\d+)", line).group(1)) for line in lines] == [10, 200]
    for line in lines:
        m = re.search(r"step cpu ([\d.]+) ms \(min ([\d.]+)\)", line)
        assert m and all(_positive(float(v)) for v in m.groups()), line
    for args in ([], ["1", "3", "1", "10"], ["0", "3", "1", "10", "--", str(lib)]):
        bad = subprocess.run([str(exe), str(model), *args], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2, (args, bad.stderr)
    libm = subprocess.run([str(exe), str(model), "1", "2", "1", "10", "--", "libm.so.6"], capture_output=True,
                          text=True, timeout=60)
    assert libm.returncode == 1 and "not an echospec engine build" in libm.stderr, libm.stderr
