"""Corrupt weights are refused, not turned into empty output.

- A copy of the SmolLM2 file with 2 MB of tensor data overwritten with 0xFF bytes is
  refused at load (the engine checks every block scale and float value): `echospec generate`
  on it exits 1 naming the tensor, before any stack starts, and so does `--check-weights`.
- A NaN that only appears at run time (finite output-norm weights whose products overflow,
  which no load check can see) is an error with the engine's message, not "" and
  finish_reason eos: the verifier's warm-up refuses the model, and a generation's
  ES_ERR_BAD_WEIGHTS becomes INTERNAL.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from echospec.services.text import gguf_reader
from echospec.services.verifier.engine import ES_ERR_BAD_WEIGHTS, EngineError, Model

sys.path.insert(0, str(Path(__file__).parent))
from conftest import stack_stub  # noqa: E402

ECHOSPEC = [sys.executable, "-m", "echospec.cli"]
SPAN = 2 * 1024 * 1024


def _tensor_at(path: str, name: str) -> tuple[int, int]:
    """(file offset, bytes) of tensor `name` of the GGUF at path."""
    g = gguf_reader.read(path)
    t = next(t for t in g.tensors if t.name == name)
    return g.data_start + t.offset, t.nbytes


def _ff_copy(src: str, dst: Path) -> str:
    """dst: src with 2 MB of 0xFF from the middle of its largest tensor; returns that tensor's name."""
    shutil.copyfile(src, dst)
    g = gguf_reader.read(str(dst))
    big = max(g.tensors, key=lambda t: t.nbytes)
    assert big.nbytes > 2 * SPAN
    with open(dst, "r+b") as f:
        f.seek(g.data_start + big.offset + big.nbytes // 4)
        f.write(b"\xff" * SPAN)
    return big.name


def test_ff_weights_are_refused_at_load_naming_the_tensor(smollm2_path, tmp_path):
    bad = tmp_path / "ff.gguf"
    name = _ff_copy(smollm2_path, bad)
    for check in (False, True):
        with pytest.raises(EngineError) as ei:
            Model(str(bad), repack=False, check_weights=check)
        assert ei.value.status == ES_ERR_BAD_WEIGHTS, ei.value
        assert f"tensor '{name}'" in ei.value.message and "NaN" in ei.value.message, ei.value.message
    env = {**os.environ, "GRPC_VERBOSITY": "NONE"}
    r = subprocess.run([*ECHOSPEC, "generate", "Count from one to ten:", "--max-tokens", "4",
                        "--model", str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    assert f"is unusable: ES_ERR_BAD_WEIGHTS: weights: tensor '{name}'" in r.stderr, r.stderr
    assert "starting a private stack" not in r.stderr   # refused before anything starts


def test_serve_check_weights_refuses_naming_the_tensor(smollm2_path, tmp_path, capsys):
    from echospec import cli
    bad = tmp_path / "ff.gguf"
    name = _ff_copy(smollm2_path, bad)
    args = cli.parse_args(["serve", "--port", "0", "--model", str(bad), "--check-weights"])
    assert args.check_weights is True
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    err = capsys.readouterr().err
    assert ei.value.code == 1, err
    assert f"tensor '{name}'" in err and "ES_ERR_BAD_WEIGHTS" in err, err


def test_clean_file_passes_the_full_check(smollm2_path):
    Model(smollm2_path, repack=False, check_weights=True).close()


def test_nan_at_run_time_is_an_error_not_empty_output(smollm2_path, tmp_path):
    """Finite output-norm weights (the load check passes) whose products overflow: every
    logits row is NaN. The verifier's warm-up forward gets ES_ERR_BAD_WEIGHTS, so the stack
    refuses to start naming it, and `echospec generate` exits 1 with the engine's message
    instead of printing "" with finish_reason eos."""
    from echospec.stack import StackError
    bad = tmp_path / "overflow.gguf"
    shutil.copyfile(smollm2_path, bad)
    off, nbytes = _tensor_at(str(bad), "output_norm.weight")
    with open(bad, "r+b") as f:
        f.seek(off)
        f.write(np.full(nbytes // 4, 3.4e38, dtype="<f4").tobytes())
    Model(str(bad), repack=False).close()   # finite: loads
    with pytest.raises(StackError) as ei:
        with stack_stub(str(bad), spec=False, n_ctx=256):
            pass
    msg = str(ei.value)
    assert msg.startswith("verifier: ES_ERR_BAD_WEIGHTS: the logits of position ") and "NaN" in msg, msg
    env = {**os.environ, "GRPC_VERBOSITY": "NONE"}
    r = subprocess.run([*ECHOSPEC, "generate", "Count from one to ten:", "--max-tokens", "4",
                        "--model", str(bad)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "ES_ERR_BAD_WEIGHTS" in r.stderr, r.stderr


def test_a_nan_row_in_a_generation_is_internal_with_the_message():
    """The verifier turns the engine's ES_ERR_BAD_WEIGHTS of a generation into a VerifierError
    of kind INTERNAL (the gRPC status the client gets) carrying the engine's message."""
    from echospec.services.verifier.sessions import VerifierError, engine_error
    e = engine_error(EngineError(ES_ERR_BAD_WEIGHTS, "the logits of position 9 hold a NaN"), "generation")
    assert isinstance(e, VerifierError) and e.kind == "INTERNAL"
    assert e.message == "generation: ES_ERR_BAD_WEIGHTS: the logits of position 9 hold a NaN"
