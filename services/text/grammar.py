"""Constrained output: a request's grammar as an llguidance matcher. Pure logic, no gRPC.

A grammar is one of (``GrammarSpec.kind``):
    json_object   any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)
    json_schema   a JSON schema, as JSON text (OpenAI's ``json_schema.schema``)
    lark          a Lark grammar in llguidance's dialect (its ``start`` rule is the output)
    gbnf          a GBNF grammar as llama.cpp writes it (its ``root`` rule is the output)

JSON is compact: no whitespace outside strings, ``,`` and ``:`` as separators (a schema's own
``x-guidance`` options override this), so a small model cannot pad its output with blank lines
up to max_tokens, and the keys, quotes and braces between the values are forced.

The matcher (llguidance's ``LLMatcher``, the Rust matcher of llama.cpp and vLLM) gives, after
the tokens consumed so far, the allowed next tokens as a bitmask in llguidance's layout (token t
allowed when bit t % 32 of uint32 word t // 32 is set), the tokens the grammar forces next
(``forced``: where only one continuation is possible), and rolls back the last n tokens exactly.
EOS ids are allowed only where the grammar is complete.

Limits: the grammar text at most MAX_GRAMMAR_BYTES bytes; the matcher's lexer at most
LEXER_FUEL units of work to build its regular expressions (about 50 per microsecond) and its
own per-token limits (llguidance's defaults). A schema whose regular expressions blow up (a
pattern such as ``((a{50}b){50}c){50}``) ends with the matcher's ``too many expressions
constructed`` error instead of running for seconds per token.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import llguidance
import numpy as np

KINDS = ("json_object", "json_schema", "lark", "gbnf")
MAX_GRAMMAR_BYTES = 64 * 1024
LEXER_FUEL = 200_000
# JSON output without free whitespace (a schema's "x-guidance" object may ask for it)
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The grammar is refused (bad syntax, a bad schema, over a limit) or the matcher failed;
    the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar: ``kind`` one of KINDS, ``text`` its source ("" for json_object)."""

    kind: str
    text: str = ""


def spec_of(msg) -> GrammarSpec | None:
    """The GrammarSpec of an ``echospec.v1.Grammar`` message (None: unset, free text).

    Raises:
        GrammarError: ``json_object`` set to false (set it true, or leave the grammar unset).
    """
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise GrammarError("grammar.json_object must be true when set (leave grammar unset "
                               "for free text)")
        return GrammarSpec("json_object")
    return GrammarSpec(kind, getattr(msg, kind))


def limits() -> llguidance.LLParserLimits:
    """The matcher's resource limits (the module docstring); errors without parser dumps."""
    return llguidance.LLParserLimits(initial_lexer_fuel=LEXER_FUEL, verbose_errors=False)


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: see ``check_grammar``).

    Raises:
        GrammarError: an unknown kind, text over MAX_GRAMMAR_BYTES, a json_schema that is not a
            JSON object, text given for json_object, empty text, a GBNF grammar that does not parse.
    """
    if spec.kind not in KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    size = len(spec.text.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"grammar.{spec.kind} is {size} bytes, more than the limit of "
                           f"{MAX_GRAMMAR_BYTES} bytes")
    if spec.kind == "json_object":
        if spec.text:
            raise GrammarError("grammar.json_object takes no text")
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if not spec.text.strip():
        raise GrammarError(f"grammar.{spec.kind} is empty")
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as exc:
            raise GrammarError(f"grammar.json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"grammar.json_schema must be a JSON object (a schema), "
                               f"got a JSON {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError, OverflowError) as exc:   # e.g. an integer past 64 bits
            raise GrammarError(f"grammar.json_schema: the matcher cannot take it: {exc}") from None
    if spec.kind == "lark":
        try:
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"grammar.lark: {exc}") from None
    try:
        return llguidance.grammar_from("gbnf", spec.text)
    except ValueError as exc:
        raise GrammarError(f"grammar.gbnf: {exc}") from None


def check_grammar(spec: GrammarSpec) -> str:
    """Check ``spec`` without a tokenizer; returns its llguidance grammar.

    Raises:
        GrammarError: as grammar_source, or the matcher's compile error (``grammar.lark: at
            1(8): unknown name: "foo"``).
    """
    src = grammar_source(spec)
    msg = llguidance.LLMatcher.validate_grammar(src, None, limits=limits())
    if msg and not msg.startswith("WARNING"):
        raise GrammarError(f"grammar.{spec.kind}: {_first_lines(msg)}")
    return src


def _first_lines(msg: str, n: int = 6) -> str:
    lines = [ln for ln in msg.strip().splitlines() if ln.strip() and ln.strip() != "<non-verbose/>"]
    return "\n".join(lines[:n])


def bitmask_to_bool(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """llguidance's uint32 bitmask -> bool [n_vocab] (token t allowed when bit t % 32 of
    word t // 32 is set; ids past the mask's words are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8), bitorder="little")
    out = np.zeros(n_vocab, dtype=bool)
    n = min(n_vocab, bits.size)
    out[:n] = bits[:n].astype(bool)
    return out


class TokenizerCache:
    """llguidance tokenizers of one vocabulary, one per set of EOS ids (building one takes about
    half a second for a 49K vocabulary, so each is built once). Thread-safe.

    Args:
        hf_json: the ``tokenizers`` JSON of the model's tokenizer (``Tokenizer.hf.to_str()``).
        n_vocab: the model's vocabulary (may exceed the tokenizer's; the extra ids are never
            allowed).
    """

    def __init__(self, hf_json: str, n_vocab: int):
        self.hf_json = hf_json
        self.n_vocab = n_vocab
        self._by_eos: dict[tuple, llguidance.LLTokenizer] = {}
        self._lock = threading.Lock()

    def get(self, eos_ids: Iterable[int]) -> llguidance.LLTokenizer:
        key = tuple(sorted(set(int(t) for t in eos_ids)))
        if not key:
            raise GrammarError("a constrained generation needs at least one EOS id (eos_ids is "
                               "empty): the grammar allows EOS where the output is complete")
        with self._lock:
            tok = self._by_eos.get(key)
            if tok is None:
                tok = llguidance.LLTokenizer(self.hf_json, n_vocab=self.n_vocab, eos_token=list(key))
                self._by_eos[key] = tok
            return tok


class Constraint:
    """One generation's matcher over the tokens it has output (lifecycle: ``allowed`` ->
    ``consume`` after each token; ``rollback`` with the KV cache).

    Args:
        tokenizer: the llguidance tokenizer (TokenizerCache.get).
        spec: the grammar.
        n_vocab: rows of the logits (the model's vocabulary).
    Raises:
        GrammarError: the grammar does not compile (the matcher's message).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, spec: GrammarSpec, n_vocab: int):
        self.spec = spec
        self.n_vocab = n_vocab
        self.matcher = llguidance.LLMatcher(tokenizer, grammar_source(spec), limits=limits(),
                                            log_level=0)
        self.consumed: list[int] = []   # the tokens the matcher holds, in order
        self._raise_if_error()

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            where = f" after {len(self.consumed)} output tokens" if self.consumed else ""
            err = _first_lines(self.matcher.get_error())
            if "too many expressions" in err or "fuel" in err:
                err += (f" (over the matcher's limit of {LEXER_FUEL} units of lexer work: the "
                        f"grammar's regular expressions or patterns are too complex)")
            raise GrammarError(f"grammar.{self.spec.kind}: the matcher failed{where}: {err}")

    def allowed(self) -> np.ndarray:
        """The tokens allowed next: bool [n_vocab].

        Raises:
            GrammarError: the matcher is in an error state (a limit hit while computing it).
        """
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<u4")
        self._raise_if_error()
        mask = bitmask_to_bool(words, self.n_vocab)
        if not mask.any():
            raise GrammarError(f"grammar.{self.spec.kind}: no token is allowed after "
                               f"{len(self.consumed)} output tokens (the grammar admits no continuation)")
        return mask

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (llguidance's fast-forward tokens: the
        only bytes the grammar allows, tokenized); [] when the next token is a choice."""
        if limit <= 0:
            return []
        toks = [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]
        self._raise_if_error()
        return toks

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (nothing consumed)."""
        return int(self.matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over ``tokens`` (each allowed in turn).

        Raises:
            GrammarError: a token the grammar does not allow (the matcher's message).
        """
        for t in tokens:
            ok = self.matcher.consume_token(int(t))
            if not ok:
                self._raise_if_error()
                raise GrammarError(f"grammar.{self.spec.kind}: token {int(t)} is not allowed after "
                                   f"{len(self.consumed)} output tokens")
            self.consumed.append(int(t))

    def masks_along(self, draft: Sequence[int]) -> list[np.ndarray]:
        """The allowed tokens at each position of a verify of ``draft``: K + 1 masks, mask i
        after draft[:i]. The matcher consumes the whole draft (roll back the rejected part).

        Raises:
            GrammarError: a draft token the grammar does not allow (cut drafts with
                ``valid_prefix`` first), or the matcher failed.
        """
        masks = [self.allowed()]
        for t in draft:
            self.consume([t])
            masks.append(self.allowed())
        return masks

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` consumed tokens (as the KV cache rolls back).

        Raises:
            GrammarError: n outside [0, consumed] or the matcher refused.
        """
        if not 0 <= n <= len(self.consumed):
            raise GrammarError(f"rollback of {n} tokens: the matcher holds {len(self.consumed)}")
        if n == 0:
            return
        if not self.matcher.rollback(n):
            self._raise_if_error()
            raise GrammarError(f"grammar.{self.spec.kind}: the matcher cannot roll back {n} tokens")
        del self.consumed[len(self.consumed) - n:]

    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())


def masked(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A logits row with every token not allowed set to -inf (a new float32 array)."""
    out = np.array(row, dtype=np.float32, copy=True)
    out[~allowed] = -np.inf
    return out


def masked_argmax(row: np.ndarray, allowed: np.ndarray) -> int:
    """The greedy token under the mask: the first index of the largest allowed logit.

    Raises:
        GrammarError: no token allowed.
        ValueError: the row holds a NaN at an allowed token (no argmax exists).
    """
    if not allowed.any():
        raise GrammarError("no token is allowed")
    m = masked(row, allowed)
    if np.isnan(m).any():
        raise ValueError(f"the logits row holds a NaN at position {int(np.argmax(np.isnan(m)))}")
    return int(np.argmax(m))
