"""Smoke test of bench/long_context.py (not a timed test): its command-line contract on small sizes.

`--json` prints one JSON object whose parts hold finite figures; sparse attention that covers every
block leaves the distributions unchanged (KL 0, the same NLL); the memory part's KV stays at the
eviction's size; a missing model file exits 2 naming the option. No speed is asserted.
"""
from __future__ import annotations

import json
import os
import math
import subprocess
import sys
from pathlib import Path

from ggufgen import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "long_context.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)


def test_speed_part_on_a_tiny_model(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="qwen3", matrix_type="Q4_1", embd_type="Q8_0", n_ctx_train=4096)
    r = _run("--part", "speed", "--speed-model", str(model), "--depths", "512,1024", "--samples", "2",
             "--threads", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["depth"] for row in out["speed"]] == [512, 1024]
    for row in out["speed"]:
        assert row["blocks"] == row["depth"] // 64 and row["topk"] == max(1, row["blocks"] // 8)
        assert row["T_dense_ms"] > 0 and row["T_sparse_ms"] > 0 and math.isfinite(row["ratio"])


def test_quality_and_memory_parts_on_smollm2(smollm2_path):
    # 256 tokens: 4 blocks, TOPK 1 -> the context never exceeds TOPK + 3 blocks, so sparse
    # attention reads every block: bitwise dense, KL exactly 0.
    r = _run("--part", "quality", "--model", smollm2_path, "--tokens", "256", "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)["quality"]
    assert q["tokens"] == 256 and math.isfinite(q["nll_dense"]) and q["nll_dense"] > 0
    assert q["variants"]["sparse"]["kld_mean"] == 0 and q["variants"]["sparse"]["nll"] == q["nll_dense"]
    ev = q["variants"]["eviction"]
    assert ev["kld_mean"] == 0 and ev["top1_agree"] == 1.0      # 256 < S + W: nothing evicted yet
    assert ev["kv_bytes"] > 0 and q["kv_bytes_dense"] > 0

    r = _run("--part", "memory", "--model", smollm2_path, "--memory-tokens", "1500", "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["memory"]
    assert m["tokens"] == 1500 and m["n_past"] >= 1499
    assert 0 < m["kv_bytes_eviction"] < m["kv_bytes_dense"] * 1.2
    assert m["rss_peak_mib"] >= m["rss_model_mib"] > 0


def test_missing_files_exit_2(tmp_path):
    r = _run("--part", "quality", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "--model" in r.stderr and "no such file" in r.stderr
    r = _run("--part", "speed", "--speed-model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "--speed-model" in r.stderr
    env = {**os.environ, "ECHOSPEC_CACHE": str(tmp_path)}
    r = _run("--part", "speed", env=env)
    assert r.returncode == 2 and "qwen3_shapes.py" in r.stderr
