"""bench/draft_replay.py's replay (pure: no stack): rounds, hits and the two estimates."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from draft_replay import ratio, replay  # noqa: E402

TABLE = {1: 1.1, 2: 1.2, 4: 1.4, 8: 2.0}


class _Oracle:
    """Proposes the real output, wrong from position ``wrong_at`` of each proposal on."""

    def __init__(self, output: list[int], wrong_at: int):
        self.output, self.wrong_at, self.history = output, wrong_at, []

    def append(self, toks):
        self.history.extend(toks)

    def propose(self, k):
        i = len(self.history) - 3            # the prompt is 3 tokens
        d = list(self.output[i:i + k])
        for j in range(self.wrong_at, len(d)):
            d[j] = -1
        return d, 0, 0


def test_ratio_interpolates_and_extrapolates():
    assert ratio(0, TABLE) == 1.0 and ratio(3, TABLE) == pytest.approx(1.3)
    assert ratio(16, TABLE) == pytest.approx(2.0 + 0.6 / 4 * 8)


def test_replay_counts_rounds_and_the_oracle_pays_only_for_kept_drafts():
    out = list(range(100, 121))               # 21 tokens: the first from the prefill
    r = replay([1, 2, 3], out, lambda: _Oracle(out, wrong_at=2), 4, TABLE)
    # six rounds draft 4, keep 2 and add the bonus (18 tokens); the last drafts the one token
    # left before the end and keeps it (2 tokens)
    assert r["rounds"] == 7 and r["tries"] == 7 and r["hits"] == 13
    assert r["est_speedup"] == pytest.approx(round(20 / (6 * 1.4 + 1.1), 2))
    assert r["est_speedup_oracle_k"] == pytest.approx(round(20 / (6 * 1.2 + 1.1), 2))
    assert r["est_speedup_oracle_k"] > r["est_speedup"]
