"""es_forward_last (Session.prefill): the output head on the last position only,
bitwise what es_forward gives for that position, and the same KV cache after. Its
logits argument must be True or False."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.services.verifier.engine import MIN_CTX, EngineError, Model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / f"{request.param}.gguf"
    write_tiny_model(path, arch=request.param, matrix_type="Q4_1" if request.param == "llama" else "Q8_0",
                     seed=11)
    m = Model(str(path))
    yield m
    m.close()


def test_prefill_last_row_equals_forward(model):
    prompt = [5, 17, 40, 3, 99, 120, 7]
    a = model.new_session(n_ctx=64, n_threads=2)
    b = model.new_session(n_ctx=64, n_threads=1)
    am, la = a.forward(prompt, logits="all")
    tok, lb = b.prefill(prompt, logits=True)
    assert tok == am[-1]
    assert np.array_equal(la[-1:].view(np.uint32), lb.view(np.uint32))
    assert a.n_past == b.n_past == len(prompt)
    # the KV cache is the same: the next steps agree bitwise
    for t in (9, 33, 2):
        xa, ya = a.forward([t], logits="last")
        xb, yb = b.forward([t], logits="last")
        assert xa[0] == xb[0] and np.array_equal(ya.view(np.uint32), yb.view(np.uint32))


def test_prefill_errors_leave_the_cache_unchanged(model):
    s = model.new_session(n_ctx=MIN_CTX, n_threads=1)
    s.prefill([1, 2, 3])
    with pytest.raises(EngineError) as e:
        s.prefill([1] * (MIN_CTX - 2))
    assert e.value.name == "ES_ERR_CAPACITY" and s.n_past == 3
    with pytest.raises(EngineError) as e:
        s.prefill([1, 10 ** 6])
    assert e.value.name == "ES_ERR_INVALID_ARG" and s.n_past == 3
    with pytest.raises(EngineError):
        s.prefill([])
    assert s.n_past == 3


@pytest.mark.parametrize("logits", ["none", "all", "last", 1, None])
def test_prefill_logits_must_be_a_bool(tiny_model, logits):
    # was: prefill(tokens, logits="none") returned logits (a non-empty string is true) and
    # logits="all" returned the last row only, silently
    from echospec.services.verifier.engine import Model
    with Model(tiny_model()) as m, m.new_session(n_ctx=32, n_threads=1) as s:
        with pytest.raises(TypeError, match="prefill's logits must be True or False"):
            s.prefill([1, 2, 3], logits=logits)
        assert s.n_past == 0
        tok, out = s.prefill([1, 2, 3], logits=False)
        assert out is None and s.n_past == 3
        tok2, out = s.prefill([4], logits=True)
        assert out.shape == (1, m.info.n_vocab) and int(out[0].argmax()) == tok2
