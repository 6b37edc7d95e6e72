"""Generate tests/data/tokenizer_golden.json: reference token ids for a varied text set.

The reference is transformers' GGUF tokenizer converter
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), which reproduces llama.cpp's tokenization.
transformers (and torch, which its GGUF module imports) are needed only to run this script; they
are not runtime or test dependencies. Install them into a scratch environment or temporarily:

    pip install transformers torch==2.13.0
    python scripts/gen_tokenizer_golden.py [--model PATH] [--out tests/data/tokenizer_golden.json]

The output holds, for every text: the text, the reference ids (no special tokens added; special
token text parsed as special tokens) and the reference decode of those ids. It also holds
``tiny_qwen2``: a tiny byte-level vocabulary (the 256 byte tokens, a few merges, ChatML control
tokens, one user-defined token) with ``pre = "qwen2"``, which tests write into a GGUF file, and the
reference ids for texts that tell the qwen2 split rules from the GPT-2 ones.

With ``--gemma`` it writes tests/data/tokenizer_golden_gemma3.json instead: the same texts plus
`GEMMA_TEXTS` (Gemma's control and user-defined tokens, whitespace runs, byte fallback) tokenized
by llama.cpp itself through llama-cpp-python (``Llama(path, vocab_only=True)``, which loads just the
tokenizer; ``tokenize(text, add_bos=False, special=True)``; the decode is ``detokenize(ids,
special=True)``), and ``tiny_spm``: a tiny SentencePiece vocabulary without add_space_prefix (so
llama.cpp's default, a space prefix, applies) with llama.cpp's ids for `TINY_SPM_TEXTS`.
llama-cpp-python is needed only to run it:

    pip install llama-cpp-python==0.3.36
    python scripts/gen_tokenizer_golden.py --gemma [--model PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

DEFAULT_MODEL = os.path.expanduser("~/.cache/echospec/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "data", "tokenizer_golden.json")
GEMMA_MODEL = os.path.expanduser("~/.cache/echospec/gemma-3-270m-q4_k_m.gguf")
GEMMA_OUT = os.path.join(os.path.dirname(DEFAULT_OUT), "tokenizer_golden_gemma3.json")

# Varied texts: whitespace runs, digits, punctuation, code, emoji (incl. ZWJ and flags), CJK,
# accented Latin, Arabic and other scripts, special tokens, edge cases.
TEXTS: list[str] = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n",
    "\r\n",
    "Hello world",
    " Hello world",
    "  Hello  world  ",
    "Hello\tworld\t\ttab",
    "line one\nline two\n\nline four\n",
    "trailing spaces   ",
    "   leading spaces",
    "a  b   c    d",
    "\n\n\n   indented after newlines",
    "0",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "Order #12345 costs $1,234.56 (tax 7.5%) on 2024-01-31 at 23:59:59.",
    "99 bottles, 100 bottles, 1000000 bottles",
    "I'm sure you're right, they've said we'll go; he'd've known. It's DON'T and CAN'T.",
    "Hello, world! How are you? I'm fine... Really?! (yes) [no] {maybe} <ok>",
    "!!!???...;;;:::---___===+++***&&&%%%$$$###@@@~~~```'''\"\"\"",
    "a.b,c;d:e!f?g",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "    x = {'key': [1, 2, 3], \"other\": None}  # comment\n",
    "<html><body><div class=\"x\">Text &amp; more</div></body></html>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "https://example.com/path?query=1&other=two#frag",
    "user@example.com",
    "😀",
    "😀😃😄😁",
    "I love 🍕 and 🍣!",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 technologist, 🏳️‍🌈 flag",
    "🇫🇷🇯🇵🇺🇸",
    "❤️ ✨ ✅ ➡️",
    "你好，世界！",
    "我喜欢吃苹果和香蕉。今天天气很好。",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 텍스트입니다.",
    "Café, naïve, façade, résumé, jalapeño, Ångström, Straße, Øre, Łódź",
    "Ελληνικά κείμενο και Русский текст",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "हिन्दी पाठ",
    "ไทย ภาษา",
    "e\u0301 (combining acute) vs \u00e9 (precomposed)",
    "zero\u200bwidth\u200cjoiners\u200d",
    "\u00a0non-breaking\u00a0space\u3000ideographic space",
    "mixed 中文 and English 123 😀 text",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|im_end|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start",
    "<im_start> <|im_start |>",
    "<repo_name>echospec<file_sep>main.py",
    "Supercalifragilisticexpialidocious" * 8,
    "a" * 300,
    "ab" * 100 + " " + "xyz" * 50,
    "9" * 100,
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Thequickbrownfoxjumpsoverthelazydog",
    "CamelCaseIdentifier snake_case_identifier SCREAMING_CASE kebab-case-id",
    "'s 's 'S 'll 'LL",
    "\u2018curly quotes\u2019 and \u201cdouble\u201d \u2014 dashes \u2013 and \u2026",
    "Math: \u2211 \u222b \u221e \u2264 \u2265 \u2260 \u00b1 \u00d7 \u00f7 \u03c0 \u221a",
    "\x00\x01\x7f control chars",
    "end with emoji 🎉",
]


# More texts for Gemma 3 (SentencePiece BPE with byte fallback): its control tokens, its
# user-defined tokens (runs of spaces, tabs and newlines, HTML tags; split out before merging, longer
# runs than the longest token), a literal U+2581, byte fallback (characters no token covers), text
# that spells a byte token, and a text long enough for the GIL-free encode path.
GEMMA_TEXTS: list[str] = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>",
    "<start_of_turn> user",
    "<start_of_turn",
    "text<end_of_turn>more <unused0> and [multimodal] <start_of_image><end_of_image>",
    " a",
    "a ",
    "a b",
    "a  b",
    " " * 40,
    "x" + " " * 33 + "y",
    "\t" * 35 + "tabs",
    "\n" * 40 + "newlines",
    " \n \n\t \t\n",
    "\n\n\n\ttext\t\t\n   \n",
    "<table><tr><td>1</td><td>2</td></tr></table>",
    "<s>strike</s> <sub>2</sub> <sup>3</sup> <b>bold</b><i>it</i><u>u</u>",
    "<div><span>x</span></div> <code>y</code> <bbox>z</bbox>",
    "<tr> <td>",
    "already\u2581escaped \u2581\u2581 marks",
    "\ue000\uf8ff private use",
    "\U00020000\U0002a6d6 rare CJK",
    "\U0001fae8 \U0001f9ec \U0001fa7b newer emoji",
    "\u0f3a\u0f3b \u1680 ogham \u16a0\u16a1 runes",
    "\x01\x02\x03\x1b[0m escape",
    "<0x41><0xE4> literal byte token text",
    "\U0010fffd last plane",
    "Ünïcödé ÀÉÎÕÜ àéîõü ñ ç ß ø å æ œ ÿ",
    "const f = (a, b) => { return a ?? b; };\n\tif (x) {\n\t\ty();\n\t}\n",
    "import numpy as np\n\n\nclass A:\n    def __init__(self):\n        pass\n",
    "The quick brown fox jumps over the lazy dog. 中文 😀\n" * 90,
]


# Texts for the tiny qwen2 vocabulary: single digits ("12" must not merge), case-insensitive
# contractions ("'S"), " \n" kept together, a symbol glued to a word ("$he"), whitespace runs.
TINY_TEXTS: list[str] = [
    "",
    "the thing",
    "12 123 1234",
    "HE'S IT'S he's",
    "a \nb",
    "$he $the",
    "    indented\n\tthe\n\n\nend  ",
    "<|im_start|>user\nthe thing<|im_end|>\n",
    "<think>ok</think>",
    "H\u00e9llo \u4e16\u754c \U0001F600 e\u0301",
]


def tiny_qwen2_spec() -> dict:
    """A tiny byte-level BPE vocabulary with pre-tokenizer qwen2 (JSON-serialisable)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 byte-level characters
    byte_chars = sorted(alphabet, key=lambda c: _char_byte(c))
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    user_defined = ["<think>"]
    merges = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("in", "g"), ("1", "2"),
              ("'", "S"), ("\u0120", "\u010a"), ("$", "h"), ("$h", "e"), ("\u0120", "\u0120"),
              ("\u0120\u0120", "\u0120\u0120"), ("\u010a", "\u010a"), ("t", "h"), ("th", "ing")]
    tokens = control + user_defined + byte_chars + [a + b for a, b in merges]
    types = [3] * len(control) + [4] * len(user_defined) + [1] * (len(tokens) - 4)
    return {"pre": "qwen2", "tokens": tokens, "token_types": types,
            "merges": [f"{a} {b}" for a, b in merges], "bos_id": 0, "eos_id": 2}


# Texts for the tiny SentencePiece vocabulary (add_space_prefix absent: llama.cpp's default, on):
# the space goes before the text and after every control token, unknown characters become bytes.
TINY_SPM_TEXTS: list[str] = [
    "",
    "the hi",
    " ab",
    "abc\nthe",
    "<s>the</s>the",
    "<s> the",
    "x",
    "\u65e5 ab  the",
    "  ",
]


def tiny_spm_spec() -> dict:
    """A tiny SentencePiece BPE vocabulary (tokenizer model llama; JSON-serialisable)."""
    sp = "\u2581"
    normal = [sp, "a", "b", "c", "h", "i", "t", "e", sp + "a", "ab", sp + "ab", "th", "the", sp + "the",
              "hi", sp + "hi", "\n", sp + sp]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + normal
    types = [2, 3, 3] + [6] * 256 + [1] * len(normal)
    scores = [0.0] * 259 + [-float(i) for i in range(len(normal))]
    return {"tokens": tokens, "token_types": types, "scores": scores, "bos_id": 1, "eos_id": 2,
            "unk_id": 0}


def _write_tokenizer_gguf(path: str, arch: str, model: str, spec: dict, add_fields) -> None:
    """Write a tokenizer-only GGUF (architecture arch, tokenizer model, no tensors): a minimal
    hyperparameter set, spec's tokens, token types and bos / eos ids, and what add_fields(writer)
    adds."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tokenizer_model(model)
    w.add_token_list(spec["tokens"])
    w.add_token_types(spec["token_types"])
    add_fields(w)
    w.add_bos_token_id(spec["bos_id"])
    w.add_eos_token_id(spec["eos_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_spm_gguf(path: str, spec: dict) -> None:
    """Write a tokenizer-only GGUF (architecture llama, no tensors) from `tiny_spm_spec`."""
    def add_fields(w):
        w.add_token_scores(spec["scores"])
        w.add_unk_token_id(spec["unk_id"])

    _write_tokenizer_gguf(path, "llama", "llama", spec, add_fields)


def _char_byte(c: str) -> int:
    """The byte a GPT-2 byte-level character stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    bs += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[c]


def write_tiny_gguf(path: str, spec: dict) -> None:
    """Write a tokenizer-only GGUF (architecture qwen2, no tensors) from `tiny_qwen2_spec`."""
    def add_fields(w):
        w.add_tokenizer_pre(spec["pre"])
        w.add_token_merges(spec["merges"])

    _write_tokenizer_gguf(path, "qwen2", "gpt2", spec, add_fields)


def gemma_main(model: str, out_path: str) -> int:
    """Write the Gemma 3 golden file with llama.cpp (llama-cpp-python) as the reference."""
    import llama_cpp

    model = os.path.abspath(model)
    if not os.path.isfile(model):
        print(f"error: model not found: {model} (scripts/fetch_model.py gemma3-270m fetches it)",
              file=sys.stderr)
        return 2
    with open(model, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    cases = []
    for text in TEXTS + GEMMA_TEXTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        decoded = llm.detokenize(ids, special=True).decode("utf-8")   # strict: must be valid
        cases.append({"text": text, "ids": ids, "decoded": decoded})
    spec = tiny_spm_spec()
    with tempfile.TemporaryDirectory() as d:
        write_tiny_spm_gguf(os.path.join(d, "tiny_spm.gguf"), spec)
        tiny = llama_cpp.Llama(os.path.join(d, "tiny_spm.gguf"), vocab_only=True, verbose=False)
        spec["cases"] = [{"text": t, "ids": tiny.tokenize(t.encode("utf-8"), add_bos=False, special=True)}
                         for t in TINY_SPM_TEXTS]
        del tiny
    out = {
        "reference": f"llama.cpp via llama-cpp-python {llama_cpp.__version__} (vocab_only): "
                     f"tokenize(text, add_bos=False, special=True), detokenize(ids, special=True)",
        "model": os.path.basename(model),
        "model_sha256": sha,
        "cases": cases,
        "tiny_spm": spec,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=f"GGUF file (default: {DEFAULT_MODEL}; "
                                                  f"with --gemma {GEMMA_MODEL})")
    ap.add_argument("--out", default=None, help=f"output JSON (default: {DEFAULT_OUT}; with --gemma "
                                                f"{GEMMA_OUT})")
    ap.add_argument("--gemma", action="store_true",
                    help="write the Gemma 3 golden file, with llama.cpp as the reference")
    args = ap.parse_args(argv)
    if args.gemma:
        return gemma_main(args.model or GEMMA_MODEL, args.out or GEMMA_OUT)
    args.model = args.model or DEFAULT_MODEL
    args.out = args.out or DEFAULT_OUT

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    model = os.path.abspath(args.model)
    if not os.path.isfile(model):
        print(f"error: model not found: {model}", file=sys.stderr)
        return 2
    with open(model, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    # transformers wants a directory plus a file name; link the file into a scratch directory.
    with tempfile.TemporaryDirectory() as d:
        name = "model.gguf"
        os.symlink(model, os.path.join(d, name))
        ref = AutoTokenizer.from_pretrained(d, gguf_file=name)

    spec = tiny_qwen2_spec()
    with tempfile.TemporaryDirectory() as d:
        write_tiny_gguf(os.path.join(d, "tiny.gguf"), spec)
        tiny_ref = AutoTokenizer.from_pretrained(d, gguf_file="tiny.gguf")
    spec["cases"] = [{"text": t, "ids": tiny_ref.encode(t, add_special_tokens=False)} for t in TINY_TEXTS]

    cases = []
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": ids,
                      "decoded": ref.decode(ids, skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)})
    out = {
        "reference": f"transformers {transformers.__version__} GGUF tokenizer converter "
                     f"(tokenizers {tokenizers.__version__}), encode(text, add_special_tokens=False)",
        "model": os.path.basename(model),
        "model_sha256": sha,
        "cases": cases,
        "tiny_qwen2": spec,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
