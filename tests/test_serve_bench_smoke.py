"""Smoke test of bench/serve_bench.py on a tiny random model (no speed is asserted).

The command-line contract: `--json` prints one JSON object with the concurrency levels for each
batch_max, the paired figure, the plain decode comparison and the prefix reuse figures; outputs under concurrency
equal the one-at-a-time outputs, and the repeated prompt's second run reuses all but one token.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_serve_bench_json_on_tiny_model():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--model", "tiny", "--quick",
                        "--threads", "1", "--clients", "1,2,4", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["concurrency"]) == {"batch_max_1", "batch_max_8"}
    for levels in out["concurrency"].values():
        assert set(levels) == {"1", "2", "4"}
        for lv in levels.values():
            assert lv["identical"] is True
            assert lv["aggregate_tok_s"] > 0 and lv["ttft_ms_p50"] > 0
    pr = out["paired"]
    assert pr["clients"] == 4 and len(pr["pairs"]) == 1 and pr["pairs"][0]["identical"] is True
    assert pr["median_ratio"] > 0
    assert len(pr["engine_pairs"]) == 1 and pr["engine_median_ratio"] > 0 and pr["stack_share"] > 0
    pd = out["plain_decode"]
    assert pd["stack_tok_s"] > 0 and pd["engine_tok_s"] > 0 and pd["t_ms"] > 0
    px = out["prefix"]
    assert px["prompt_tokens"] == 300 and px["cached_prompt_tokens"] == 299 and px["identical"] is True


def test_serve_bench_quick_keeps_explicit_flags():
    """--quick presets only the sizes not given (it overwrote --rounds 3 with 2, --long-tokens with 300)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--model", "tiny", "--quick",
                        "--threads", "1", "--clients", "1", "--batch-max", "1", "--pairs", "0",
                        "--rounds", "3", "--long-tokens", "40", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plain_decode"]["rounds"] == 3 and out["prefix"]["prompt_tokens"] == 40   # given
    assert out["max_tokens"] == 16 and out["plain_decode"]["tokens"] == 32                # --quick's
    assert "paired" not in out


@pytest.mark.parametrize("args, message", [
    (["--clients", "0"], "--clients needs comma-separated integers >= 1, got '0'"),
    (["--clients", "1,x"], "--clients needs comma-separated integers >= 1"),
    (["--batch-max", "0"], "--batch-max needs comma-separated integers >= 1"),
    (["--rounds", "-1"], "--rounds must be >= 1, got -1"),
    (["--pairs", "-1"], "--pairs must be >= 0, got -1"),
    (["--decode-tokens", "0"], "--decode-tokens must be >= 1, got 0"),
    (["--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no such file"),
])
def test_serve_bench_argument_errors(args, message):
    # was: --clients 0 a traceback (max() of an empty sequence), --rounds -1 and --pairs -1 a run,
    # a missing --model a StackError traceback after starting the stack
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--quick", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
