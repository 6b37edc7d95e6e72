"""Write the seed corpus of fuzz_gguf: small valid GGUF files like the test files.

Tiny llama / qwen2 / qwen3 models (tests/test_gguf_malformed.write_model, a few tensor types)
and a tokenizer-only file; each is a few KiB to a few tens of KiB, so libFuzzer's default
max_len (the largest seed) stays small.

    python engine_c/fuzz/make_seeds.py OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_gguf_malformed import write_model  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for arch, mtype in (("llama", QT.Q4_0), ("qwen2", QT.F16), ("qwen3", QT.Q8_0), ("llama", QT.Q4_1)):
        write_model(out / f"{arch}-{mtype.name}.gguf", arch, mtype, 32 if arch == "qwen3" else None)
    w = gguf.GGUFWriter(str(out / "tokenizer-only.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    w.add_custom_alignment(64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
