"""bench/tree_bench.py: the tree shapes it times, and one untimed run on a tiny model (JSON keys)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from ggufgen import write_tiny_model  # noqa: E402
from tree_bench import tree_shape  # noqa: E402


def test_tree_shape_is_a_root_with_branches():
    assert tree_shape(1, 3) == [-1]
    assert tree_shape(2, 3) == [-1, 0]
    assert tree_shape(4, 3) == [-1, 0, 0, 0]
    # 7 nodes, 3 branches of 2: root, then 1-2, 3-4, 5-6
    assert tree_shape(7, 3) == [-1, 0, 1, 0, 3, 0, 5]
    # the remainder goes to the first branches: 6 nodes = root + 2 + 2 + 1
    assert tree_shape(6, 3) == [-1, 0, 1, 0, 3, 0]


def test_one_run_on_a_tiny_model(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, arch="llama", seed=2)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tree_bench.py"), "--model", str(path),
                          "--threads", "1", "--depth", "20", "--nodes", "1", "5", "--rounds", "2", "--reps", "1",
                          "--json"], check=True, capture_output=True, text=True).stdout
    res = json.loads(out)
    assert set(res["tree_over_chain"]) == {"1", "5"} and res["depth"] == 20 and res["threads"] == 1
    assert all(v > 0 for v in res["tree_ms"].values()) and res["T_ms"] > 0
