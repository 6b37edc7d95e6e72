"""Generate tests/data/tokenizer_golden.json: reference token ids for a varied text set.

The reference is transformers' GGUF tokenizer converter
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), which reproduces llama.cpp's tokenization.
transformers (and torch, which its GGUF module imports) are needed only to run this script; they
are not runtime or test dependencies. Install them into a scratch environment or temporarily:

    pip install transformers torch==2.13.0
    python scripts/gen_tokenizer_golden.py [--model PATH] [--out tests/data/tokenizer_golden.json]

The output holds, for every text: the text, the reference ids (no special tokens added; special
token text parsed as special tokens) and the reference decode of those ids.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file (default: %(default)s)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output JSON (default: %(default)s)")
    args = ap.parse_args(argv)

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
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
