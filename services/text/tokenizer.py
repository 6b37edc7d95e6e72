"""Tokenizer built from a GGUF file's own vocabulary, plus streaming helpers.

The GGUF file carries everything a tokenizer needs:

* ``tokenizer.ggml.model``       -- the tokenizer kind: ``"gpt2"`` (byte-level BPE) or ``"llama"``
                                    (SentencePiece-style BPE with byte fallback, see below).
* ``tokenizer.ggml.pre``         -- the pre-tokenizer type (how text is split before BPE merges).
* ``tokenizer.ggml.tokens``      -- ``n_vocab`` token strings in byte-level form (``"Ġthe"`` = b" the").
* ``tokenizer.ggml.token_type``  -- ``n_vocab`` int32: 1 normal, 2 unknown, 3 control, 4 user-defined,
                                    5 unused, 6 byte.
* ``tokenizer.ggml.merges``      -- BPE merges as ``"left right"`` strings, highest priority first.
* ``tokenizer.ggml.scores``      -- ``n_vocab`` floats (``"llama"``: a merge that makes a higher
                                    scoring token goes first).
* ``tokenizer.ggml.add_space_prefix`` -- ``"llama"``: prepend a space to the text (default true).
* ``tokenizer.ggml.{bos,eos,eot,eom}_token_id`` -- special ids (each optional).
* ``tokenizer.chat_template``    -- the Jinja chat template (used by ``chat_template.py``).

`Tokenizer.from_gguf` builds a Hugging Face ``tokenizers.Tokenizer`` from these keys with the same
pre-tokenizer regexes llama.cpp uses for the given ``pre`` type. Control tokens (type 3) are added
as special tokens, so ``"<|im_start|>"`` in the input text becomes one token; user-defined tokens
(type 4) are added as plain added tokens (always matched whole, as llama.cpp does).

``"llama"`` files (Gemma, Llama 2, ...) are tokenized as llama.cpp's SPM tokenizer does: control and
user-defined tokens are split out first; in the rest every space becomes U+2581 ("▁"), a space is
prepended when ``add_space_prefix`` says so, and the text is merged from single characters, always
merging the adjacent pair that makes the highest-scoring vocabulary token (leftmost on ties); a
character no token covers becomes its UTF-8 bytes as ``<0xNN>`` byte tokens. There are no merge
lists in these files: the merges are derived from the scores (every split of a token into two
tokens, ranked by the token's score), which gives the same result with ``tokenizers``' BPE.
Decoding turns U+2581 back into spaces and byte tokens into their byte.

Streaming helpers:

* `IncrementalDecoder` turns token ids into text one id at a time and never splits a UTF-8
  character: incomplete trailing bytes are held back until the next token completes them.
* `StopMatcher` applies stop strings to a stream of text deltas, holding back any tail that could
  still become a stop string, so stop strings work across token (and delta) boundaries.

Worked example (SmolLM2-135M-Instruct)::

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.encode("<|im_start|>user\\nhi<|im_end|>")   # [1, 4093, 198, 6004, 2]
    tok.decode([1, 4093, 198, 6004, 2], skip_special=True)  # "user\\nhi"
"""

from __future__ import annotations

import codecs
import operator
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from echospec.services.text import gguf_reader

__all__ = [
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
    "GGUFTokenizerMetadata",
    "read_tokenizer_metadata",
    "pre_tokenizer_regexes",
    "Tokenizer",
    "IncrementalDecoder",
    "StopMatcher",
]

# texts from this length on are encoded with the GIL released (Tokenizer.encode)
_GIL_FREE_CHARS = 4096

# Token types as GGUF stores them in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# --- pre-tokenizer regexes, as llama.cpp (src/llama-vocab.cpp) applies them -----------------------
# Each list is applied in order: every regex splits each piece left by the previous one further;
# text a regex does not match stays a piece of its own ("isolated" splitting).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# tokenizer.ggml.pre value -> (regexes, ignore_merges). ignore_merges: a whole pre-token that is
# itself in the vocabulary is emitted as that token without running merges (llama.cpp does this for
# llama3). No Unicode normalization is applied for any type: llama.cpp applies none, and neither
# does transformers' GGUF converter (not even NFC for qwen2), so text is tokenized as given.
_PRE_TYPES: dict[str, tuple[tuple[str, ...], bool]] = {
    "smollm": ((r"\p{N}", _GPT2_REGEX), False),
    "starcoder": ((r"\p{N}", _GPT2_REGEX), False),
    "refact": ((r"\p{N}", _GPT2_REGEX), False),
    "codeshell": ((r"\p{N}", _GPT2_REGEX), False),
    "qwen2": ((_QWEN2_REGEX,), False),
    "llama-bpe": ((_LLAMA3_REGEX,), True),
    "llama3": ((_LLAMA3_REGEX,), True),
    "llama-v3": ((_LLAMA3_REGEX,), True),
    "gpt2": ((_GPT2_REGEX,), False),
    "gpt-2": ((_GPT2_REGEX,), False),
    "default": (_DEFAULT_REGEXES, False),
}

# Token texts that end a turn when they are control tokens (llama.cpp's end-of-generation list).
_EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>"}
)


def pre_tokenizer_regexes(pre: str) -> tuple[str, ...]:
    """Return the split regexes (in application order) for a ``tokenizer.ggml.pre`` value.

    Args:
        pre: the pre-tokenizer type, e.g. ``"smollm"``, ``"qwen2"``, ``"llama-bpe"``, ``"gpt2"``,
            ``"default"``.

    Returns:
        The regexes (Oniguruma / llama.cpp syntax with ``\\p{L}``, ``\\p{N}``).

    Raises:
        ValueError: the pre-tokenizer type is unknown.
    """
    try:
        return _PRE_TYPES[pre][0]
    except KeyError:
        raise ValueError(
            f"unsupported pre-tokenizer type tokenizer.ggml.pre={pre!r}; supported: "
            f"{', '.join(sorted(_PRE_TYPES))}"
        ) from None


# --- GGUF metadata --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The tokenizer keys of one GGUF file (no tensor data).

    Attributes:
        model: ``tokenizer.ggml.model`` (``"gpt2"`` for byte-level BPE, ``"llama"`` for SPM).
        pre: ``tokenizer.ggml.pre``; ``"default"`` when the key is absent (as llama.cpp does).
        tokens: ``n_vocab`` token strings (byte-level form for BPE).
        token_types: ``n_vocab`` ints (see the ``TOKEN_TYPE_*`` constants); all normal if absent.
        merges: BPE merges, ``"left right"`` strings in priority order.
        scores: ``tokenizer.ggml.scores`` (``n_vocab`` floats), ``[]`` when absent.
        add_space_prefix: ``tokenizer.ggml.add_space_prefix``, ``None`` when absent.
        bos_id, eos_id, eot_id, eom_id, unk_id, pad_id: special ids, ``None`` when absent.
        add_bos: ``tokenizer.ggml.add_bos_token`` (``False`` when absent). `Tokenizer.encode`
            never adds BOS; `Tokenizer.prompt_ids` does, as llama.cpp does for a prompt.
        chat_template: ``tokenizer.chat_template`` or ``None``.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] = field(default_factory=list, compare=False, repr=False)
    add_space_prefix: bool | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    source: str = field(default="", compare=False)


def _str(fields: dict[str, gguf_reader.Field], key: str) -> str | None:
    f = fields.get(key)   # value types were checked against gguf_reader.KEY_TYPES
    return None if f is None else f.value.decode("utf-8")


def _int(fields: dict[str, gguf_reader.Field], key: str) -> int | None:
    f = fields.get(key)
    return None if f is None else int(f.value)


def _str_array(fields: dict[str, gguf_reader.Field], key: str) -> list[str] | None:
    f = fields.get(key)
    if f is None:
        return None
    out: list[str] = []
    for n, b in enumerate(f.value):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"GGUF key {key}[{n}] is not valid UTF-8: {e}") from None
    return out


def read_tokenizer_metadata(path: str | os.PathLike[str]) -> GGUFTokenizerMetadata:
    """Read the tokenizer keys of a GGUF file with `echospec.services.text.gguf_reader`.

    The whole file is validated with the engine's rules (tensor regions, data section, the value
    type of every key in ``gguf_reader.KEY_TYPES``); tensor data is memory-mapped, never read.

    Args:
        path: the GGUF file.

    Returns:
        The tokenizer metadata.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a readable GGUF file, or a tokenizer key is missing or has the
            wrong type (the message names the key).
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"GGUF file not found: {p}")
    try:
        fields = gguf_reader.read(p).fields
    except (OSError, gguf_reader.GGUFFormatError) as e:
        raise ValueError(f"cannot read GGUF file {p}: {e}") from None
    model = _str(fields, "tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"GGUF file {p} has no tokenizer (key tokenizer.ggml.model missing)")
    tokens = _str_array(fields, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"GGUF file {p}: key tokenizer.ggml.tokens missing or empty")
    tt = fields.get("tokenizer.ggml.token_type")
    types = [int(v) for v in tt.value] if tt is not None else [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"GGUF file {p}: tokenizer.ggml.token_type has {len(types)} entries, "
            f"tokenizer.ggml.tokens has {len(tokens)}"
        )
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    # not in gguf_reader.KEY_TYPES (the engine never reads them): their types are checked here
    sc = fields.get("tokenizer.ggml.scores")
    scores: list[float] = []
    if sc is not None:
        if sc.type != gguf_reader.ARRAY or sc.array_type not in (gguf_reader.FLOAT32, gguf_reader.FLOAT64):
            raise ValueError(f"GGUF file {p}: tokenizer.ggml.scores must be an array of floats")
        scores = [float(v) for v in sc.value]
        if len(scores) != len(tokens):
            raise ValueError(f"GGUF file {p}: tokenizer.ggml.scores has {len(scores)} entries, "
                             f"tokenizer.ggml.tokens has {len(tokens)}")
    asp = fields.get("tokenizer.ggml.add_space_prefix")
    if asp is not None and asp.type != gguf_reader.BOOL:
        raise ValueError(f"GGUF file {p}: tokenizer.ggml.add_space_prefix must be a bool")
    return GGUFTokenizerMetadata(
        model=model,
        pre=_str(fields, "tokenizer.ggml.pre") or "default",
        tokens=tokens,
        token_types=types,
        merges=_str_array(fields, "tokenizer.ggml.merges") or [],
        scores=scores,
        add_space_prefix=bool(asp.value) if asp is not None else None,
        bos_id=_int(fields, "tokenizer.ggml.bos_token_id"),
        eos_id=_int(fields, "tokenizer.ggml.eos_token_id"),
        eot_id=_int(fields, "tokenizer.ggml.eot_token_id"),
        eom_id=_int(fields, "tokenizer.ggml.eom_token_id"),
        unk_id=_int(fields, "tokenizer.ggml.unknown_token_id"),
        pad_id=_int(fields, "tokenizer.ggml.padding_token_id"),
        add_bos=bool(add_bos.value) if add_bos is not None else False,
        chat_template=_str(fields, "tokenizer.chat_template"),
        source=p,
    )


# --- byte-level mapping ---------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_decode(token: str) -> bytes:
    """Bytes of a byte-level token string; raw UTF-8 if any character is outside the byte table.

    This is the rule of the ``tokenizers`` ByteLevel decoder, so added tokens such as
    ``"<|im_start|>"`` (or user-defined tokens holding plain text) come back as their own text.
    """
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


# --- SentencePiece BPE ("llama") ------------------------------------------------------------------

_SPM_SPACE = "\u2581"   # "▁": a space inside SentencePiece tokens


def _spm_token_bytes(token: str, ty: int) -> bytes:
    """The bytes a ``llama`` token stands for, as llama.cpp's token_to_piece gives them: byte
    tokens ``<0xNN>`` their byte, normal tokens their text with U+2581 as a space, every other kind
    (control, user-defined, unknown) its text as is."""
    if ty == TOKEN_TYPE_BYTE:
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        raise ValueError(f"byte token {token!r} is not of the form <0xNN>")
    if ty in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED):
        return token.replace(_SPM_SPACE, " ").encode("utf-8")
    return token.encode("utf-8")


def _spm_merges(tokens: list[str], types: list[int], scores: list[float],
                vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SPM merging.

    llama.cpp merges the adjacent pair whose concatenation is the vocabulary token with the highest
    score. So every split of a normal token into two vocabulary tokens is a merge, ranked by that
    token's score (highest first; equal scores by id), which is the order ``tokenizers``' BPE
    applies them in. Control, user-defined and unknown tokens are never the result of a merge: they
    are split out of the text before merging.
    """
    order = sorted((i for i, ty in enumerate(types) if ty in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED)
                    and len(tokens[i]) > 1), key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    add = merges.extend
    get = vocab.get
    for i in order:
        t = tokens[i]
        if get(t) != i:
            continue   # a duplicate: the first occurrence is the token
        add([(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab])
    return merges


# --- the tokenizer --------------------------------------------------------------------------------


class Tokenizer:
    """A BPE tokenizer built from a GGUF file's vocabulary (byte-level ``gpt2`` or SPM ``llama``).

    Token ids are ints in ``[0, n_vocab)``. `encode` never adds BOS or EOS; special-token text in
    the input (control tokens such as ``"<|im_start|>"``) is parsed as the special token.

    Attributes:
        n_vocab: number of tokens.
        bos_id: BOS id or ``None``.
        eos_id: EOS id or ``None``.
        eos_ids: every id that ends generation: EOS, EOT, EOM, and control tokens whose text is an
            end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, ...), as llama.cpp
            counts them.
        pre: the pre-tokenizer type (``"llama"`` files: not used).
        model: ``"gpt2"`` or ``"llama"``.
        hf: the underlying ``tokenizers.Tokenizer`` (``gpt2``: pre-tokenizer, BPE model, ByteLevel
            decoder; ``llama``: space-escaping normalizer, BPE model with byte fallback).
    """

    def __init__(self, meta: GGUFTokenizerMetadata) -> None:
        """Build the tokenizer from already-read metadata (see `read_tokenizer_metadata`).

        Raises:
            ValueError: unsupported tokenizer model (anything but ``"gpt2"`` and ``"llama"``),
                unknown pre-tokenizer type (``gpt2``), a merge naming a token not in the
                vocabulary, missing scores (``llama``), or a special id outside the vocabulary.
        """
        if meta.model not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported tokenizer model tokenizer.ggml.model={meta.model!r}: only 'gpt2' "
                f"(byte-level BPE) and 'llama' (SentencePiece BPE) are supported"
            )
        if meta.model == "gpt2" and meta.pre not in _PRE_TYPES:
            pre_tokenizer_regexes(meta.pre)  # raises the ValueError naming the supported types
        self.model: str = meta.model
        self.pre: str = meta.pre
        self.n_vocab: int = len(meta.tokens)
        self._tokens: list[str] = list(meta.tokens)
        self._types: list[int] = list(meta.token_types)
        for name in ("bos_id", "eos_id", "eot_id", "eom_id", "unk_id", "pad_id"):
            v = getattr(meta, name)
            if v is not None and not 0 <= v < self.n_vocab:
                raise ValueError(f"tokenizer {name}={v} is outside the vocabulary [0, {self.n_vocab})")
        self.bos_id: int | None = meta.bos_id
        self.add_bos: bool = bool(meta.add_bos) and meta.bos_id is not None
        self.eos_id: int | None = meta.eos_id
        eos: set[int] = {i for i in (meta.eos_id, meta.eot_id, meta.eom_id) if i is not None}
        for i, (t, ty) in enumerate(zip(self._tokens, self._types)):
            if ty == TOKEN_TYPE_CONTROL and t in _EOG_TEXTS:
                eos.add(i)
        self.eos_ids: frozenset[int] = frozenset(eos)

        vocab: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            vocab.setdefault(t, i)  # first occurrence wins on duplicates, as llama.cpp does
        if meta.model == "llama":
            self.hf: tokenizers.Tokenizer = self._build_spm(meta, vocab)
            self._bytes: list[bytes] = [_spm_token_bytes(t, ty) for t, ty in zip(self._tokens, self._types)]
            return
        regexes, ignore_merges = _PRE_TYPES[meta.pre]
        pairs: list[tuple[str, str]] = []
        for n, m in enumerate(meta.merges):
            parts = m.split(" ", 1)
            if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
                raise ValueError(f"tokenizer.ggml.merges[{n}]={m!r} does not name two vocabulary tokens")
            if parts[0] + parts[1] not in vocab:
                raise ValueError(f"tokenizer.ggml.merges[{n}]={m!r}: merged token not in the vocabulary")
            pairs.append((parts[0], parts[1]))

        hf = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                       ignore_merges=ignore_merges)
        )
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        added: list[AddedToken] = []
        for t, ty in zip(self._tokens, self._types):
            if ty == TOKEN_TYPE_CONTROL:
                added.append(AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                        single_word=False))
            elif ty == TOKEN_TYPE_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False,
                                        single_word=False))
        if added:
            hf.add_tokens(added)
        self.hf = hf
        self._bytes = [
            t.encode("utf-8") if ty == TOKEN_TYPE_CONTROL else _byte_level_decode(t)
            for t, ty in zip(self._tokens, self._types)
        ]

    def _build_spm(self, meta: GGUFTokenizerMetadata, vocab: dict[str, int]) -> tokenizers.Tokenizer:
        """The ``tokenizers`` pipeline of a ``llama`` (SentencePiece BPE) vocabulary."""
        if len(meta.scores) != self.n_vocab:
            raise ValueError("tokenizer.ggml.model='llama' needs tokenizer.ggml.scores "
                             "(one score per token)")
        if meta.unk_id is None and not any(ty == TOKEN_TYPE_BYTE for ty in self._types):
            raise ValueError("tokenizer.ggml.model='llama' needs byte tokens (<0xNN>) or an "
                             "unknown token")
        unk = self._tokens[meta.unk_id] if meta.unk_id is not None else None
        hf = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=_spm_merges(self._tokens, self._types, meta.scores, vocab),
                       unk_token=unk, fuse_unk=False, byte_fallback=True, ignore_merges=False)
        )
        steps = [normalizers.Replace(" ", _SPM_SPACE)]
        # llama.cpp: add_space_prefix defaults to true for SPM files; the space goes before every
        # piece of text that starts the input or follows a special or user-defined token
        if meta.add_space_prefix is None or meta.add_space_prefix:
            steps.insert(0, normalizers.Prepend(" "))
        hf.normalizer = normalizers.Sequence(steps)
        hf.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
        added: list[AddedToken] = []
        for t, ty in zip(self._tokens, self._types):
            # llama.cpp splits out control, user-defined and unknown tokens before the SPM merges
            if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
                added.append(AddedToken(t, special=ty != TOKEN_TYPE_USER_DEFINED, normalized=False,
                                        lstrip=False, rstrip=False, single_word=False))
        if added:
            hf.add_tokens(added)
        return hf

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build the tokenizer from a GGUF file (reads only the tokenizer keys).

        Args:
            path: the GGUF file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: unreadable GGUF, missing tokenizer keys, unsupported tokenizer model
                ("unsupported tokenizer model ...") or pre-tokenizer type.
        """
        return cls(read_tokenizer_metadata(path))

    # -- encode / decode --

    def prompt_ids(self, text: str) -> list[int]:
        """``encode(text)`` as a prompt: with BOS first when the file asks for it
        (``add_bos``, e.g. Gemma) and the text does not already begin with it (a chat
        template that writes ``bos_token``), as llama.cpp tokenizes a prompt."""
        ids = self.encode(text)
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added; control-token text parsed as the control token.

        Args:
            text: any string (may be empty -> ``[]``).

        Returns:
            ids, each in ``[0, n_vocab)``.

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if not text:
            return []
        if len(text) >= _GIL_FREE_CHARS:
            # tokenizers' encode holds the GIL (microseconds per token: a megabyte is seconds of
            # every other thread of the service waiting); encode_batch releases it, same ids
            return self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids

    def _check_id(self, i: int) -> int:
        """``i`` as a Python int in ``[0, n_vocab)`` (numpy integers accepted).

        Raises:
            TypeError: not an integer (bool and float included).
            ValueError: outside the vocabulary.
        """
        if isinstance(i, bool):
            raise TypeError("token id must be an int, got bool")
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"token id must be an int, got {type(i).__name__}") from None
        if not 0 <= i < self.n_vocab:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.n_vocab})")
        return i

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (control tokens: their UTF-8 text).

        A byte-level token may hold part of a UTF-8 character, so the result need not be valid
        UTF-8 on its own; use `IncrementalDecoder` for streaming text.

        Raises:
            TypeError / ValueError: the id is not an int / is outside ``[0, n_vocab)``.
        """
        return self._bytes[self._check_id(token_id)]

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` as stored in the GGUF (byte-level form)."""
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocabulary string is exactly ``text``, or ``None``."""
        return self.hf.token_to_id(text)

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (GGUF token type 3), e.g. ``<|im_start|>``, ``<|im_end|>``.

        Raises:
            TypeError / ValueError: the id is not an int / is outside ``[0, n_vocab)``.
        """
        return self._types[self._check_id(token_id)] == TOKEN_TYPE_CONTROL

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated `token_bytes` of ``ids`` (control tokens dropped when ``skip_special``)."""
        out = bytearray()
        for i in ids:
            i = self._check_id(i)
            if skip_special and self._types[i] == TOKEN_TYPE_CONTROL:
                continue
            out += self._bytes[i]
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut-off character) becomes U+FFFD.

        Args:
            ids: token ids.
            skip_special: drop control tokens (``<|im_end|>`` etc.) from the text.

        Raises:
            TypeError / ValueError: an id is not an int / is outside ``[0, n_vocab)``.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> "IncrementalDecoder":
        """A new `IncrementalDecoder` over this tokenizer."""
        return IncrementalDecoder(self, skip_special=skip_special)


# --- streaming ------------------------------------------------------------------------------------


class IncrementalDecoder:
    """Turns a stream of token ids into text without ever splitting a UTF-8 character.

    ``feed(id)`` returns the text completed by that token (possibly ``""`` when the token ends in
    the middle of a character, e.g. the first of the tokens of an emoji). ``flush()`` at the end
    returns what is left, with incomplete bytes replaced by U+FFFD. The concatenation of every
    ``feed`` result and ``flush()`` equals ``tokenizer.decode(ids, skip_special)``.

    Example: an emoji spread over three tokens gives ``"", "", "😀"``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text.

        Raises:
            TypeError / ValueError: the id is not an int / is outside the vocabulary.
        """
        tid = self._tok._check_id(token_id)
        if self._skip_special and self._tok._types[tid] == TOKEN_TYPE_CONTROL:
            return ""
        return self._dec.decode(self._tok._bytes[tid], final=False)

    def feed_many(self, ids: Iterable[int]) -> str:
        """`feed` every id in order; return the concatenated completed text."""
        return "".join(self.feed(i) for i in ids)

    def pending_bytes(self) -> bytes:
        """The bytes held back (an incomplete UTF-8 sequence, at most 3 bytes)."""
        return self._dec.getstate()[0]

    def flush(self) -> str:
        """End of stream: return held-back bytes as text (invalid leftovers -> U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class StopMatcher:
    """Applies stop strings to a stream of text deltas.

    The output is the text before the first stop string, where "first" means the occurrence that
    ends earliest in the whole text (ties: the one starting earliest). This depends only on the
    whole text, not on how it was cut into deltas, so a stream delivered token by token and one
    delivered several tokens per step (speculative decoding) stop at the same place.

    ``push(delta)`` returns ``(emit, stopped)``: ``emit`` is the text safe to send now, and any
    tail that could still be the start of a stop string is held back. Once ``stopped`` is True,
    ``emit`` holds the text up to (not including) the stop string, and the stream is over.
    ``flush()`` at the end of a stream without a stop returns the held-back tail.

    Example with stop ``["\\nUser:"]``: ``push("Hi\\nUs") -> ("Hi", False)``,
    ``push("er: x") -> ("", True)``, ``stop_string == "\\nUser:"``.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        """
        Args:
            stop_strings: the stop strings (may be empty: then everything is emitted at once).

        Raises:
            TypeError: not a sequence of str.
            ValueError: an empty stop string.
        """
        if isinstance(stop_strings, str):
            raise TypeError("stop_strings must be a sequence of str, not a single str")
        stops: list[str] = []
        for n, s in enumerate(stop_strings):
            if not isinstance(s, str):
                raise TypeError(f"stop_strings[{n}] must be a str, got {type(s).__name__}")
            if not s:
                raise ValueError(f"stop_strings[{n}] is empty")
            stops.append(s)
        self.stop_strings: tuple[str, ...] = tuple(stops)
        self._buf: str = ""
        self.stopped: bool = False
        self.stop_string: str | None = None  # the stop string that matched, once stopped

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return ``(text safe to emit now, stopped)``.

        Raises:
            RuntimeError: called after a stop string matched.
        """
        if self.stopped:
            raise RuntimeError("StopMatcher.push() after a stop string matched")
        if not self.stop_strings:
            return delta, False
        buf = self._buf + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop_strings:
            j = buf.find(s)
            if j >= 0:
                cand = (j + len(s), j, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self.stopped = True
            self.stop_string = best[2]
            self._buf = ""
            return buf[: best[1]], True
        hold = self._held_suffix_len(buf)
        self._buf = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """End of stream without a stop: return (and clear) the held-back text."""
        out, self._buf = self._buf, ""
        return out
