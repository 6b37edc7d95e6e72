"""Tests for services/text/tokenizer.py.

Reference: tests/data/tokenizer_golden.json, written by scripts/gen_tokenizer_golden.py with
transformers' GGUF tokenizer converter, and tests/data/tokenizer_golden_gemma3.json (Gemma 3's
SentencePiece vocabulary and a tiny one), written by the same script with ``--gemma`` from llama.cpp
itself (neither is needed to run these tests).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import gguf
import pytest

from ggufgen import write_tokenizer_gguf

from echospec.services.text.tokenizer import (
    IncrementalDecoder,
    StopMatcher,
    Tokenizer,
    pre_tokenizer_regexes,
    read_tokenizer_metadata,
)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((ROOT / "tests" / "data" / "tokenizer_golden.json").read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
TINY = GOLDEN["tiny_qwen2"]
GEMMA_GOLDEN = json.loads((ROOT / "tests" / "data" / "tokenizer_golden_gemma3.json").read_text(encoding="utf-8"))
GEMMA_CASES = GEMMA_GOLDEN["cases"]
TINY_SPM = GEMMA_GOLDEN["tiny_spm"]


def _model_path() -> Path:
    """The default model, fetched by the project's own script if it is not cached yet."""
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fetch(verbose=False)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(_model_path())


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_tok")
    return write_tokenizer_gguf(d / "tiny_qwen2.gguf", TINY["tokens"], TINY["token_types"], TINY["merges"],
                                pre=TINY["pre"], bos_id=TINY["bos_id"], eos_id=TINY["eos_id"])


@pytest.fixture(scope="module")
def tiny(tiny_path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_path)


# --- SmolLM2 against the reference ----------------------------------------------------------------


def test_golden_file_is_for_this_model():
    assert GOLDEN["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(CASES) >= 50


def test_smollm2_metadata(smol: Tokenizer):
    assert smol.pre == "smollm"
    assert smol.n_vocab == 49152
    assert smol.bos_id == 1 and smol.eos_id == 2
    # <|im_end|> is EOS; <|endoftext|> is a control end-of-generation token too (as llama.cpp says).
    assert smol.eos_ids == frozenset({0, 2})
    assert smol.is_special(1) and smol.is_special(2) and not smol.is_special(4093)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}:{c['text'][:24]!r}" for i, c in enumerate(CASES)])
def test_encode_equals_reference(smol: Tokenizer, case):
    assert smol.encode(case["text"]) == case["ids"]


def test_decode_round_trip_and_reference_decode(smol: Tokenizer):
    for case in CASES:
        ids = smol.encode(case["text"])
        assert smol.decode(ids) == case["text"], case["text"]
        assert smol.decode(case["ids"]) == case["decoded"], case["text"]


def test_special_tokens_parse_and_skip(smol: Tokenizer):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [1, 4093, 198, 6004, 2]
    assert smol.decode(ids, skip_special=True) == "user\nhi"
    assert smol.token_bytes(1) == b"<|im_start|>"
    # Text that only resembles a special token stays ordinary text.
    assert 1 not in smol.encode("<|im_start")


def test_digits_split_one_per_token(smol: Tokenizer):
    ids = smol.encode("1234567890")
    assert len(ids) == 10
    assert [smol.decode([i]) for i in ids] == list("1234567890")


def test_token_bytes_concatenate_to_utf8(smol: Tokenizer):
    text = "naïve 😀 中文"
    ids = smol.encode(text)
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8")
    # The emoji spans several byte tokens, none of them valid UTF-8 on its own.
    emoji_ids = smol.encode("😀")
    assert len(emoji_ids) > 1
    assert all(len(smol.token_bytes(i)) < 4 for i in emoji_ids)


def test_bad_ids_and_types(smol: Tokenizer):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.decode([49152])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.token_bytes(-1)
    with pytest.raises(TypeError):
        smol.decode(["a"])
    with pytest.raises(TypeError):
        smol.token_bytes(True)
    with pytest.raises(TypeError):
        smol.token_bytes(1.0)
    import numpy as np
    assert smol.decode(np.array([4093, 198], dtype=np.int32)) == "user\n"
    with pytest.raises(TypeError):
        smol.encode(b"bytes")


# --- incremental decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["😀👨‍👩‍👧‍👦 ok", "你好，世界！", "مرحبا", "Café ñ", "plain ascii"])
def test_incremental_decoder_never_splits_a_character(smol: Tokenizer, text: str):
    ids = smol.encode(text)
    dec = smol.incremental_decoder()
    pieces = [dec.feed(i) for i in ids]
    tail = dec.flush()
    assert "".join(pieces) + tail == text
    assert tail == ""
    assert all("\ufffd" not in p for p in pieces)
    # Each piece is whole characters: re-encoding the pieces gives back the byte stream in order.
    assert b"".join(p.encode("utf-8") for p in pieces) == text.encode("utf-8")


def test_incremental_decoder_holds_back_partial_emoji(smol: Tokenizer):
    ids = smol.encode("😀")
    dec = IncrementalDecoder(smol)
    assert [dec.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.pending_bytes() == "😀".encode("utf-8")[: len(dec.pending_bytes())]
    assert len(dec.pending_bytes()) > 0
    assert dec.feed(ids[-1]) == "😀"
    assert dec.pending_bytes() == b""


def test_incremental_decoder_flush_replaces_incomplete_tail(smol: Tokenizer):
    ids = smol.encode("a😀")
    dec = IncrementalDecoder(smol)
    out = "".join(dec.feed(i) for i in ids[:-1])
    assert out == "a"
    assert dec.flush() == "\ufffd"
    # The same as a one-shot decode of the truncated ids.
    assert smol.decode(ids[:-1]) == "a\ufffd"


def test_incremental_decoder_skip_special(smol: Tokenizer):
    ids = smol.encode("<|im_start|>assistant\n你好<|im_end|>")
    dec = IncrementalDecoder(smol, skip_special=True)
    assert dec.feed_many(ids) + dec.flush() == "assistant\n你好"
    assert smol.decode(ids, skip_special=True) == "assistant\n你好"


def test_incremental_equals_decode_on_random_ids(smol: Tokenizer):
    rng = random.Random(1234)
    for _ in range(20):
        ids = [rng.randrange(smol.n_vocab) for _ in range(rng.randrange(1, 30))]
        dec = IncrementalDecoder(smol)
        assert dec.feed_many(ids) + dec.flush() == smol.decode(ids)


# --- stop strings ---------------------------------------------------------------------------------


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Whole-text rule: cut before the occurrence that ends first (ties: starts first)."""
    best = None
    for s in stops:
        j = text.find(s)
        if j >= 0 and (best is None or (j + len(s), j) < best):
            best = (j + len(s), j)
    return (text, False) if best is None else (text[: best[1]], True)


def _run_stop(deltas: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    emitted = []
    for d in deltas:
        out, stopped = m.push(d)
        emitted.append(out)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(m.flush())
    return "".join(emitted), False, emitted


def test_stop_string_split_across_deltas():
    m = StopMatcher(["\nUser:"])
    assert m.push("Hello") == ("Hello", False)
    assert m.push(" there\nUs") == (" there", False)  # "\nUs" held back
    assert m.push("er") == ("", False)
    assert m.push(": more") == ("", True)
    assert m.stop_string == "\nUser:"
    with pytest.raises(RuntimeError):
        m.push("x")


def test_stop_held_back_text_released_when_it_cannot_match():
    m = StopMatcher(["STOP"])
    assert m.push("ab ST") == ("ab ", False)
    assert m.push("ART") == ("START", False)
    assert m.push("S") == ("", False)
    assert m.flush() == "S"


def test_stop_one_character_per_delta_and_earliest_end_wins():
    text = "xx abcd bc"
    stops = ["abcde", "bc"]
    assert _run_stop(list(text), stops)[:2] == ("xx a", True)
    assert _run_stop([text], stops)[:2] == ("xx a", True)
    # Same end: the longer (earlier-starting) one wins.
    assert _run_stop(["xabc"], ["bc", "abc"])[:2] == ("x", True)


def test_stop_result_independent_of_chunking():
    rng = random.Random(7)
    alphabet = "ab\n:"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(0, 6))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got, stopped, _ = _run_stop(deltas, stops)
        assert (got, stopped) == _reference_stop(text, stops), (text, stops, deltas)


def test_stop_over_streamed_tokens(smol: Tokenizer):
    ids = smol.encode("Sure! 你好 world.\n<|im_end|>ignored")
    dec = IncrementalDecoder(smol)
    m = StopMatcher(["好 wor"])
    out = []
    for i in ids:
        piece, stopped = m.push(dec.feed(i))
        out.append(piece)
        if stopped:
            break
    assert stopped and "".join(out) == "Sure! 你"


def test_stop_matcher_rejects_bad_stop_strings():
    with pytest.raises(ValueError, match=r"stop_strings\[1\] is empty"):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopMatcher("STOP")
    with pytest.raises(TypeError):
        StopMatcher([1])
    m = StopMatcher([])
    assert m.push("anything") == ("anything", False)


# --- the qwen2 pre-tokenizer path, on a tiny GGUF --------------------------------------------------


def test_tiny_qwen2_metadata(tiny: Tokenizer):
    assert tiny.pre == "qwen2"
    assert tiny.n_vocab == len(TINY["tokens"])
    assert tiny.eos_ids == frozenset({0, 2})  # eos <|im_end|> and control <|endoftext|>


@pytest.mark.parametrize("case", TINY["cases"], ids=[repr(c["text"][:20]) for c in TINY["cases"]])
def test_tiny_qwen2_encode_equals_reference(tiny: Tokenizer, case):
    ids = tiny.encode(case["text"])
    assert ids == case["ids"]
    assert tiny.decode(ids) == case["text"]


def test_tiny_qwen2_split_rules(tiny: Tokenizer):
    tid = tiny.token_to_id
    # Digits one by one: the merge "1 2" never applies.
    assert tiny.encode("12") == [tid("1"), tid("2")]
    # Case-insensitive contraction, one piece: merge "' S" applies.
    assert tid("'S") in tiny.encode("IT'S")
    # " \n" is one piece under qwen2 (two under the GPT-2 rules), so the merge "Ġ Ċ" applies.
    assert tiny.encode("a \nb") == [tid("a"), tid("\u0120\u010a"), tid("b")]
    # A user-defined token is matched whole but is not special.
    think = tid("<think>")
    assert tiny.encode("<think>")[0] == think and not tiny.is_special(think)


def test_pre_tokenizer_regex_sets():
    assert pre_tokenizer_regexes("smollm")[0] == r"\p{N}"
    assert len(pre_tokenizer_regexes("qwen2")) == 1
    for pre in ("llama-bpe", "gpt2", "default"):
        assert pre_tokenizer_regexes(pre)


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2", "default"])
def test_other_pre_types_build_and_round_trip(tmp_path, pre):
    p = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", TINY["tokens"], TINY["token_types"], TINY["merges"],
                             pre=pre)
    tok = Tokenizer.from_gguf(p)
    text = "HE'S 123 a \nb <|im_end|> 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|im_end|>") in ids


# --- refusals -------------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    p = write_tokenizer_gguf(tmp_path / "x.gguf", TINY["tokens"], TINY["token_types"], TINY["merges"],
                             pre="no-such-pre")
    with pytest.raises(ValueError, match="unsupported pre-tokenizer type.*no-such-pre"):
        Tokenizer.from_gguf(p)


def test_unknown_tokenizer_model_is_refused(tmp_path):
    p = write_tokenizer_gguf(tmp_path / "ugm.gguf", ["<unk>", "<s>", "</s>", "\u2581a"], [2, 3, 3, 1], [],
                             model="t5", pre=None, bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match="unsupported tokenizer model.*'t5'"):
        Tokenizer.from_gguf(p)


def test_sentencepiece_model_without_scores_is_refused(tmp_path):
    p = write_tokenizer_gguf(tmp_path / "spm.gguf", ["<unk>", "<s>", "</s>", "\u2581a"], [2, 3, 3, 1], [],
                             model="llama", pre=None, bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match="needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf(p)


def test_merge_outside_vocabulary_is_refused(tmp_path):
    p = write_tokenizer_gguf(tmp_path / "m.gguf", TINY["tokens"], TINY["token_types"],
                             TINY["merges"] + ["q z"], pre="qwen2")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[\d+\]='q z'"):
        Tokenizer.from_gguf(p)


def test_missing_and_non_gguf_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        read_tokenizer_metadata(bad)


def test_gguf_without_tokenizer_is_refused(tmp_path):
    p = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.model missing"):
        Tokenizer.from_gguf(p)


def test_max_tokens_inside_a_multibyte_character_ends_with_u_fffd(smollm2_tokenizer):
    """README: the output cut inside a character by max_tokens ends with U+FFFD."""
    from echospec.services.coordinator.generation import FINISH_LENGTH, _Output
    ids = smollm2_tokenizer.encode("🦊")
    assert len(ids) >= 2, ids      # the fox is several byte-level tokens
    out = _Output(smollm2_tokenizer, [], max_tokens=1)
    d = out.take(ids)
    assert out.finish == FINISH_LENGTH and d.token_ids == ids[:1]
    assert d.text == "\ufffd"
    full = _Output(smollm2_tokenizer, [], max_tokens=len(ids))
    assert full.take(ids).text == "🦊"


# --- SentencePiece BPE (tokenizer model "llama"): Gemma 3 against llama.cpp ------------------------


@pytest.fixture(scope="module")
def gemma(gemma3_path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_path)


def test_gemma_golden_file_is_for_this_model(gemma3_path):
    assert GEMMA_GOLDEN["model"] == Path(gemma3_path).name == "gemma-3-270m-q4_k_m.gguf"
    assert GEMMA_GOLDEN["model_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert len(GEMMA_CASES) >= 100


def test_gemma_metadata(gemma: Tokenizer):
    assert gemma.model == "llama" and gemma.n_vocab == 262144
    assert gemma.bos_id == 2 and gemma.eos_id == 1
    assert gemma.eos_ids == frozenset({1, 106})   # <eos>, and <end_of_turn> (a control token)
    assert gemma.is_special(105) and gemma.token_bytes(105) == b"<start_of_turn>"


@pytest.mark.parametrize("case", GEMMA_CASES, ids=[f"{i}:{c['text'][:24]!r}" for i, c in enumerate(GEMMA_CASES)])
def test_gemma_encode_equals_llama_cpp(gemma: Tokenizer, case):
    assert gemma.encode(case["text"]) == case["ids"]


def test_gemma_decode_round_trip_and_llama_cpp_decode(gemma: Tokenizer):
    for case in GEMMA_CASES:
        assert gemma.decode(case["ids"]) == case["decoded"], case["text"]
        # a U+2581 in the text is a space to SentencePiece (llama.cpp decodes it as one too)
        assert gemma.decode(gemma.encode(case["text"])) == case["text"].replace("\u2581", " ")


def test_gemma_spaces_newlines_and_tabs(gemma: Tokenizer):
    # runs of spaces, tabs and newlines are user-defined tokens, split out before merging
    assert gemma.encode("  ") == [gemma.token_to_id("  ")]
    assert gemma.encode("\n\n") == [gemma.token_to_id("\n\n")]
    assert gemma.encode("\t") == [gemma.token_to_id("\t")]
    # a single space is U+2581 inside a token; no space is prepended (add_space_prefix false)
    assert [gemma.token_text(i) for i in gemma.encode("a b")] == ["a", "\u2581b"]
    assert gemma.token_bytes(gemma.encode(" b")[0]) == b" b"


def test_gemma_byte_fallback(gemma: Tokenizer):
    ids = gemma.encode("\U0010fffd")        # a private-use character no token covers
    assert [gemma.token_text(i) for i in ids] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert [gemma.token_bytes(i) for i in ids] == [b"\xf4", b"\x8f", b"\xbf", b"\xbd"]
    dec = gemma.incremental_decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "", "\U0010fffd"]


def test_gemma_special_tokens_parse_and_skip(gemma: Tokenizer):
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[0] == 105 and ids[-1] == 106
    assert gemma.decode(ids, skip_special=True) == "user\nhi"
    assert 105 not in gemma.encode("<start_of_turn")


def test_gemma_incremental_equals_decode_on_random_ids(gemma: Tokenizer):
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(gemma.n_vocab) for _ in range(30)]
        dec = gemma.incremental_decoder()
        assert "".join(dec.feed(i) for i in ids) + dec.flush() == gemma.decode(ids)


def test_tiny_sentencepiece_equals_llama_cpp(tmp_path):
    """add_space_prefix absent (llama.cpp's default: on): a space before the text and after each
    control token; a character outside the vocabulary becomes byte tokens."""
    p = write_tokenizer_gguf(tmp_path / "tiny_spm.gguf", TINY_SPM["tokens"], TINY_SPM["token_types"], [],
                             model="llama", pre=None, bos_id=TINY_SPM["bos_id"],
                             eos_id=TINY_SPM["eos_id"], scores=TINY_SPM["scores"],
                             unk_id=TINY_SPM["unk_id"])
    tok = Tokenizer.from_gguf(p)
    for case in TINY_SPM["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    # the prepended space is text of the first token: decode does not remove it
    assert tok.decode(tok.encode("the hi")) == " the hi"
    p2 = write_tokenizer_gguf(tmp_path / "tiny_spm_noprefix.gguf", TINY_SPM["tokens"],
                              TINY_SPM["token_types"], [], model="llama", pre=None,
                              bos_id=TINY_SPM["bos_id"], eos_id=TINY_SPM["eos_id"],
                              scores=TINY_SPM["scores"], unk_id=TINY_SPM["unk_id"],
                              add_space_prefix=False)
    assert Tokenizer.from_gguf(p2).decode(Tokenizer.from_gguf(p2).encode("the hi")) == "the hi"


def test_prompt_ids_add_bos_as_the_file_asks(gemma: Tokenizer, smollm2_path):
    assert gemma.add_bos and gemma.bos_id == 2
    text = "def fibonacci(n):"
    assert gemma.prompt_ids(text) == [2] + gemma.encode(text)
    assert gemma.prompt_ids("<bos>" + text) == [2] + gemma.encode(text)   # never twice
    assert gemma.prompt_ids("") == [2]
    smol = Tokenizer.from_gguf(smollm2_path)                              # add_bos false
    assert not smol.add_bos and smol.prompt_ids(text) == smol.encode(text)


def test_tokenizing_a_long_text_lets_other_threads_run(smollm2_path):
    # was: Tokenize of a few MB (the coordinator's Tokenize RPC; a long prompt) held the GIL for
    # its whole run: every other call of the coordinator waited seconds
    import threading
    import time

    from echospec.services.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_path)
    text = "1 " * 100_000
    ticks, done = [0], threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    th = threading.Thread(target=tick)
    th.start()
    t0 = time.monotonic()
    ids = tok.encode(text)
    took = time.monotonic() - t0
    done.set()
    th.join()
    assert ids == tok.hf.encode(text, add_special_tokens=False).ids and len(ids) == 200_000
    assert ticks[0] >= 0.3 * took / 0.005, (ticks[0], took)
