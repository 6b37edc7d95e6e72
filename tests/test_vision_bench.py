"""bench/vision_bench.py's projector writer and arguments (not a timed test): a projector written
with the benchmark's keys and tensor names at a tiny shape loads in our engine with the sizes
asked for and encodes to finite values; bad arguments exit with a message. No speed is asserted."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("vision_bench", ROOT / "bench" / "vision_bench.py")
    vb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vb)
    return vb


def test_written_projector_loads_with_its_shape(tmp_path):
    from echospec.services.verifier.engine import Vision
    vb = _bench()
    cfg = dict(hidden=64, depth=3, heads=2, ffn=96, patch=16, merge=2, out=48, deepstack=(0, 2), n_pos=36)
    path = tmp_path / "p.gguf"
    vb.write_projector(path, cfg, seed=3)
    v = Vision(str(path))
    try:
        i = v.info
        assert (i.n_embd_vision, i.n_layer, i.n_head, i.n_embd, i.patch_size, i.merge_size) == (64, 3, 2, 48, 16, 2)
        assert i.deepstack_layers == (0, 2)
        img = vb.test_image(64, seed=1)
        mean, std = np.array(i.image_mean, np.float32), np.array(i.image_std, np.float32)
        px = ((img.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1)
        embd, ds = v.encode(px, n_threads=2)
        assert embd.shape == (4, 48) and ds.shape == (2, 4, 48)
        assert np.isfinite(embd).all() and np.isfinite(ds).all() and embd.std() > 0
    finally:
        v.close()


@pytest.mark.parametrize("args, message", [
    (["--sizes", "448,100"], "multiple of 32"),
    (["--sizes", "a"], "not a list of integers"),
    (["--threads", "0"], "at least 1"),
    (["--simd", "sse"], "invalid choice"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    vb = _bench()
    with pytest.raises(SystemExit) as e:
        vb.parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
