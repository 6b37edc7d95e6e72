"""Smoke tests of tools/perf/round_breakdown.py and cold_python.py (not timed tests).

round_breakdown.py: `--quick --json` on the tiny
model prints one JSON object per thread count whose rows hold, per K, finite non-negative parts
of a round that add up to the client's wall per round, drafts proposed every round, and
overhead = round - V; no speed is asserted."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "perf" / "round_breakdown.py"


@pytest.mark.parametrize("layout", [[], ["--processes"]], ids=["one-process", "processes"])
def test_round_breakdown_quick_json(layout):
    r = subprocess.run([sys.executable, str(TOOL), "--quick", "--json", *layout], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["n_threads"] == 1
    assert [row["k"] for row in out["rows"]] == [1, 4]
    for row in out["rows"]:
        for key in ("v", "draft", "accept", "sched", "rest", "round", "t"):
            assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
        assert row["v"] > 0 and row["draft"] > 0 and row["t"] > 0 and row["rounds"] > 0
        parts = row["v"] + row["draft"] + row["accept"] + row["sched"] + row["rest"] + row["coord"]
        assert parts == pytest.approx(row["round"], abs=1e-3)
        assert row["ovh"] == pytest.approx(row["round"] - row["v"], abs=1e-3)
        # the prediction is the plain output: every round drafts, up to K, and keeps its drafts
        assert 0 < row["drafts_per_round"] <= row["k"]
        assert row["accepted_per_round"] == pytest.approx(row["drafts_per_round"], abs=0.5)


def test_round_breakdown_bad_arguments():
    r = subprocess.run([sys.executable, str(TOOL), "--ks", "0"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "must be >= 1" in r.stderr
    r = subprocess.run([sys.executable, str(TOOL), "--model", str(ROOT / "no-such.gguf")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "no such file" in r.stderr


@pytest.mark.parametrize("between", ["forward", "stream", "sleep"])
def test_cold_python_json(tmp_path, between):
    """tools/perf/cold_python.py on the tiny model: one JSON line with both timings (no speed
    asserted), and bad arguments refused."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ggufgen import write_tiny_model
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", n_vocab=320, n_ctx_train=1024, seed=0)
    tool = ROOT / "tools" / "perf" / "cold_python.py"
    r = subprocess.run([sys.executable, str(tool), "--model", str(model), "--pairs", "3", "--k", "2",
                        "--between", between, "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["between"] == between and out["k"] == 2 and out["pairs"] == 3
    assert out["after_forward_us"] > 0 and out["warm_us"] > 0
    assert out["ratio"] == pytest.approx(out["after_forward_us"] / out["warm_us"], rel=0.02)
    bad = subprocess.run([sys.executable, str(tool), "--model", str(model), "--pairs", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--pairs" in bad.stderr
