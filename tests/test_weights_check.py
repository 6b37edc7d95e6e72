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


def overflow_copy(src: str, dst: Path) -> None:
    """dst: src with finite output-norm weights (3.4e38) whose products overflow: the file loads,
    and every logits row is NaN."""
    shutil.copyfile(src, dst)
    off, nbytes = _tensor_at(str(dst), "output_norm.weight")
    with open(dst, "r+b") as f:
        f.seek(off)
        f.write(np.full(nbytes // 4, 3.4e38, dtype="<f4").tobytes())


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
    overflow_copy(smollm2_path, bad)
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


def test_a_nan_row_during_a_generation_reaches_the_client(smollm2_path, monkeypatch):
    """A generation whose engine step fails with ES_ERR_BAD_WEIGHTS (as a NaN logits row
    makes it: test_weights.c) ends with INTERNAL and the engine's message at the client, over
    the real stack (coordinator -> verifier), for the prefill and for a decode run."""
    import grpc
    from echospec.services.verifier import scheduler as sched
    from echospec.stack import start_stack
    from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc

    msg = "the logits of position 12 hold a NaN (or the output head's input is not finite)"
    st = start_stack(smollm2_path, spec=False, n_ctx=256)
    ch = grpc.insecure_channel(st.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        req = cpb.CompleteRequest(text="Count from one to ten: one, two,", max_tokens=8,
                                  spec=common_pb2.SPEC_MODE_OFF)
        assert stub.Complete(req, timeout=120).result.text   # the stack works
        core = st.verifier.core
        real_decode, real_run = sched.decode_batch, core.scheduler._run_batch
        failing = lambda items, *a: [EngineError(ES_ERR_BAD_WEIGHTS, msg) for _ in items]  # noqa: E731
        for where in ("prefill", "decode"):
            if where == "prefill":
                monkeypatch.setattr(core.scheduler, "_run_batch", failing)
            else:   # the prompt's forward and one step run (tokens reach the client), then fail
                monkeypatch.undo()
                steps = [0]

                def once(real):
                    def call(items, *a):
                        if all(isinstance(it[1], list) and len(it[1]) > 1 for it in items):
                            return real(items, *a)   # the prompt
                        steps[0] += 1
                        return real(items, *a) if steps[0] == 1 else failing(items)
                    return call
                monkeypatch.setattr(sched, "decode_batch", once(real_decode))
                monkeypatch.setattr(core.scheduler, "_run_batch", once(real_run))
            with pytest.raises(grpc.RpcError) as ei:
                r = stub.Complete(cpb.CompleteRequest(text=f"{where}: one, two,", max_tokens=48,
                                                      spec=common_pb2.SPEC_MODE_OFF), timeout=120)
                pytest.fail(f"{where}: no error, {r.result.text!r} {r.result.finish_reason!r}")
            assert ei.value.code() == grpc.StatusCode.INTERNAL, (where, ei.value.details())
            assert f"ES_ERR_BAD_WEIGHTS: {msg}" in ei.value.details(), (where, ei.value.details())
        monkeypatch.undo()
        assert sched.decode_batch is real_decode
        assert stub.Complete(req, timeout=120).result.text   # and goes on
    finally:
        ch.close()
        st.stop()
