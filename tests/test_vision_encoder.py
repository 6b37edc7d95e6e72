"""The Qwen3-VL vision encoder (engine_c/src/vision.c) against transformers.

tests/data/models/qwen3vl-mmproj-F16.ref.npz holds transformers' float32 outputs of the vision tower
on the committed projector's own weights (scripts/make_fixtures.py, tests/data/models/README.md):
the merger output and the deepstack merger output for one generated 224 x 320 image, with the
processor's pixel_values. The engine gets the same pixels (un-patchified to [3][H][W]) and must
match within 1e-4 of the reference's largest magnitude (observed: about 1e-6 relative; float32
arithmetic in a different order, nothing quantized).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from echospec._engine import ffi, lib

MODELS = Path(__file__).resolve().parent / "data" / "models"
MMPROJ = MODELS / "qwen3vl-mmproj-F16.gguf"
REF = MODELS / "qwen3vl-mmproj-F16.ref.npz"
REL_BOUND = 1e-4


@pytest.fixture(scope="module")
def vision():
    out = ffi.new("es_vision **")
    err = ffi.new("char[512]")
    st = lib.es_vision_load(str(MMPROJ).encode(), out, err, 512)
    assert st == lib.ES_OK, ffi.string(err).decode()
    yield out[0]
    lib.es_vision_free(out[0])


@pytest.fixture(scope="module")
def ref():
    return np.load(REF)


def unpatchify(pixel_values: np.ndarray, grid_thw: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """The processor's patches ([bh, bw, mh, mw] x [c, t, ph, pw]) back to one frame [3][H][W]."""
    t, gh, gw = (int(x) for x in grid_thw)
    assert t == 1
    a = pixel_values.reshape(gh // merge, gw // merge, merge, merge, 3, 2, patch, patch)
    assert np.array_equal(a[:, :, :, :, :, 0], a[:, :, :, :, :, 1]), "the two temporal frames differ"
    img = a[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * patch, gw * patch)
    return np.ascontiguousarray(img, dtype=np.float32)


def info_of(vision):
    info = ffi.new("es_vision_info *")
    assert lib.es_vision_get_info(vision, info) == lib.ES_OK
    return info


def encode(vision, img: np.ndarray, n_threads: int = 2, deepstack: bool = True):
    info = info_of(vision)
    _, h, w = img.shape
    step = info.patch_size * info.merge_size
    n = (h // step) * (w // step)
    embd = np.zeros((n, info.n_embd), np.float32)
    ds = np.zeros((info.n_deepstack, n, info.n_embd), np.float32)
    st = lib.es_vision_encode(vision, ffi.from_buffer("float[]", img), h, w, n_threads,
                              ffi.from_buffer("float[]", embd),
                              ffi.from_buffer("float[]", ds) if deepstack else ffi.NULL)
    assert st == lib.ES_OK, ffi.string(lib.es_vision_last_error(vision)).decode()
    return embd, ds


def test_info_matches_the_reference(vision, ref):
    info = info_of(vision)
    assert (info.patch_size, info.merge_size, info.n_embd, info.n_deepstack) == (16, 2, 64, 1)
    assert list(info.image_mean) == [0.5, 0.5, 0.5] and list(info.image_std) == [0.5, 0.5, 0.5]
    assert [lib.es_vision_deepstack_layer(vision, k) for k in range(info.n_deepstack)] == \
        ref["deepstack_layers"].tolist()


def test_pixels_are_the_normalised_image(vision, ref):
    """The processor's pixel_values are the stored uint8 image normalised with the file's mean/std."""
    info = info_of(vision)
    img = unpatchify(ref["pixel_values"], ref["image_grid_thw"][0], info.patch_size, info.merge_size)
    mean = np.array(list(info.image_mean), np.float32)[:, None, None]
    std = np.array(list(info.image_std), np.float32)[:, None, None]
    mine = (ref["image"].transpose(2, 0, 1).astype(np.float32) / 255.0 - mean) / std
    assert np.abs(mine - img).max() < 1e-6


def test_embeddings_and_deepstack_match_transformers(vision, ref):
    info = info_of(vision)
    img = unpatchify(ref["pixel_values"], ref["image_grid_thw"][0], info.patch_size, info.merge_size)
    embd, ds = encode(vision, img)
    want_e, want_d = ref["embeddings"], ref["deepstack"]
    assert embd.shape == want_e.shape and ds.shape == want_d.shape
    scale_e, scale_d = np.abs(want_e).max(), np.abs(want_d).max()
    assert scale_e > 1 and scale_d > 1          # random weights, but not vanishing outputs
    assert np.abs(embd - want_e).max() < REL_BOUND * scale_e
    assert np.abs(ds - want_d).max() < REL_BOUND * scale_d
    # per token: the same direction (the bound the mtmd comparison uses, here far exceeded)
    cos = (embd * want_e).sum(1) / np.linalg.norm(embd, axis=1) / np.linalg.norm(want_e, axis=1)
    assert cos.min() > 0.99999


def test_thread_counts_give_identical_bits(vision, ref):
    info = info_of(vision)
    img = unpatchify(ref["pixel_values"], ref["image_grid_thw"][0], info.patch_size, info.merge_size)
    e1, d1 = encode(vision, img, n_threads=1)
    e3, d3 = encode(vision, img, n_threads=3)
    e2, _ = encode(vision, img, n_threads=2, deepstack=False)
    assert e1.tobytes() == e3.tobytes() == e2.tobytes() and d1.tobytes() == d3.tobytes()


def test_bad_size_is_refused_with_a_message(vision):
    img = np.zeros((3, 48, 64), np.float32)
    out = np.zeros((16, 64), np.float32)
    st = lib.es_vision_encode(vision, ffi.from_buffer("float[]", img), 48, 64, 1,
                              ffi.from_buffer("float[]", out), ffi.NULL)
    assert st == lib.ES_ERR_INVALID_ARG
    assert "multiples of 32" in ffi.string(lib.es_vision_last_error(vision)).decode()


def test_text_model_is_not_a_projector():
    out = ffi.new("es_vision **")
    err = ffi.new("char[512]")
    st = lib.es_vision_load(str(MODELS / "qwen3vl-Q8_0.gguf").encode(), out, err, 512)
    assert st == lib.ES_ERR_UNSUPPORTED and out[0] == ffi.NULL
    assert "clip" in ffi.string(err).decode()


# ---- against llama.cpp's multimodal library (mtmd), where llama-cpp-python has it ----------

def _mtmd():
    try:
        import llama_cpp
        from llama_cpp import mtmd_cpp
    except ImportError as e:        # llama-cpp-python is an optional peer, not a dependency
        pytest.skip(f"llama-cpp-python with mtmd is not installed ({e})")
    return llama_cpp, mtmd_cpp


def mtmd_embeddings(image: np.ndarray) -> np.ndarray:
    """llama.cpp's image embeddings for `image` [H, W, 3] uint8: [n_tokens, n_embd * (1 + n_deepstack)]
    (mtmd appends the deepstack outputs to each token's embedding)."""
    import ctypes
    llama_cpp, M = _mtmd()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(MODELS / "qwen3vl-Q8_0.gguf").encode(),
                                                 llama_cpp.llama_model_default_params())
    assert model, "llama.cpp could not load the text model"
    cp = M.mtmd_context_params_default()
    cp.use_gpu, cp.n_threads, cp.print_timings, cp.warmup = False, 2, False, False
    ctx = M.mtmd_init_from_file(str(MMPROJ).encode(), model, cp)
    assert ctx, "mtmd could not load the projector"
    img = np.ascontiguousarray(image)
    h, w, _ = img.shape
    bm = M.mtmd_bitmap_init(w, h, img.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    chunks = M.mtmd_input_chunks_init()
    try:
        text = b"a " + M.mtmd_default_marker() + b" b"
        inp = M.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), False, True
        assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (M.mtmd_bitmap_p_ctypes * 1)(bm), 1) == 0
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(ch) != M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue
            n = M.mtmd_input_chunk_get_n_tokens(ch)
            assert M.mtmd_encode_chunk(ctx, ch) == 0
            width = llama_cpp.llama_model_n_embd_inp(model)
            p = ctypes.cast(M.mtmd_get_output_embd(ctx), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(p, shape=(n * width,)).reshape(n, width).copy()
        raise AssertionError("mtmd made no image chunk")
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bm)
        M.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def test_embeddings_match_llama_cpp_mtmd(vision, ref):
    """Same projector, same image (224 x 320: mtmd does not resize it either): cosine >= 0.999 per
    token for the embeddings and for each deepstack output (observed: 0.9999997; llama.cpp differs
    by rounding only, e.g. its F16 matrix products)."""
    info = info_of(vision)
    theirs = mtmd_embeddings(ref["image"])
    img = unpatchify(ref["pixel_values"], ref["image_grid_thw"][0], info.patch_size, info.merge_size)
    embd, ds = encode(vision, img)
    d = info.n_embd
    assert theirs.shape == (embd.shape[0], d * (1 + info.n_deepstack))
    for k, ours in enumerate([embd, *ds]):
        t = theirs[:, k * d:(k + 1) * d]
        cos = (ours * t).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(t, axis=1)
        assert cos.min() >= 0.999, (k, float(cos.min()))
