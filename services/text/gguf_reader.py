"""A GGUF v2/v3 reader for the metadata the services read (the tokenizer keys).

It applies the rules of the engine's reader (engine_c/src/gguf.c), so a file is refused by both or
by neither: every count, length and offset bounded by the file, no duplicate keys or tensor names,
tensor regions inside the file and not overlapping (a region shorter than its type and shape need
overlaps the next), zero padding before the data section and at most ``alignment - 1`` bytes after
the last tensor, and the value type of every key in `KEY_TYPES`. tests/test_gguf_malformed.py runs
one table of malformed files against both readers and checks that this table and the engine's
``k_key_types`` list the same keys and classes.

Byte layout (little-endian)::

    u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      x { string key | u32 value type | value }
    n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
    zero padding to `alignment` (general.alignment, an integer power of two, or 32); tensor data
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from dataclasses import dataclass

import gguf

# GGUF value types (the spec's numbering).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING",
                    "ARRAY", "UINT64", "INT64", "FLOAT64")
_SCALAR_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
               FLOAT32: "<f", BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_INT_TYPES = frozenset({UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64})

# Value-type classes of `KEY_TYPES` (the engine's KT_* names).
INT, NUMBER, BOOL_, STRING_, ARRAY_STRING, ARRAY_INT = (
    "INT", "NUMBER", "BOOL", "STRING", "ARRAY_STRING", "ARRAY_INT")
_CLASS_TEXT = {INT: "an integer", NUMBER: "a number", BOOL_: "a bool", STRING_: "a string",
               ARRAY_STRING: "an array of strings", ARRAY_INT: "an array of integers"}

# Every key a reader of this project reads, with its expected value-type class; "{arch}." is the
# value of general.architecture. Must equal k_key_types in engine_c/src/gguf.c (a test compares).
KEY_TYPES: dict[str, str] = {
    "general.alignment": INT,
    "general.architecture": STRING_,
    "tokenizer.ggml.model": STRING_,
    "tokenizer.ggml.pre": STRING_,
    "tokenizer.ggml.tokens": ARRAY_STRING,
    "tokenizer.ggml.token_type": ARRAY_INT,
    "tokenizer.ggml.merges": ARRAY_STRING,
    "tokenizer.ggml.bos_token_id": INT,
    "tokenizer.ggml.eos_token_id": INT,
    "tokenizer.ggml.eot_token_id": INT,
    "tokenizer.ggml.eom_token_id": INT,
    "tokenizer.ggml.unknown_token_id": INT,
    "tokenizer.ggml.padding_token_id": INT,
    "tokenizer.ggml.add_bos_token": BOOL_,
    "tokenizer.chat_template": STRING_,
    "{arch}.block_count": INT,
    "{arch}.context_length": INT,
    "{arch}.embedding_length": INT,
    "{arch}.feed_forward_length": INT,
    "{arch}.attention.head_count": INT,
    "{arch}.attention.head_count_kv": INT,
    "{arch}.attention.key_length": INT,
    "{arch}.attention.value_length": INT,
    "{arch}.rope.dimension_count": INT,
    "{arch}.rope.freq_base": NUMBER,
    "{arch}.attention.layer_norm_rms_epsilon": NUMBER,
}

DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file; the message names the field, key or tensors."""


@dataclass(frozen=True)
class Field:
    """One metadata value.

    Attributes:
        type: the GGUF value type (``STRING``, ``ARRAY``, ``UINT32``, ...).
        value: int, float or bool for scalars; bytes for a string; a list for an array.
        array_type: the element type of an array, else ``None``.
    """

    type: int
    value: object
    array_type: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # ne[0] (innermost) first, as the file stores it
    type: int                # ggml type id
    offset: int              # from the start of the data section
    nbytes: int              # what the type and shape need


@dataclass(frozen=True)
class GGUFFile:
    version: int
    alignment: int
    data_start: int
    fields: dict[str, Field]
    tensors: list[TensorInfo]


def _type_matches(f: Field, want: str) -> bool:
    if want == INT:
        return f.type in _INT_TYPES
    if want == NUMBER:
        return f.type in _INT_TYPES or f.type in (FLOAT32, FLOAT64)
    if want == BOOL_:
        return f.type == BOOL
    if want == STRING_:
        return f.type == STRING
    if want == ARRAY_STRING:
        return f.type == ARRAY and f.array_type == STRING
    return f.type == ARRAY and f.array_type in _INT_TYPES


def _vt_name(t: int | None) -> str:
    return VALUE_TYPE_NAMES[t] if t is not None and 0 <= t < len(VALUE_TYPE_NAMES) else "unknown"


def check_key_types(fields: dict[str, Field]) -> None:
    """Raise GGUFFormatError when a key of `KEY_TYPES` is present with another value type."""
    arch_f = fields.get("general.architecture")
    arch = arch_f.value.decode("utf-8", "replace") if arch_f and arch_f.type == STRING else None
    for key, f in fields.items():
        want = KEY_TYPES.get(key)
        if want is None and arch is not None and key.startswith(arch + "."):
            want = KEY_TYPES.get("{arch}." + key[len(arch) + 1:])
        if want is None or _type_matches(f, want):
            continue
        if f.type == ARRAY:
            raise GGUFFormatError(f"gguf: key '{key}' is an array of {_vt_name(f.array_type)}, "
                                  f"expected {_CLASS_TEXT[want]}")
        raise GGUFFormatError(f"gguf: key '{key}' has value type {_vt_name(f.type)} ({f.type}), "
                              f"expected {_CLASS_TEXT[want]}")


class _Cursor:
    def __init__(self, buf: memoryview | bytes) -> None:
        self.b = buf
        self.size = len(buf)
        self.off = 0
        self.where = "header"

    def take(self, n: int, field: str) -> memoryview | bytes:
        if n > self.size - self.off:
            raise GGUFFormatError(f"gguf: truncated while reading {self.where} ({field}) at byte "
                                  f"{self.off} of {self.size}")
        v = self.b[self.off:self.off + n]
        self.off += n
        return v

    def unpack(self, fmt: str, field: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def string(self, field: str) -> bytes:
        n = self.unpack("<Q", f"{field} length")
        if n > self.size - self.off:
            raise GGUFFormatError(f"gguf: truncated while reading {self.where} ({field}): length {n} "
                                  f"exceeds the {self.size - self.off} bytes left")
        return bytes(self.take(n, field))

    def name(self, field: str) -> str:
        s = self.string(field)
        if not s:
            raise GGUFFormatError(f"gguf: {self.where}: empty {field}")
        if b"\0" in s:
            raise GGUFFormatError(f"gguf: {self.where}: {field} contains a NUL byte")
        return s.decode("utf-8", "replace")


def _read_value(c: _Cursor, t: int) -> Field:
    if t == STRING:
        return Field(STRING, c.string("string"))
    if t == ARRAY:
        et = c.unpack("<I", "array element type")
        if et > FLOAT64:
            raise GGUFFormatError(f"gguf: {c.where}: unknown array element type {et}")
        if et == ARRAY:
            raise GGUFFormatError(f"gguf: {c.where}: nested arrays are not supported")
        n = c.unpack("<Q", "array length")
        esz = 8 if et == STRING else struct.calcsize(_SCALAR_FMT[et])
        left = c.size - c.off
        if n * esz > left:
            raise GGUFFormatError(f"gguf: truncated while reading {c.where} (array length): {n} "
                                  f"elements of {esz} bytes exceed the {left} bytes left")
        if et == STRING:
            return Field(ARRAY, [c.string(f"array element {i} string") for i in range(n)], et)
        raw = c.take(n * esz, "array")
        fmt = _SCALAR_FMT[et]
        return Field(ARRAY, [v[0] for v in struct.iter_unpack(fmt, raw)], et)
    fmt = _SCALAR_FMT.get(t)
    if fmt is None:
        raise GGUFFormatError(f"gguf: {c.where}: unknown value type {t}")
    v = c.unpack(fmt, "value")
    return Field(t, bool(v) if t == BOOL else v)


def _alignment(fields: dict[str, Field]) -> int:
    f = fields.get("general.alignment")
    if f is None:
        return DEFAULT_ALIGNMENT
    a = max(int(f.value), 0)   # the type was checked by check_key_types
    if a == 0 or a & (a - 1):
        raise GGUFFormatError(f"gguf: general.alignment = {a} is not a nonzero power of two")
    return a


def _tensor_info(c: _Cursor, i: int, align: int) -> TensorInfo:
    c.where = f"tensor info {i}"
    name = c.name("name")
    c.where = f"tensor info {i} '{name}'"
    n_dims = c.unpack("<I", "n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"gguf: {c.where}: n_dims = {n_dims} not in 1..{MAX_DIMS}")
    shape = []
    for d in range(n_dims):
        ne = c.unpack("<Q", f"ne[{d}]")
        if not 1 <= ne < 2**63:
            raise GGUFFormatError(f"gguf: {c.where}: ne[{d}] = {ne} out of range 1..2^63-1")
        shape.append(ne)
    t = c.unpack("<I", "type")
    offset = c.unpack("<Q", "offset")
    sizes = gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType(t)) if t in _GGML_TYPES else None
    if sizes is None:
        raise GGUFFormatError(f"gguf: tensor '{name}' has unknown type id {t}")
    block_elems, block_bytes = sizes
    if shape[0] % block_elems:
        raise GGUFFormatError(f"gguf: tensor '{name}': ne[0] = {shape[0]} is not a multiple of the "
                              f"{gguf.GGMLQuantizationType(t).name} block size {block_elems}")
    n = 1
    for ne in shape:
        n *= ne
    nbytes = n // block_elems * block_bytes
    if n >= 2**63 or nbytes >= 2**64:
        raise GGUFFormatError(f"gguf: tensor '{name}': element count (ne) overflows")
    if offset % align:
        raise GGUFFormatError(f"gguf: tensor '{name}': data offset {offset} is not a multiple of the "
                              f"alignment {align}")
    return TensorInfo(name, tuple(shape), t, offset, nbytes)


_GGML_TYPES = frozenset(int(t) for t in gguf.GGMLQuantizationType)


def _type_name(t: int) -> str:
    return gguf.GGMLQuantizationType(t).name


def _check_regions(c: _Cursor, tensors: list[TensorInfo], align: int) -> int:
    """Place the tensors (the engine's place_data): returns the data section's start."""
    data_start = (c.off + align - 1) // align * align
    if tensors and data_start > c.size:
        raise GGUFFormatError(f"gguf: truncated before the tensor data: the data section starts at "
                              f"byte {data_start} of {c.size} (alignment {align})")
    for t in tensors:
        if data_start + t.offset + t.nbytes > c.size:
            raise GGUFFormatError(f"gguf: tensor '{t.name}': data offset {t.offset} + {t.nbytes} bytes "
                                  f"runs past the end of the file (data section at byte {data_start} "
                                  f"of {c.size})")
    if not tensors:
        return data_start
    regions = sorted(tensors, key=lambda t: (t.offset, t.name.encode()))
    for a, b in zip(regions, regions[1:]):
        if b.offset - a.offset < a.nbytes:
            dims = ", ".join(str(d) for d in (list(a.shape) + [1] * MAX_DIMS)[:MAX_DIMS])
            raise GGUFFormatError(f"gguf: tensors '{a.name}' and '{b.name}' overlap: '{a.name}' "
                                  f"({_type_name(a.type)} [{dims}]) needs {a.nbytes} bytes from data "
                                  f"offset {a.offset}, '{b.name}' starts at data offset {b.offset}")
    for p in range(c.off, data_start):
        if c.b[p] != 0:
            raise GGUFFormatError(f"gguf: the data section does not start at the aligned offset "
                                  f"{data_start}: padding byte {p} after the tensor infos (which end at "
                                  f"byte {c.off}, alignment {align}) is 0x{c.b[p]:02x}, not zero")
    last = regions[-1]
    data_end = data_start + last.offset + last.nbytes
    if c.size - data_end >= align:
        raise GGUFFormatError(f"gguf: {c.size - data_end} bytes follow the last tensor '{last.name}' "
                              f"(its data ends at byte {data_end} of {c.size}, alignment {align}): the "
                              f"data section does not start at the aligned offset {data_start}, or "
                              f"the file has trailing bytes")
    return data_start


def parse(buf: memoryview | bytes) -> GGUFFile:
    """Parse and validate a whole GGUF file held in `buf` (tensor data is not copied).

    Raises:
        GGUFFormatError: the first rule the file breaks, naming the section, key or tensors.
    """
    c = _Cursor(buf)
    magic = bytes(c.take(4, "magic"))
    if magic != b"GGUF":
        raise GGUFFormatError("gguf: bad magic " + " ".join(f"{x:02x}" for x in magic)
                              + ' (expected "GGUF")')
    version = c.unpack("<I", "version")
    if version not in (2, 3):
        raise GGUFFormatError(f"gguf: unsupported version {version} (this reader takes 2 and 3)")
    n_tensors = c.unpack("<Q", "tensor count")
    n_kv = c.unpack("<Q", "kv count")
    if n_kv > c.size // 14:
        raise GGUFFormatError(f"gguf: truncated or corrupt header: kv count {n_kv} cannot fit in the "
                              f"{c.size} bytes of the file")
    if n_tensors > c.size // 33:
        raise GGUFFormatError(f"gguf: truncated or corrupt header: tensor count {n_tensors} cannot fit "
                              f"in the {c.size} bytes of the file")
    fields: dict[str, Field] = {}
    for i in range(n_kv):
        c.where = f"kv {i}"
        key = c.name("key")
        c.where = f"kv {i} '{key}'"
        t = c.unpack("<I", "value type")
        f = _read_value(c, t)
        if key in fields:
            raise GGUFFormatError(f"gguf: duplicate key '{key}'")
        fields[key] = f
    check_key_types(fields)
    align = _alignment(fields)
    tensors = [_tensor_info(c, i, align) for i in range(n_tensors)]
    names = set()
    for t in tensors:
        if t.name in names:
            raise GGUFFormatError(f"gguf: duplicate tensor name '{t.name}'")
        names.add(t.name)
    data_start = _check_regions(c, tensors, align)
    return GGUFFile(version, align, data_start, fields, tensors)


def read(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate the GGUF file at `path` (memory-mapped, never written).

    Raises:
        OSError: the file cannot be opened or mapped.
        GGUFFormatError: see `parse`.
    """
    # O_NONBLOCK: a FIFO opened for reading would otherwise wait for a writer (the file is only mapped)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fsdecode(path))
    with open(fd, "rb") as fh:
        size = st.st_size
        if size == 0:
            return parse(b"")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            message = None
            try:
                result = parse(view)
            except GGUFFormatError as e:
                message = str(e)   # not kept: its traceback holds views of the map
            view.release()
    if message is not None:
        raise GGUFFormatError(message)
    return result
