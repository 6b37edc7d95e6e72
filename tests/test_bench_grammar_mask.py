"""Smoke test of bench/grammar_mask.py (not a timed test): one JSON object, finite positive figures,
a forced share in [0, 1] that is above 0 on a JSON schema (its keys are forced), exit 2 for a
missing file."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "grammar_mask.py"


def test_grammar_mask_json(smollm2_path, tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join((ROOT / "workloads" / "structured_json.jsonl").read_text().splitlines()[:2]) + "\n")
    r = subprocess.run([sys.executable, str(BENCH), "--workloads", str(wl), "--model", smollm2_path,
                        "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [w["id"] for w in out["workloads"]] == ["json_01", "json_02"]
    for row in out["workloads"] + [out["total"]]:
        for key in ("mask_ms", "argmax_ms", "T_ms", "share"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert 0 < row["forced"] <= 1
    assert out["total"]["tokens"] == 24


def test_grammar_mask_missing_file(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--workloads", str(tmp_path / "none.jsonl"),
                        "--model", str(BENCH)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "none.jsonl: no such file" in r.stderr
