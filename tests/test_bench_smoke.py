"""Smoke test of bench/engine_bench.py on a tiny random-weight model (not a timed test).

It checks the command-line contract users script against: `--json` prints exactly one JSON object
with decode_tok_s, prefill_tok_s, verify_ratio (K -> V(K)/T) and peer, the numbers are positive
and finite, and a missing model gives a clear error and exit status 2. No speed is asserted.
"""
from __future__ import annotations

import dataclasses
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
    (["--ks", "abc"], "not a comma-separated list of integers"),
    (["--ks", "0,2"], "every K must be >= 1"),
])
def test_bench_argument_errors(tmp_path, args, message):
    """Flags that crashed, ran for minutes, were overridden by --quick or gave Python's own words."""
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
    dense = [s for s in q.SHAPES.values() if s.arch == "qwen3"]
    assert [(s.n_embd, s.n_ff, s.n_layer, s.n_head) for s in dense] == [
        (1024, 3072, 28, 16), (2048, 6144, 28, 16), (2560, 9728, 36, 32)]
    for s in dense:
        assert (s.n_head_kv, s.head_dim, s.n_vocab, s.rope_base, s.norm_eps) == (8, 128, 151936, 1e6, 1e-6)
    moe, vl2, vl8 = q.SHAPES["30B-A3B"], q.SHAPES["VL-2B"], q.SHAPES["VL-8B"]
    assert (moe.arch, moe.n_embd, moe.n_layer, moe.n_head, moe.n_head_kv, moe.n_expert, moe.n_expert_used,
            moe.n_ff_exp, moe.tied, moe.direct) == ("qwen3moe", 2048, 48, 32, 4, 128, 8, 768, False, True)
    assert q.SHAPES["30B-A3B-L8"] == dataclasses.replace(moe, name="30B-A3B-L8", n_layer=8)
    assert (vl2.arch, vl2.n_embd, vl2.n_ff, vl2.n_layer, vl2.n_head, vl2.tied) == ("qwen3vl", 2048, 6144, 28, 16, True)
    assert (vl8.n_embd, vl8.n_ff, vl8.n_layer, vl8.n_head, vl8.tied) == (4096, 12288, 36, 32, False)
    assert vl2.rope_sections == vl8.rope_sections == (24, 20, 20, 0) and vl2.rope_base == 5e6
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


TINY_MOE = dict(name="tiny-moe", n_embd=256, n_ff=1024, n_layer=8, n_head=4, n_head_kv=2, n_vocab=2000,
                arch="qwen3moe", tied=False, n_expert=16, n_expert_used=4, n_ff_exp=256)


def test_qwen3_shapes_q4_k_m_direct(tmp_path):
    """write_q4_k_m: the keys of a qwen3moe file, the Q4_K_M types, finite weights of the planned std."""
    import gguf
    import numpy as np

    q = _shapes_module()
    s = q.Shape(**TINY_MOE)
    path = tmp_path / "m.gguf"
    q.write_q4_k_m(s, path, seed=1)
    r = gguf.GGUFReader(str(path))
    scalar = {k: f.parts[f.data[0]][0] for k, f in r.fields.items() if k.startswith("qwen3moe.")}
    assert scalar == {"qwen3moe.block_count": 8, "qwen3moe.context_length": 40960, "qwen3moe.embedding_length": 256,
                      "qwen3moe.feed_forward_length": 1024, "qwen3moe.attention.head_count": 4,
                      "qwen3moe.attention.head_count_kv": 2, "qwen3moe.rope.freq_base": 1e6,
                      "qwen3moe.attention.layer_norm_rms_epsilon": np.float32(1e-6), "qwen3moe.expert_count": 16,
                      "qwen3moe.expert_used_count": 4, "qwen3moe.attention.key_length": 128,
                      "qwen3moe.attention.value_length": 128, "qwen3moe.expert_feed_forward_length": 256}
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert [t.name for t in r.tensors] == [n for n, _, _ in q.tensor_plan(s)]
    assert list(types.values()) == q.q4_k_m_types(s)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(8)] == \
        [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all()
        if t.name.endswith("exps.weight"):
            assert w.shape == ((16, 256, 256)) and abs(w.std() * np.sqrt(256) / 0.7 - 1) < 0.15


def test_qwen3_shapes_q4_k_m_types_match_llama_cpp(tmp_path):
    """The types write_q4_k_m uses are the ones llama.cpp's quantizer picks from an F16 file of the
    same architecture and layer count (48 layers: its layer rules depend on the count); and llama.cpp
    loads and decodes the directly written file and a qwen3vl file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import gguf
    import numpy as np

    q = _shapes_module()
    q.quiet_llama_cpp()
    for n_layer in (8, 48):
        s = q.Shape(**dict(TINY_MOE, n_layer=n_layer, n_embd=256, n_ff_exp=256, n_vocab=512))
        q.write_f16(s, tmp_path / "f16.gguf")
        q.quantize(tmp_path / "f16.gguf", tmp_path / "q.gguf", "Q4_K_M")
        got = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
        assert got == dict(zip([n for n, _, _ in q.tensor_plan(s)], q.q4_k_m_types(s))), n_layer   # its order differs
    s = q.Shape(**TINY_MOE)
    # (llama.cpp aborts on a qwen3vl with fewer layers than deepstack layers; real models have many more)
    vl = q.Shape("tiny-vl", n_embd=256, n_ff=512, n_layer=4, n_head=4, n_head_kv=2, n_vocab=2000, arch="qwen3vl",
                 rope_sections=(24, 20, 20, 0), n_deepstack=3, tied=False)
    q.write_q4_k_m(s, tmp_path / "m.gguf")
    paths = [tmp_path / "m.gguf"] + list(q.make_shape(vl, ["Q4_K_M"], tmp_path, seed=0, keep_f16=False))
    for path in paths:
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, verbose=False)
        llm.eval([5, 600, 1999])
        assert llm.n_tokens == 3 and np.isfinite(llm.scores[:3]).all()
        llm.close()


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
    r = subprocess.run([sys.executable, str(SHAPES_SCRIPT), "--list", "--shapes", "30B-A3B,30B-A3B-L8,VL-2B,VL-8B",
                        "--types", "Q4_K_M"], capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.split() == [str(tmp_path / "bench" / n) for n in (
        "qwen3moe-30B-A3B-shape.Q4_K_M.gguf", "qwen3moe-30B-A3B-L8-shape.Q4_K_M.gguf",
        "qwen3vl-2B-shape.Q4_K_M.gguf", "qwen3vl-8B-shape.Q4_K_M.gguf")]
    bad = subprocess.run([sys.executable, str(SHAPES_SCRIPT), "--list", "--shapes", "30B-A3B", "--types", "Q8_0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "30B-A3B: written directly as Q4_K_M" in bad.stderr


# ---- bench/quality_kld.py -------------------------------------------------------------------

KLD = ROOT / "bench" / "quality_kld.py"


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/m.gguf"], "model file not found: /nonexistent/m.gguf"),
    (["--model", str(ROOT / "tests/data/models/gemma3-Q8_0.gguf"), "--texts", "/nonexistent.txt"],
     "text file not found: /nonexistent.txt"),
    (["--model", str(ROOT / "tests/data/models/gemma3-Q8_0.gguf"), "--threads", "0"], "--threads 0"),
])
def test_quality_kld_argument_errors(args, message):
    r = subprocess.run([sys.executable, str(KLD), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_quality_kld_on_the_gemma3_fixture(tmp_path):
    """Both engines against llama.cpp's F32 copy of a tiny gemma3 file: small, finite KLDs."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) runs the reference")
    text = tmp_path / "t.txt"
    text.write_text("The harbour town woke slowly in winter. " * 8)
    r = subprocess.run([sys.executable, str(KLD), "--model", str(ROOT / "tests/data/models/gemma3-Q8_0.gguf"),
                        "--texts", str(text), "--max-tokens", "48", "--json"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**os.environ, "ECHOSPEC_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["texts"]["t.txt"]
    for eng in ("echospec", "llama.cpp"):
        assert 0 <= out[eng]["kld_mean"] < 0.05 and 0.8 <= out[eng]["top1_agree"] <= 1.0, out
