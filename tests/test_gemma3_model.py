"""gemma3 (Gemma 3's text decoder) in the engine, against transformers and llama.cpp.

tests/data/models/gemma3-Q8_0.gguf was made the way real files are made (scripts/make_fixtures.py:
a tiny random Gemma3ForCausalLM with SmolLM2's tokenizer, llama.cpp's converter and quantizer): 6
layers, 4 / 1 heads of 64, a sliding window of 16 on layers 0-4 (layer 5 global), local RoPE base
10000, global 1e6, tied Q8_0 embedding. Its .ref.npz holds transformers' float32 logits on the
file's own dequantized weights and llama.cpp's logits, for four prompts, the last one (40 tokens)
longer than twice the window.

The engine quantizes activations to int8 blocks (as llama.cpp does), so its logits differ from
transformers' float ones by about as much as llama.cpp's do. Stated bounds, per prompt:
  - max |ours - transformers| <= 1.25 * max |llama.cpp - transformers| + 0.1, and the same for the
    median with + 0.02 (on par with llama.cpp);
  - the argmax equals transformers' wherever transformers' top-2 margin exceeds 0.5.
A wrong window, RoPE base, norm or activation moves the logits by O(1) (logit std 1.1).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from echospec.services.verifier.engine import Model
from fixture_checks import (check_batch_is_each_session_alone, check_logits_on_par_with_llama_cpp,
                            check_one_call_is_single_steps, prompts)

MODELS = Path(__file__).resolve().parent / "data" / "models"
NAME = "gemma3-Q8_0"
LONG = 3            # the prompt longer than the window


@pytest.fixture(scope="module")
def model():
    m = Model(str(MODELS / f"{NAME}.gguf"))
    yield m, np.load(MODELS / f"{NAME}.ref.npz")
    m.close()


def test_model_info(model):
    m, _ = model
    i = m.info
    assert i.arch == "gemma3"
    assert (i.n_layer, i.n_embd, i.n_head, i.n_head_kv, i.head_dim, i.n_ff) == (6, 128, 4, 1, 64, 512)
    assert (i.n_swa, i.n_swa_layers) == (16, 5)          # llama.cpp's default pattern: every 6th layer global
    assert i.rope_freq_base == 1e6 and i.rope_freq_base_swa == 1e4 and i.rope_freq_scale == 1.0
    assert i.rope_neox and i.tied_output and i.norm_eps == pytest.approx(1e-6)


def test_the_long_prompt_runs_past_the_window(model):
    _, z = model
    assert len(z[f"p{LONG}_tokens"]) >= 40


def test_logits_on_par_with_llama_cpp_against_transformers(model):
    m, z = model
    check_logits_on_par_with_llama_cpp(m, z, top_logits=True)


def test_past_the_window_rows_follow_transformers(model):
    """The rows whose window leaves the first positions out (16 and later) are as close as the
    others: a window one position too wide or too narrow shows there."""
    m, z = model
    toks = [int(t) for t in z[f"p{LONG}_tokens"]]
    s = m.new_session(n_ctx=64, n_threads=2)
    _, lg = s.forward(toks, logits="all")
    s.close()
    tf, ll = z[f"p{LONG}_subset_logits"], z[f"p{LONG}_llama_subset_logits"]
    late = np.abs(lg[16:, z["subset"]] - tf[16:]).max()
    assert late <= 1.25 * float(np.abs(ll[16:] - tf[16:]).max()) + 0.1


def test_one_call_is_bitwise_single_steps_past_the_window(model):
    m, z = model
    toks = [int(t) for t in z[f"p{LONG}_tokens"]]

    def after_a_rollback(s, rows, threads):
        # a rollback across the window, then a verify-sized call: the same rows again
        s.rollback(21)
        _, again = s.forward(toks[21:26], logits="all")
        assert np.array_equal(again, np.stack(rows[21:26])), f"after a rollback, {threads} threads"

    check_one_call_is_single_steps(m, toks, then=after_a_rollback)


def test_a_batch_of_sessions_is_each_session_alone(model):
    m, z = model
    check_batch_is_each_session_alone(m, [toks for _, toks in prompts(z)])
