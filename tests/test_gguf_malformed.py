"""Model loading through the Python binding: valid files written by the `gguf` package load
with the right hyperparameters; malformed ones raise EngineError with the right status and a
message naming the field, and never crash the process. Every malformed file is also given to
the services' own GGUF reader (services/text/gguf_reader.py), which must refuse it with the
same words: the two readers apply one set of rules. A path that is not a regular file (a
named pipe) is refused by both, not waited on.

The section boundaries and field offsets of a file are found by ``walk``, a small GGUF
walker written here from the spec (independent of the C reader under test).
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from echospec.services.text import gguf_reader
from echospec.services.verifier.engine import (
    ES_ERR_FORMAT,
    ES_ERR_MISSING_TENSOR,
    ES_ERR_UNSUPPORTED,
    EngineError,
    Model,
)

ROOT = Path(__file__).resolve().parent.parent
E, F, H, KV, V, NL = 64, 128, 4, 2, 96, 2   # tiny shapes: n_embd, n_ff, heads, kv heads, vocab, layers


def write_model(path: Path, arch: str = "llama", mtype: QT = QT.Q8_0, head_dim: int | None = None,
                skip: tuple[str, ...] = (), extra_kv: tuple[tuple, ...] = ()) -> None:
    """Write a tiny random-weight model with the gguf package.

    Matrices are `mtype` (quantized with gguf.quants), norms and biases F32. qwen2 gets q/k/v
    biases and an untied output.weight; qwen3 gets q/k norms. Tensors named in `skip` are left out.
    `extra_kv` holds (key, value, GGUFValueType[, sub_type]) written with add_key_value.
    """
    hd = head_dim or E // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(NL)
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(20000.0)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_token_list([f"t{i}" for i in range(V)])
    for kv in extra_kv:
        w.add_key_value(*kv)
    rng = np.random.default_rng(0)

    def add(name: str, x: np.ndarray, t: QT) -> None:
        if name in skip:
            return
        if t == QT.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif t == QT.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    def mat(name: str, rows: int, cols: int) -> None:
        add(name, rng.standard_normal((rows, cols)).astype(np.float32), mtype)

    def vec(name: str, n: int) -> None:
        add(name, np.full(n, 0.5, np.float32), QT.F32)

    mat("token_embd.weight", V, E)
    vec("output_norm.weight", E)
    if arch == "qwen2":
        mat("output.weight", V, E)
    for il in range(NL):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", H * hd, E)
        mat(p + "attn_k.weight", KV * hd, E)
        mat(p + "attn_v.weight", KV * hd, E)
        mat(p + "attn_output.weight", E, H * hd)
        vec(p + "ffn_norm.weight", E)
        mat(p + "ffn_gate.weight", F, E)
        mat(p + "ffn_up.weight", F, E)
        mat(p + "ffn_down.weight", E, F)
        if arch == "qwen2":
            vec(p + "attn_q.bias", H * hd)
            vec(p + "attn_k.bias", KV * hd)
            vec(p + "attn_v.bias", KV * hd)
        if arch == "qwen3":
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class Layout:
    """Byte offsets of a GGUF file's fields (from the spec, not from the engine)."""

    boundaries: list[tuple[int, str]] = field(default_factory=list)  # (offset, section ended)
    kv_value: dict[str, int] = field(default_factory=dict)           # key -> offset of its value
    tensor_type: dict[str, int] = field(default_factory=dict)        # name -> offset of u32 type
    tensor_offset: dict[str, int] = field(default_factory=dict)      # name -> offset of u64 offset
    data_start: int = 0


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def walk(b: bytes) -> Layout:
    """Walk header, KVs and tensor infos; record where each field and section lies."""
    lay = Layout()
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
    lay.boundaries += [(4, "magic"), (8, "version"), (16, "tensor count"), (24, "kv count")]

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", b, p)
        return b[p + 8:p + 8 + n].decode(), p + 8 + n

    def value(t: int, p: int) -> int:
        if t == 8:
            return string(p)[1]
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, p)
            p += 12
            for _ in range(n):
                p = value(et, p)
            return p
        return p + _SCALAR[t]

    alignment = 32
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", b, pos)
        lay.kv_value[key] = pos + 4
        pos = value(t, pos + 4)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", b, lay.kv_value[key])[0]
        lay.boundaries.append((pos, f"kv {key}"))
    for _ in range(n_tensors):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", b, pos)
        pos += 4 + 8 * nd
        lay.tensor_type[name] = pos
        lay.tensor_offset[name] = pos + 4
        pos += 12
        lay.boundaries.append((pos, f"tensor info {name}"))
    lay.data_start = (pos + alignment - 1) // alignment * alignment
    return lay


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[bytes, Layout]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_model(path)
    data = path.read_bytes()
    return data, walk(data)


def load_bytes(tmp_path: Path, data: bytes) -> Model:
    p = tmp_path / "m.gguf"
    p.write_bytes(data)
    return Model(str(p))


def expect_error(tmp_path: Path, data: bytes, status: int, *needles: str, python: bool = True) -> str:
    """The engine refuses `data` with `status` and every needle in the message; so does the
    services' GGUF reader (with the same needles) unless `python` is False (model-level checks)."""
    with pytest.raises(EngineError) as ei:
        load_bytes(tmp_path, data)
    assert ei.value.status == status, ei.value
    for n in needles:
        assert n in ei.value.message, ei.value.message
    if python:
        with pytest.raises(gguf_reader.GGUFFormatError) as pi:
            gguf_reader.parse(data)
        for n in needles:
            assert n in str(pi.value), str(pi.value)
    return ei.value.message


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


# ---- valid files ---------------------------------------------------------------------------

@pytest.mark.parametrize("mtype", [QT.F32, QT.F16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_load_with_their_hyperparameters(tmp_path, arch, mtype):
    head_dim = 32 if arch == "qwen3" else None   # qwen3: head_dim != n_embd / n_head
    write_model(tmp_path / "m.gguf", arch, mtype, head_dim)
    with Model(str(tmp_path / "m.gguf")) as m:
        i = m.info
        assert (i.arch, i.n_vocab, i.n_embd, i.n_layer, i.n_ff) == (arch, V, E, NL, F)
        assert (i.n_head, i.n_head_kv, i.head_dim) == (H, KV, head_dim or E // H)
        assert i.rope_dim == i.head_dim and i.rope_freq_base == 20000.0
        assert i.rope_neox == (arch != "llama")
        assert i.norm_eps == pytest.approx(1e-5 if arch == "llama" else 1e-6)
        assert i.tied_output == (arch != "qwen2")
        assert i.n_ctx_train == 128 and i.weight_bytes > 0


# ---- truncation ----------------------------------------------------------------------------

def test_cut_at_every_section_boundary(tmp_path, tiny):
    data, lay = tiny
    cuts = sorted({c for off, _ in lay.boundaries for c in (off - 1, off, off + 1)} |
                  {0, lay.data_start, lay.data_start + 1, len(data) - 1})
    assert len(cuts) > 3 * NL * 12
    for cut in cuts:
        if cut >= len(data):
            continue
        msg = expect_error(tmp_path, data[:cut], ES_ERR_FORMAT)
        assert "truncated" in msg or "past the end" in msg, (cut, msg)
        with pytest.raises(gguf_reader.GGUFFormatError, match="truncated|past the end"):
            gguf_reader.parse(data[:cut])


def test_truncation_names_the_section(tmp_path, tiny):
    data, lay = tiny
    info_end = [off for off, what in lay.boundaries if what.startswith("tensor info")]
    expect_error(tmp_path, data[:info_end[2] + 3], ES_ERR_FORMAT, "tensor info 3", "(name length)")
    expect_error(tmp_path, data[:2], ES_ERR_FORMAT, "header (magic)")


# ---- absurd counts, lengths, offsets and types ---------------------------------------------

@pytest.mark.parametrize("offset,value,needle", [
    (8, 2**64 - 1, "tensor count"),
    (8, 2**63, "tensor count"),
    (16, 2**64 - 1, "kv count"),
    (16, 2**64 - 2, "kv count"),
])
def test_header_counts_near_2_pow_64(tmp_path, tiny, offset, value, needle):
    data, _ = tiny
    expect_error(tmp_path, patched(data, offset, "<Q", value), ES_ERR_FORMAT, needle)


def test_string_length_past_the_end(tmp_path, tiny):
    data, lay = tiny
    at = lay.kv_value["general.architecture"]
    for v in (2**64 - 1, len(data)):
        expect_error(tmp_path, patched(data, at, "<Q", v), ES_ERR_FORMAT,
                     "'general.architecture' (string)")


def test_array_length_near_2_pow_64(tmp_path, tiny):
    data, lay = tiny
    at = lay.kv_value["tokenizer.ggml.tokens"] + 4
    for v in (2**64 - 1, 2**61 + 1, 2**40):
        expect_error(tmp_path, patched(data, at, "<Q", v), ES_ERR_FORMAT, "array length")


def test_unknown_tensor_type(tmp_path, tiny):
    data, lay = tiny
    bad = patched(data, lay.tensor_type["blk.1.ffn_up.weight"], "<I", 99)
    expect_error(tmp_path, bad, ES_ERR_UNSUPPORTED, "'blk.1.ffn_up.weight'", "type id 99")


def test_offsets_past_the_end_and_misaligned(tmp_path, tiny):
    data, lay = tiny
    at = lay.tensor_offset["blk.0.ffn_down.weight"]
    expect_error(tmp_path, patched(data, at, "<Q", 2**40), ES_ERR_FORMAT, "blk.0.ffn_down.weight",
                 "past the end")
    expect_error(tmp_path, patched(data, at, "<Q", 2**64 - 32), ES_ERR_FORMAT, "past the end")
    expect_error(tmp_path, patched(data, at, "<Q", 8), ES_ERR_FORMAT, "alignment")


def test_bad_magic_and_versions(tmp_path, tiny):
    data, _ = tiny
    expect_error(tmp_path, b"GGML" + data[4:], ES_ERR_FORMAT, "magic")
    expect_error(tmp_path, patched(data, 4, "<I", 1), ES_ERR_UNSUPPORTED, "version 1")


# ---- tensor regions, the data section and key value types: one table, both readers ---------

def _region(lay: Layout, data: bytes, name: str) -> int:
    return struct.unpack_from("<Q", data, lay.tensor_offset[name])[0]


def _same_offset(data: bytes, lay: Layout) -> bytes:
    return patched(data, lay.tensor_offset["blk.0.attn_v.weight"], "<Q",
                   _region(lay, data, "blk.0.attn_k.weight"))


def _inside(data: bytes, lay: Layout) -> bytes:
    # output_norm (256 bytes) inside token_embd (Q8_0 [64, 96]: 6528 bytes at offset 0)
    return patched(data, lay.tensor_offset["output_norm.weight"], "<Q", 1024)


def _longer_shape(data: bytes, lay: Layout) -> bytes:
    # blk.0.attn_q.weight Q8_0 [64, 64] declared [64, 128]: needs 8704 bytes, has 4352
    return patched(data, lay.tensor_type["blk.0.attn_q.weight"] - 8, "<Q", 128)


def _bigger_type(data: bytes, lay: Layout) -> bytes:
    # blk.0.attn_q.weight Q8_0 [64, 64] declared F32: needs 16384 bytes
    return patched(data, lay.tensor_type["blk.0.attn_q.weight"], "<I", int(QT.F32))


def _info_end(data: bytes, lay: Layout) -> int:
    return max(off for off, what in lay.boundaries if what.startswith("tensor info"))


def _unpadded(data: bytes, lay: Layout) -> bytes:
    # the data written right after the tensor infos, the file filled up to its old size
    end = _info_end(data, lay)
    assert lay.data_start > end and data[lay.data_start + 1] != 0
    pad = lay.data_start - end
    return data[:end] + data[lay.data_start:] + b"\xee" * pad


def _nonzero_padding(data: bytes, lay: Layout) -> bytes:
    assert lay.data_start > _info_end(data, lay)
    return data[:lay.data_start - 1] + b"\x01" + data[lay.data_start:]


def _trailing(data: bytes, lay: Layout) -> bytes:
    return data + b"\x55" * 64


REGION_CASES = {
    "two tensors at one offset": (_same_offset, "'blk.0.attn_k.weight' and 'blk.0.attn_v.weight' overlap"),
    "one tensor inside another": (_inside, "'token_embd.weight' and 'output_norm.weight' overlap",
                                  "needs 6528 bytes"),
    "region shorter than the shape needs": (_longer_shape, "'blk.0.attn_q.weight' and", "overlap",
                                            "Q8_0 [64, 128, 1, 1]) needs 8704 bytes"),
    "region shorter than the type needs": (_bigger_type, "'blk.0.attn_q.weight' and", "overlap",
                                           "F32 [64, 64, 1, 1]) needs 16384 bytes"),
    "unpadded data section, trailing bytes": (_unpadded, "does not start at the aligned offset"),
    "nonzero padding before the data": (_nonzero_padding, "does not start at the aligned offset",
                                        "is 0x01"),
    "bytes after the last tensor": (_trailing, "64 bytes follow the last tensor"),
}


@pytest.mark.parametrize("case", list(REGION_CASES))
def test_regions_and_data_section_both_readers(tmp_path, tiny, case):
    data, lay = tiny
    edit, *needles = REGION_CASES[case]
    expect_error(tmp_path, edit(data, lay), ES_ERR_FORMAT, *needles)


VT = gguf.GGUFValueType
KEY_TYPE_CASES = {
    "alignment float32": (("general.alignment", 32.0, VT.FLOAT32),
                          "key 'general.alignment' has value type FLOAT32 (6), expected an integer"),
    "token types float32": (("tokenizer.ggml.token_type", [1.0] * V, VT.ARRAY, VT.FLOAT32),
                            "key 'tokenizer.ggml.token_type' is an array of FLOAT32, expected an "
                            "array of integers"),
    "merges not an array": (("tokenizer.ggml.merges", 3, VT.UINT32),
                            "'tokenizer.ggml.merges' has value type UINT32 (4), expected an array of "
                            "strings"),
    "eos id string": (("tokenizer.ggml.eos_token_id", "2", VT.STRING),
                      "'tokenizer.ggml.eos_token_id' has value type STRING (8), expected an integer"),
    "add_bos uint8": (("tokenizer.ggml.add_bos_token", 1, VT.UINT8),
                      "'tokenizer.ggml.add_bos_token' has value type UINT8 (0), expected a bool"),
    "chat template int": (("tokenizer.chat_template", 1, VT.INT32),
                          "'tokenizer.chat_template' has value type INT32 (5), expected a string"),
    "freq_base string": (("llama.rope.freq_base", "1e4", VT.STRING),
                         "'llama.rope.freq_base' has value type STRING (8), expected a number"),
    "head count float": (("llama.attention.key_length", 16.0, VT.FLOAT64),
                         "'llama.attention.key_length' has value type FLOAT64 (12), expected an "
                         "integer"),
}


@pytest.mark.parametrize("case", list(KEY_TYPE_CASES))
def test_key_of_the_wrong_value_type_both_readers(tmp_path, case):
    kv, needle = KEY_TYPE_CASES[case]
    write_model(tmp_path / "src.gguf", extra_kv=(kv,))
    expect_error(tmp_path, (tmp_path / "src.gguf").read_bytes(), ES_ERR_FORMAT, needle)


@pytest.mark.parametrize("kv", [
    ("general.alignment", 32, VT.INT32),           # any integer type, in both readers
    ("general.alignment", 32, VT.UINT64),
    ("tokenizer.ggml.token_type", [1] * V, VT.ARRAY, VT.INT32),
    ("tokenizer.ggml.eos_token_id", 2, VT.INT64),
    ("qwen2.block_count", "x", VT.STRING),         # another architecture's key is not read
], ids=["alignment int32", "alignment uint64", "token types int32", "eos id int64", "other arch"])
def test_accepted_value_types_load_in_both_readers(tmp_path, kv):
    write_model(tmp_path / "m.gguf", extra_kv=(kv,))
    Model(str(tmp_path / "m.gguf")).close()
    f = gguf_reader.read(tmp_path / "m.gguf")
    assert f.alignment == 32 and len(f.tensors) == 2 + 9 * NL


def test_tokenizer_reader_refuses_float_token_types(tmp_path):
    from echospec.services.text.tokenizer import read_tokenizer_metadata
    write_model(tmp_path / "m.gguf", extra_kv=(
        ("tokenizer.ggml.model", "gpt2", VT.STRING),
        ("tokenizer.ggml.token_type", [1.5] * V, VT.ARRAY, VT.FLOAT32)))
    with pytest.raises(ValueError, match="'tokenizer.ggml.token_type' is an array of FLOAT32"):
        read_tokenizer_metadata(tmp_path / "m.gguf")


def test_the_two_key_type_tables_are_one():
    """engine_c/src/gguf.c k_key_types and gguf_reader.KEY_TYPES list the same keys and classes."""
    import re
    src = (ROOT / "engine_c" / "src" / "gguf.c").read_text()
    body = src[src.index("k_key_types[] = {"):]
    body = body[:body.index("};")]
    c_table = dict(re.findall(r'\{\s*"([^"]+)",\s*KT_(\w+)\s*\}', body))
    assert len(c_table) == len(gguf_reader.KEY_TYPES) > 20
    assert c_table == gguf_reader.KEY_TYPES


# ---- model-level errors --------------------------------------------------------------------

def test_missing_tensor(tmp_path):
    write_model(tmp_path / "m.gguf", skip=("blk.1.attn_v.weight",))
    with pytest.raises(EngineError) as ei:
        Model(str(tmp_path / "m.gguf"))
    assert ei.value.status == ES_ERR_MISSING_TENSOR
    assert "blk.1.attn_v.weight" in ei.value.message


def test_qwen3_without_q_norm(tmp_path):
    write_model(tmp_path / "m.gguf", "qwen3", skip=("blk.0.attn_q_norm.weight",))
    with pytest.raises(EngineError) as ei:
        Model(str(tmp_path / "m.gguf"))
    assert ei.value.status == ES_ERR_MISSING_TENSOR and "attn_q_norm" in ei.value.message


def test_unsupported_architecture(tmp_path):
    write_model(tmp_path / "m.gguf", "gemma")
    with pytest.raises(EngineError) as ei:
        Model(str(tmp_path / "m.gguf"))
    assert ei.value.status == ES_ERR_UNSUPPORTED and "'gemma'" in ei.value.message


@pytest.mark.parametrize("reader", ["engine", "gguf_reader"])
def test_model_path_that_is_a_fifo_is_refused_not_waited_on(tmp_path, reader):
    # was: Model(path) and gguf_reader.read(path) blocked forever in open() on a named pipe (it
    # waits for a writer) instead of saying it is not a regular file; run in a child process so a
    # regression fails on the timeout instead of hanging the suite
    import os
    import subprocess
    import sys
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = {"engine": "from echospec.services.verifier.engine import Model as load",
            "gguf_reader": "from echospec.services.text.gguf_reader import read as load"}[reader]
    code += f"\ntry:\n    load({str(fifo)!r})\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "not a" in r.stdout and "regular file" in r.stdout and str(fifo) in r.stdout, r.stdout
    assert r.stdout.startswith("EngineError ES_ERR_IO" if reader == "engine" else "OSError"), r.stdout


# ---- the real model ------------------------------------------------------------------------

def test_smollm2_info():
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with Model(str(mod.fetch(verbose=False))) as m:
        i = m.info
        assert (i.arch, i.n_vocab, i.n_ctx_train, i.n_embd, i.n_layer) == ("llama", 49152, 8192, 576, 30)
        assert (i.n_head, i.n_head_kv, i.head_dim, i.n_ff, i.rope_dim) == (9, 3, 64, 1536, 64)
        assert i.rope_freq_base == 100000.0 and not i.rope_neox and i.tied_output
        assert i.norm_eps == pytest.approx(1e-5)
        assert 90 * 2**20 < i.weight_bytes < 94 * 2**20   # ~92 MiB of weights per decode step
