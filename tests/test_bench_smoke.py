"""Smoke test of bench/engine_bench.py on a tiny random-weight model (not a timed test).

It checks the command-line contract users script against: `--json` prints exactly one JSON object
with decode_tok_s, prefill_tok_s, verify_ratio (K -> V(K)/T) and peer, the numbers are positive
and finite, and a missing model gives a clear error and exit status 2. No speed is asserted.
"""
from __future__ import annotations

import json
import math
import os
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
    assert out["simd_build"] == "installed"
    assert isinstance(out["host_isa"], str) and out["host_isa"]
    assert out["arch"] == "llama" and out["n_vocab"] == 320
    assert out["n_ctx"] == 64 + 17 + 8   # depth + the longest verify (K = 16) + 8
    # the engine's speed goals (llama: V(4)/T <= 1.5), the first goals kept as marks; None without the peer
    assert out["goals"]["decode_ge_1.3x_peer"] is None
    assert isinstance(out["goals"]["verify_ratio_4_le_1.5"], bool)
    assert out["goals"]["decode_at_least_peer"] is None
    assert isinstance(out["goals"]["verify_ratio_4_le_1.3"], bool)
    assert "prefill_ge_1.5x_peer" not in out["goals"]   # only for a prefill of >= 2048 tokens
    assert "[engine_bench]" in r.stderr  # progress goes to stderr

    # bench/engine_table.py turns the JSON into a table row, given the file or its directory
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "tiny.json").write_text(r.stdout)
    summ = [sys.executable, str(ROOT / "bench" / "engine_table.py")]
    for arg in (tmp_path / "res" / "tiny.json", tmp_path / "res"):
        t = subprocess.run([*summ, str(arg)], capture_output=True, text=True, timeout=60)
        assert t.returncode == 0, t.stderr
        lines = t.stdout.splitlines()
        assert lines[0].startswith("| file / setting |") and len(lines) == 3, t.stdout
        assert lines[2].startswith("| tiny.gguf, depth 64, 32-token prefill | ") and "| - |" in lines[2], lines[2]
    # a missing path, a non-result file (binary, a JSON list, a wrong field) and an empty directory:
    # exit 2, a one-line message (not the binary file's bytes, not a traceback), no table
    (tmp_path / "empty").mkdir()
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "field.json").write_text('{"model": "x", "depth": 1}')
    for arg in (tmp_path / "nope.json", tmp_path / "tiny.gguf", tmp_path / "empty", tmp_path / "list.json",
                tmp_path / "field.json"):
        t = subprocess.run([*summ, str(arg)], capture_output=True, text=True, timeout=60)
        assert t.returncode == 2 and t.stdout == "" and "engine_table:" in t.stderr, (arg, t)
        assert len(t.stderr) < 400 and t.stderr.count("\n") == 1 and "Traceback" not in t.stderr, (arg, t.stderr)


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
    """tools/perf/forward_ab.c compiles (its Makefile target), loads two engine builds side by side
    and times both on a tiny model (no speed asserted); bad arguments give a usage error, not a crash."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    engine = ROOT / "engine_c"
    subprocess.run(["make", "-s", "-C", str(engine), "BUILD=build/native",
                    "build/native/libechospec_engine.so"], check=True, timeout=1200)
    subprocess.run(["make", "-s", "-C", str(ROOT / "tools" / "perf"), f"OUT={tmp_path}", "EXTRA_CFLAGS=-Werror",
                    "forward_ab"], check=True, timeout=300)
    exe = tmp_path / "forward_ab"
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
    (["--depth", "100000"], "at most 16384"),
    (["--ks", "100000"], "at most 16384"),
    (["--simd", "sse2"], "invalid choice"),
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
    """tools/perf/step_cpu.c compiles (its Makefile target) and prints one CPU-time line per build
    and depth on a tiny model (no speed asserted); bad arguments give a usage error."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    engine = ROOT / "engine_c"
    subprocess.run(["make", "-s", "-C", str(engine), "BUILD=build/native",
                    "build/native/libechospec_engine.so"], check=True, timeout=1200)
    subprocess.run(["make", "-s", "-C", str(ROOT / "tools" / "perf"), f"OUT={tmp_path}", "EXTRA_CFLAGS=-Werror",
                    "step_cpu"], check=True, timeout=300)
    exe = tmp_path / "step_cpu"
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


def test_bench_long_context_flags(tmp_path):
    """--depth 2048 --prompt-tokens 2048 sizes the KV cache for both and adds the long-prefill goal."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0", n_ctx_train=4096)
    r = _run("--model", str(model), "--quick", "--no-peer", "--json", "--depth", "2048",
             "--prompt-tokens", "2048", "--ks", "1,4", "--rounds", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["depth"] == 2048 and out["prompt_tokens"] == 2048
    assert out["n_ctx"] == 2048 + 8 + 8   # depth + max(K + 1, decode tokens (8 with --quick)) + 8
    assert _positive(out["prefill_tok_s"]) and _positive(out["T_ms"])
    assert out["goals"]["prefill_ge_1.5x_peer"] is None


def test_bench_on_qwen3_k_quants(tmp_path):
    """--model on a qwen3 file with Q4_K matrices and a tied Q6_K head (the board's file types)."""
    model = tmp_path / "q3.gguf"
    write_tiny_model(model, arch="qwen3", matrix_type="Q4_K", embd_type="Q6_K", n_embd=256, n_ff=512,
                     n_head=4, n_head_kv=2, head_dim=128, n_vocab=1000, seed=5)
    r = _run("--model", str(model), "--quick", "--no-peer", "--json", "--ks", "1,4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["arch"] == "qwen3" and out["n_vocab"] == 1000
    assert isinstance(out["goals"]["verify_ratio_4_le_1.4"], bool)   # 1.4 on the qwen3 shapes


def test_bench_peer_flash_attn_flag_parses():
    """--peer-flash-attn is a switch of the peer only (default off, llama-cpp-python's default)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("engine_bench", BENCH)
    eb = importlib.util.module_from_spec(spec)
    sys.modules["engine_bench"] = eb
    spec.loader.exec_module(eb)
    assert eb.parse_args([]).peer_flash_attn is False
    assert eb.parse_args(["--peer-flash-attn"]).peer_flash_attn is True
    assert eb.parse_args(["--simd", "avx2"]).simd == "avx2" and eb.parse_args([]).simd == "installed"


def test_bench_simd_build_option(tmp_path):
    """--simd scalar compiles the engine module into a temporary directory and runs that build."""
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", matrix_type="Q4_1", embd_type="Q8_0")
    r = _run("--model", str(model), "--quick", "--no-peer", "--json", "--simd", "scalar", "--ks", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["simd_build"] == "scalar" and out["simd"] == "scalar"
    assert "ECHOSPEC_SIMD=scalar" in r.stderr


# ---- bench/qwen3_shapes.py: the board-shaped benchmark files ----------------------------------

SHAPES_SCRIPT = ROOT / "bench" / "qwen3_shapes.py"


def _shapes_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("qwen3_shapes", SHAPES_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["qwen3_shapes"] = mod   # its dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def test_qwen3_shapes_table_and_vocab():
    q = _shapes_module()
    assert [(s.n_embd, s.n_ff, s.n_layer, s.n_head) for s in q.SHAPES.values()] == [
        (1024, 3072, 28, 16), (2048, 6144, 28, 16), (2560, 9728, 36, 32)]
    for s in q.SHAPES.values():
        assert (s.n_head_kv, s.head_dim, s.n_vocab, s.rope_base, s.norm_eps) == (8, 128, 151936, 1e6, 1e-6)
    tokens, types, merges = q.stand_in_vocab(151936)
    assert len(tokens) == len(types) == 151936 and len(set(tokens)) == 151936
    assert merges == ["Ġ t"] and "Ġt" in tokens and "Ġ" in tokens and "t" in tokens
    assert tokens[151643:151646] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[151645] == 3 and types[1000] == 1   # CONTROL, NORMAL
    assert all(t.isascii() and t.isprintable() and " " not in t for t in tokens[257:151643])


def test_qwen3_shapes_f16_file_loads_in_our_engine(tmp_path):
    """A small shape written by write_f16 loads with the qwen3 hyperparameters and runs."""
    import numpy as np
    from echospec.services.verifier import engine

    q = _shapes_module()
    s = q.Shape("test", n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2, n_vocab=2000)
    path = tmp_path / "s.gguf"
    q.write_f16(s, path, seed=1)
    m = engine.Model(str(path))
    try:
        i = m.info
        assert (i.arch, i.n_vocab, i.n_embd, i.n_layer, i.n_head, i.n_head_kv, i.head_dim, i.n_ff) == \
            ("qwen3", 2000, 256, 2, 4, 2, 128, 512)
        assert i.tied_output and i.rope_neox and i.rope_freq_base == 1e6 and i.n_ctx_train == 40960
        sess = m.new_session(n_ctx=32, n_threads=2)
        am, _ = sess.forward(np.array([5, 600, 1999], dtype=np.int32))
        assert am.shape == (3,) and all(0 <= int(x) < 2000 for x in am)
    finally:
        m.close()


def test_qwen3_shapes_quantize_or_clear_error(tmp_path):
    """With llama-cpp-python: llama.cpp quantizes a small shape to Q4_K_M and Q8_0, the F16 file is
    deleted, and our engine loads both. Without it: a clear error naming the bench extra."""
    q = _shapes_module()
    s = q.Shape("test", n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2, n_vocab=2000)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        with pytest.raises(q.ShapesError, match=r"llama-cpp-python is not installed.*bench"):
            list(q.make_shape(s, ["Q4_K_M"], tmp_path, seed=0, keep_f16=False))
        return
    from echospec.services.verifier import engine

    paths = list(q.make_shape(s, ["Q4_K_M", "Q8_0"], tmp_path, seed=0, keep_f16=False))
    assert [p.name for p in paths] == ["qwen3-test-shape.Q4_K_M.gguf", "qwen3-test-shape.Q8_0.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no F16, no .part
    for p in paths:
        m = engine.Model(str(p))
        assert m.info.arch == "qwen3" and m.info.n_vocab == 2000
        m.close()
    assert paths[0].stat().st_size < paths[1].stat().st_size
    again = list(q.make_shape(s, ["Q4_K_M"], tmp_path, seed=0, keep_f16=False))   # kept, not remade
    assert again == paths[:1]


def test_qwen3_shapes_cli(tmp_path):
    env = dict(os.environ, ECHOSPEC_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, str(SHAPES_SCRIPT), "--list"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "bench" / n) for n in (
        "SmolLM2-135M-Instruct.Q4_K_M.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf",
        "qwen3-0.6B-shape.Q4_K_M.gguf", "qwen3-0.6B-shape.Q8_0.gguf", "qwen3-1.7B-shape.Q4_K_M.gguf")]
    r = subprocess.run([sys.executable, str(SHAPES_SCRIPT), "--list", "--shapes", "4B", "--types", "Q8_0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.split() == [str(tmp_path / "bench" / "qwen3-4B-shape.Q8_0.gguf")]
    bad = subprocess.run([sys.executable, str(SHAPES_SCRIPT), "--shapes", "7B"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "unknown shape '7B'" in bad.stderr
