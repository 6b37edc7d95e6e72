"""An image in the text model's prompt: es_vision_encode's embeddings fed to es_forward_embd.

tests/data/models/qwen3vl-mmproj-F16.ref.npz (scripts/make_fixtures.py) holds transformers' float32
logits of the whole Qwen3-VL fixture (text weights of qwen3vl-Q8_0.gguf dequantized, vision weights
of the projector) for a chat turn with the test image: 3 tokens, <|vision_start|>, 70 image tokens,
<|vision_end|>, 13 tokens (`vl_tokens`), at transformers' multimodal positions (`vl_pos_thw`),
with the deepstack features added after the first text layer at the image rows.

Bound: the engine quantizes activations to q8_0 for the Q8_0 matrices (as llama.cpp does), so it
parts from float32 transformers by up to about 0.25 logit units on this file's text prompts too
(logit std 1.9); BOUND = 0.5 at every position (512 fixed vocabulary ids, and the whole last row).
Leaving out the deepstack or the image positions moves the logits by 1.3 and 4.2: well outside it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from echospec._engine import ffi, lib

MODELS = Path(__file__).resolve().parent / "data" / "models"
REF = MODELS / "qwen3vl-mmproj-F16.ref.npz"
IMAGE_TOKEN = 49154
BOUND = 0.5


@pytest.fixture(scope="module")
def ref():
    return np.load(REF)


@pytest.fixture(scope="module")
def image(ref):
    """The engine's image embeddings and deepstack outputs for the stored image."""
    out = ffi.new("es_vision **")
    err = ffi.new("char[512]")
    assert lib.es_vision_load(str(MODELS / "qwen3vl-mmproj-F16.gguf").encode(), out, err, 512) == lib.ES_OK
    v = out[0]
    t, gh, gw = (int(x) for x in ref["image_grid_thw"][0])
    a = ref["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)
    img = np.ascontiguousarray(a[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 16, gw * 16),
                               dtype=np.float32)
    n = (gh // 2) * (gw // 2)
    embd = np.zeros((n, 64), np.float32)
    ds = np.zeros((1, n, 64), np.float32)
    assert lib.es_vision_encode(v, ffi.from_buffer("float[]", img), gh * 16, gw * 16, 2,
                                ffi.from_buffer("float[]", embd), ffi.from_buffer("float[]", ds)) == lib.ES_OK
    lib.es_vision_free(v)
    return embd, ds


@pytest.fixture(scope="module")
def session():
    m = ffi.new("es_model **")
    s = ffi.new("es_session **")
    err = ffi.new("char[512]")
    assert lib.es_model_load(str(MODELS / "qwen3vl-Q8_0.gguf").encode(), ffi.NULL, m, err, 512) == lib.ES_OK
    assert lib.es_session_new(m[0], ffi.NULL, s, err, 512) == lib.ES_OK, ffi.string(err).decode()
    yield s[0]
    lib.es_session_free(s[0])
    lib.es_model_free(m[0])


def forward_embd(session, tokens, pos, embd, ds, n_vocab=49216):
    assert lib.es_session_rollback(session, 0) == lib.ES_OK
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    n = len(toks)
    logits = np.zeros((n, n_vocab), np.float32)
    argmax = np.zeros(n, np.int32)
    st = lib.es_forward_embd(session, ffi.from_buffer("int32_t[]", toks), n,
                             ffi.from_buffer("int32_t[]", pos) if pos is not None else ffi.NULL,
                             ffi.from_buffer("float[]", embd) if embd is not None else ffi.NULL,
                             int((toks == lib.ES_TOKEN_EMBD).sum()),
                             ffi.from_buffer("float[]", ds) if ds is not None else ffi.NULL,
                             0 if ds is None else ds.shape[0],
                             ffi.from_buffer("int32_t[]", argmax), ffi.from_buffer("float[]", logits),
                             lib.ES_LOGITS_ALL)
    return st, logits, argmax


def image_tokens(ref):
    toks = ref["vl_tokens"].astype(np.int32).copy()
    toks[toks == IMAGE_TOKEN] = lib.ES_TOKEN_EMBD
    return toks, np.ascontiguousarray(ref["vl_pos_thw"], dtype=np.int32)


def test_image_prompt_logits_match_transformers(ref, image, session):
    toks, pos = image_tokens(ref)
    embd, ds = image
    st, logits, argmax = forward_embd(session, toks, pos, embd, ds)
    assert st == lib.ES_OK, ffi.string(lib.es_session_last_error(session)).decode()
    sub = ref["vl_subset"]
    assert np.abs(logits[:, sub] - ref["vl_subset_logits"]).max() < BOUND
    assert np.abs(logits[-1] - ref["vl_last_logits"]).max() < BOUND
    # argmax: transformers' wherever its top-2 margin exceeds twice the bound (11 of 88 positions); the
    # first generated token is a near-tie in transformers (margin 0.24): one of its top two
    top, top_ids = ref["vl_top_logits"], ref["vl_top_ids"]
    clear = top[:, 0] - top[:, 1] > 2 * BOUND
    assert clear.sum() >= 10
    assert np.array_equal(argmax[clear], top_ids[clear, 0])
    assert argmax[-1] in top_ids[-1, :2]
    # the test can fail: without deepstack the image rows, with text positions every row, part by far more
    _, no_ds, _ = forward_embd(session, toks, pos, embd, None)
    rows = toks == lib.ES_TOKEN_EMBD
    assert np.abs(no_ds[rows][:, sub] - ref["vl_subset_logits"][rows]).max() > 2 * BOUND
    _, text_pos, _ = forward_embd(session, toks, None, embd, ds)
    assert np.abs(text_pos[:, sub] - ref["vl_subset_logits"]).max() > 2 * BOUND


def test_without_embedding_rows_it_is_es_forward_positions(ref, session):
    toks = ref["vl_tokens"][:3].astype(np.int32)
    pos = np.ascontiguousarray(ref["vl_pos_thw"][:3], dtype=np.int32)
    st, logits, _ = forward_embd(session, toks, pos, None, None)
    assert st == lib.ES_OK
    assert lib.es_session_rollback(session, 0) == lib.ES_OK
    want = np.zeros_like(logits)
    assert lib.es_forward_positions(session, ffi.from_buffer("int32_t[]", toks), 3, ffi.from_buffer("int32_t[]", pos),
                                    ffi.NULL, ffi.from_buffer("float[]", want), lib.ES_LOGITS_ALL) == lib.ES_OK
    assert logits.tobytes() == want.tobytes()


def test_bad_arguments_are_refused_with_a_message(ref, image, session):
    toks, pos = image_tokens(ref)
    embd, ds = image
    n = len(toks)
    lg = np.zeros((n, 49216), np.float32)
    assert lib.es_session_rollback(session, 0) == lib.ES_OK

    def call(t, n_rows, e, d, n_ds, p=pos):
        t = np.ascontiguousarray(t, dtype=np.int32)
        return lib.es_forward_embd(session, ffi.from_buffer("int32_t[]", t), len(t), ffi.from_buffer("int32_t[]", p),
                                   ffi.from_buffer("float[]", e) if e is not None else ffi.NULL, n_rows,
                                   ffi.from_buffer("float[]", d) if d is not None else ffi.NULL, n_ds,
                                   ffi.NULL, ffi.from_buffer("float[]", lg), lib.ES_LOGITS_ALL)

    def msg():
        return ffi.string(lib.es_session_last_error(session)).decode()

    assert call(toks, 69, embd, ds, 1) == lib.ES_ERR_INVALID_ARG and "n_embd_rows" in msg()
    assert call(toks, 70, None, ds, 1) == lib.ES_ERR_INVALID_ARG and "NULL" in msg()
    assert call(toks, 70, embd, None, 1) == lib.ES_ERR_INVALID_ARG and "n_deepstack" in msg()
    assert call(toks, 70, embd, ds, 3) == lib.ES_ERR_INVALID_ARG and "n_deepstack" in msg()
    bad = toks.copy()
    bad[0] = -2
    assert call(bad, 70, embd, ds, 1) == lib.ES_ERR_INVALID_ARG and "vocabulary" in msg()
    neg = pos.copy()
    neg[5, 1] = -1
    assert call(toks, 70, embd, ds, 1, neg) == lib.ES_ERR_INVALID_ARG and "negative" in msg()
    # nothing was written: the session is still empty and a good call works
    st, _, _ = forward_embd(session, toks, pos, embd, ds)
    assert st == lib.ES_OK
