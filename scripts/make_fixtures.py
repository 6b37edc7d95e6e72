"""Build the tiny qwen3moe / qwen3vl / qwen3vlmoe / gemma3 test fixtures the way real GGUF files are made.

What it does, per fixture:
  1. a tiny random model from transformers (Qwen3MoeForCausalLM, Qwen3VLForConditionalGeneration,
     Qwen3VLMoeForConditionalGeneration, Gemma3ForCausalLM) with SmolLM2's tokenizer, saved with
     save_pretrained (llama.cpp's Gemma 3 converter takes a tokenizer.json when there is no
     SentencePiece tokenizer.model);
  2. llama.cpp's converter (convert_hf_to_gguf.py) writes an F16 GGUF (and, for the VL models, the
     vision projector with --mmproj);
  3. llama.cpp's quantizer (llama_cpp.llama_model_quantize) writes the kept files (Q8_0; Q4_K_M too
     for qwen3moe);
  4. reference logits: the quantized file's tensors, dequantized with the gguf package, are loaded
     into the transformers model, which runs the prompts in float32; llama.cpp's logits for the same
     prompts come from llama_cpp.Llama. Both are saved (compactly) beside the GGUF.
  5. vision references (qwen3vl): the kept projector's tensors (qwen3vl-mmproj-F16.gguf in --out,
     dequantized) are loaded into transformers' vision tower, which encodes a generated test image
     (preprocessed by transformers' Qwen2-VL image processor) in float32: the merger output and
     each deepstack output go to qwen3vl-mmproj-F16.ref.npz, with the whole model's logits (text
     weights of the kept qwen3vl-Q8_0.gguf) for a chat turn holding the image. --vision-refs-only
     redoes just this step from the committed files (no tokenizer, converter or llama_cpp needed).
Kept in --out: qwen3moe-Q4_K_M, qwen3vl-Q8_0, qwen3vlmoe-Q8_0, gemma3-Q8_0 (+ .ref.npz each),
qwen3vl-mmproj-F16;
the rest (F16 files, qwen3moe-Q8_0, qwen3vlmoe's projector, summary.json) stays in --work.

Needs (none of it is a dependency of the project):
  - a Python with torch (CPU), transformers 5.x, gguf, safetensors, numpy       (--python: this one)
  - llama.cpp's converter: the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp  (--llama-src)
  - a Python where llama_cpp (llama-cpp-python 0.3.36) imports                  (--llama-python)
  - the tokenizer source: SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch_model.py) (--tokenizer-gguf)

Command (from the repository root):
  nice <torch-venv>/bin/python scripts/make_fixtures.py \
      --llama-src <llama_cpp_python-0.3.36 sdist>/vendor/llama.cpp \
      --llama-python <venv with llama_cpp>/bin/python \
      --tokenizer-gguf ~/.cache/echospec/SmolLM2-135M-Instruct.Q4_1.gguf \
      --work /tmp/echospec-fixtures --out tests/data/models

Everything is seeded; torch's CPU kernels are deterministic here, so a rerun with the same tool
versions writes the same files (llama.cpp's quantizer is deterministic too).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoTokenizer

# Prompts (token ids of SmolLM2's tokenizer). The second repeats its content (an n-gram drafter's case).
PROMPT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "one two three four, one two three four, one two three four",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
TOPK = 32            # top ids / values kept per position
N_SUBSET = 512       # logits at these (fixed, random) vocab ids kept for every position
# A prompt longer than gemma3's sliding window (16 here): its last positions attend only part of it.
LONG_TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who told "
             "stories to the children every evening, and they listened until the stars came out over the "
             "dark water.")
# The image preprocessor's settings, as Qwen3-VL ships them (patch sizes added per model).
PREPROCESSOR = dict(size={"longest_edge": 16777216, "shortest_edge": 65536}, image_mean=[0.5, 0.5, 0.5],
                    image_std=[0.5, 0.5, 0.5], processor_class="Qwen3VLProcessor",
                    image_processor_type="Qwen2VLImageProcessorFast")
VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def fixtures() -> dict[str, dict]:
    """name -> how to build it. Shapes follow the real models' proportions where the size budget allows."""
    moe_text = dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=512,                # unused: every layer is sparse (mlp_only_layers = [])
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=4096,
        initializer_range=0.2,
    )
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
        deepstack_visual_indexes=[0], initializer_range=0.1,
    )
    vl_text = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.25,
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[12, 10, 10],
                             mrope_interleaved=True),
    )
    return {
        "qwen3moe": dict(
            cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
            kwargs=dict(**moe_text, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
            quant=["Q8_0", "Q4_K_M"], keep_quant=["Q4_K_M"], extra_tokens=[]),
        "qwen3vl": dict(
            cls="Qwen3VLForConditionalGeneration", config="Qwen3VLConfig",
            kwargs=dict(text_config=dict(vl_text), vision_config=dict(vision, out_hidden_size=64),
                        tie_word_embeddings=True),
            quant=["Q8_0"], keep_quant=["Q8_0"], extra_tokens=VL_TOKENS),
        "qwen3vlmoe": dict(
            cls="Qwen3VLMoeForConditionalGeneration", config="Qwen3VLMoeConfig",
            kwargs=dict(text_config=dict(vl_text, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                                         tie_word_embeddings=True),
                        vision_config=dict(vision, out_hidden_size=64), tie_word_embeddings=True),
            quant=["Q8_0"], keep_quant=["Q8_0"], extra_tokens=VL_TOKENS),
        # Gemma 3's layout (270M: 18 layers, 4 / 1 heads of 256, window 512, every 6th layer global)
        # scaled down: 6 layers (the default pattern: 0-4 local, 5 global, as llama.cpp reads a file
        # without the pattern key), window 16, local RoPE base 10000 and global 1e6 (the defaults).
        # query_pre_attn_scalar = head_dim: llama.cpp scales by 1 / sqrt(head_dim) (all but 27B).
        "gemma3": dict(
            cls="Gemma3ForCausalLM", config="Gemma3TextConfig",
            kwargs=dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=64, intermediate_size=512, sliding_window=16, query_pre_attn_scalar=64,
                        rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.1,
                        tie_word_embeddings=True),
            quant=["Q8_0"], keep_quant=["Q8_0"], extra_tokens=[], gemma=True),
    }


# ---- building ---------------------------------------------------------------

def build_hf(name: str, spec: dict, tok_gguf: Path, out: Path, seed: int) -> None:
    """Tokenizer + random model, saved to `out` (a Hugging Face model directory)."""
    tok = AutoTokenizer.from_pretrained(str(tok_gguf.parent), gguf_file=tok_gguf.name)
    if spec["extra_tokens"]:
        tok.add_special_tokens({"additional_special_tokens": spec["extra_tokens"]})
    n_tok = len(tok)
    vocab = (n_tok + 63) // 64 * 64   # padded like the real Qwen vocabularies (151669 tokens, 151936 rows)
    kwargs = json.loads(json.dumps(spec["kwargs"]))
    ids = {t: tok.convert_tokens_to_ids(t) for t in spec["extra_tokens"]}
    if "text_config" in kwargs:
        kwargs["text_config"]["vocab_size"] = vocab
        kwargs["text_config"].update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)
        kwargs.update(vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                      image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    else:
        kwargs.update(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    config = getattr(transformers, spec["config"])(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"])(config).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for pname, p in model.named_parameters():
            # RMSNorm weights start at 1: make them differ so that a missing or misplaced norm shows.
            # (Gemma's norms scale by 1 + w, w starting at 0.)
            if pname.endswith("norm.weight") and p.ndim == 1 and "visual" not in pname:
                p.copy_((0.0 if spec.get("gemma") else 1.0) + 0.25 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    if spec["config"] == "Qwen3VLMoeConfig":
        hub_layout_experts(out)
    tok.save_pretrained(str(out))
    if "vision_config" in kwargs:
        # The image preprocessor's settings, as Qwen3-VL ships them (the --mmproj conversion reads them).
        v = kwargs["vision_config"]
        pre = dict(PREPROCESSOR, patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                   merge_size=v["spatial_merge_size"])
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")


def hub_layout_experts(out: Path) -> None:
    """Rewrite Qwen3-VL-MoE's packed experts in the layout of the published checkpoints.

    transformers 5.23 keeps (and saves) gate_up_proj as [E, 2F, H] and down_proj as [E, H, F]; the
    published Qwen3-VL-MoE checkpoints (and llama.cpp's converter, which assumes them) have
    gate_up_proj [E, H, 2F] and down_proj [E, F, H]. transformers loads either (it transposes when the
    shapes say so)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"expected one safetensors file in {out}, found {len(files)}")
    with safe_open(str(files[0]), "pt") as f:
        meta = f.metadata()
        ts = {k: f.get_tensor(k) for k in f.keys()}
    for k in ts:
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            ts[k] = ts[k].transpose(1, 2).contiguous()
    save_file(ts, str(files[0]), metadata=meta)


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def convert(llama_src: Path, hf_dir: Path, outfile: Path, mmproj: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=str(llama_src / "gguf-py"))
    cmd = [sys.executable, llama_src / "convert_hf_to_gguf.py", hf_dir, "--outfile", outfile, "--outtype", "f16"]
    if mmproj:
        cmd.append("--mmproj")
    run(cmd, env=env)


QUANTIZE = """
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""

LLAMA_LOGITS = """
import json, sys, numpy as np, llama_cpp
path, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=256, n_threads=2, logits_all=True, verbose=False)
res = {}
for i, toks in enumerate(prompts):
    llm.reset()
    llm.eval(toks)
    res[f"p{i}"] = np.array(llm.scores[:len(toks)], dtype=np.float32)
np.savez(out, **res)
"""


def quantize(llama_python: str, src: Path, dst: Path, ftype: str) -> None:
    run([llama_python, "-c", QUANTIZE, src, dst, ftype])


def llama_logits(llama_python: str, path: Path, prompts: list[list[int]], out: Path) -> list[np.ndarray]:
    run([llama_python, "-c", LLAMA_LOGITS, path, json.dumps(prompts), out])
    z = np.load(out)
    return [z[f"p{i}"] for i in range(len(prompts))]


# ---- loading a GGUF's dequantized weights into the transformers model -------------------------

def gguf_tensors(path: Path) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (dequantized float32 array in numpy order (reversed ggml ne), type name)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(s) for s in reversed(t.shape)]
        out[t.name] = (a.reshape(shape), t.tensor_type.name)
    return out


def param_setter(sd: dict, done: set):
    """put(name, array): copy a GGUF array into the named parameter of ``sd`` (a shape mismatch
    raises, naming it) and record the name in ``done``."""
    def put(hf: str, arr: np.ndarray) -> None:
        p = sd[hf]
        if tuple(p.shape) != arr.shape:
            raise ValueError(f"{hf}: shape {tuple(p.shape)} vs GGUF {arr.shape}")
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(arr)))
        done.add(hf)
    return put


def load_into_hf(model, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Overwrite the text decoder's parameters with the GGUF's (dequantized) weights.

    Raises if a text-decoder parameter has no GGUF tensor or a shape differs: the mapping below is
    the inverse of the converter's, so this doubles as a check of what it wrote."""
    sd = dict(model.named_parameters())
    lm = "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."
    want = {k for k in sd if k.startswith(lm) or k == "lm_head.weight"}
    done = set()

    put = param_setter(sd, done)

    g = lambda n: tensors[n][0]  # noqa: E731
    gemma = model.config.model_type.startswith("gemma")
    # the converter stores Gemma's (1 + w) norm weights with the 1 added
    gn_ = (lambda n: g(n) - np.float32(1.0)) if gemma else g
    put(lm + "embed_tokens.weight", g("token_embd.weight"))
    put(lm + "norm.weight", gn_("output_norm.weight"))
    if "lm_head.weight" in want:
        if "output.weight" in tensors:
            put("lm_head.weight", g("output.weight"))
        elif model.lm_head.weight.data_ptr() == sd[lm + "embed_tokens.weight"].data_ptr():
            done.add("lm_head.weight")      # tied: the same storage
        else:
            raise ValueError("no output.weight and lm_head is not tied")
    n_layer = model.config.get_text_config().num_hidden_layers
    for i in range(n_layer):
        b, L = f"blk.{i}.", f"{lm}layers.{i}."
        if gemma:
            for gname, hn in [("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                              ("ffn_norm", "pre_feedforward_layernorm"),
                              ("post_ffw_norm", "post_feedforward_layernorm"),
                              ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]:
                put(L + hn + ".weight", gn_(b + gname + ".weight"))
            for gname, hn in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                              ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                              ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                              ("ffn_down", "mlp.down_proj")]:
                put(L + hn + ".weight", g(b + gname + ".weight"))
            continue
        for gn, hn in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                       ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                       ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                       ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]:
            put(L + hn + ".weight", g(b + gn + ".weight"))
        if b + "ffn_gate_inp.weight" in tensors:
            put(L + "mlp.gate.weight", g(b + "ffn_gate_inp.weight"))
            gate, up = g(b + "ffn_gate_exps.weight"), g(b + "ffn_up_exps.weight")   # [E, F, H]
            put(L + "mlp.experts.gate_up_proj", np.concatenate([gate, up], axis=1))
            put(L + "mlp.experts.down_proj", g(b + "ffn_down_exps.weight"))            # [E, H, F]
        else:
            for gn, hn in [("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")]:
                put(L + "mlp." + hn + ".weight", g(b + gn + ".weight"))
    missing = want - done
    if missing:
        raise ValueError(f"parameters not found in the GGUF: {sorted(missing)}")


def hf_logits(model, prompts: list[list[int]]) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for toks in prompts:
            ids = torch.tensor([toks])
            out.append(model(input_ids=ids).logits[0].float().numpy())
    return out


def mrope_check(model, name: str) -> dict[str, np.ndarray]:
    """transformers' rotary cos/sin for text positions (t = h = w) and for distinct (t, h, w)."""
    tm = model.model.language_model
    rot = tm.rotary_emb
    n = 12
    pos = torch.arange(n)
    same = pos[None, None, :].expand(3, 1, n)
    rng = np.random.default_rng(5)
    thw = torch.from_numpy(rng.integers(0, 40, size=(3, 1, n)))
    x = torch.zeros(1, n, 8)
    cos_s, sin_s = rot(x, same)
    cos_d, sin_d = rot(x, thw)
    # plain NEOX RoPE of the same base and head_dim
    cfg = model.config.get_text_config()
    hd = cfg.head_dim
    base = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None, :]
    plain = torch.cat([ang, ang], dim=-1)
    diff = float((cos_s[0].double() - plain.cos()).abs().max().item())
    print(f"{name}: max |cos(mrope t=h=w) - cos(NEOX RoPE)| = {diff:.2e}")
    return dict(rope_thw=thw[:, 0, :].numpy().astype(np.int64), rope_cos_thw=cos_d[0].numpy(),
                rope_sin_thw=sin_d[0].numpy(), rope_cos_text=cos_s[0].numpy(),
                rope_text_vs_neox_max=np.float64(diff))


# ---- vision references (the projector GGUF loaded into transformers' vision tower) ----------

VISION_IMAGE_HW = (224, 320)    # both multiples of 32 and >= the processor's min_pixels: no resize


def test_image(h: int, w: int) -> np.ndarray:
    """A deterministic RGB image [h, w, 3] uint8: smooth gradients, a few stripes and seeded noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 128 + 100 * np.sin(x / 23.0) * np.cos(y / 31.0)
    g = 255 * (x + y) / (h + w)
    b = 128 + 120 * np.sign(np.sin(x / 9.0 + y / 13.0))
    img = np.stack([r, g, b], axis=-1) + np.random.default_rng(7).normal(0, 12, size=(h, w, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def load_vision_into_hf(visual, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Overwrite every parameter of transformers' Qwen3-VL vision tower with the projector GGUF's.

    The inverse of the converter's mapping; raises on a missing parameter or a shape mismatch."""
    sd = dict(visual.named_parameters())
    done = set()

    put = param_setter(sd, done)

    g = lambda n: tensors[n][0]  # noqa: E731
    # conv3d kernel [out, in, t, ph, pw]: the converter splits the temporal axis into two tensors
    put("patch_embed.proj.weight", np.stack([g("v.patch_embd.weight"), g("v.patch_embd.weight.1")], axis=2))
    put("patch_embed.proj.bias", g("v.patch_embd.bias"))
    put("pos_embed.weight", g("v.position_embd.weight"))
    for i in range(len(visual.blocks)):
        b, L = f"v.blk.{i}.", f"blocks.{i}."
        for gn, hn in [("ln1", "norm1"), ("ln2", "norm2"), ("attn_qkv", "attn.qkv"), ("attn_out", "attn.proj"),
                       ("ffn_up", "mlp.linear_fc1"), ("ffn_down", "mlp.linear_fc2")]:
            put(L + hn + ".weight", g(b + gn + ".weight"))
            put(L + hn + ".bias", g(b + gn + ".bias"))
    for gn, hn in [("v.post_ln", "merger.norm"), ("mm.0", "merger.linear_fc1"), ("mm.2", "merger.linear_fc2")]:
        put(hn + ".weight", g(gn + ".weight"))
        put(hn + ".bias", g(gn + ".bias"))
    for k, layer in enumerate(visual.deepstack_visual_indexes):
        for gn, hn in [("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")]:
            for wb in ("weight", "bias"):
                put(f"deepstack_merger_list.{k}.{hn}.{wb}", g(f"v.deepstack.{layer}.{gn}.{wb}"))
    missing = set(sd) - done
    if missing:
        raise ValueError(f"vision parameters not found in the projector GGUF: {sorted(missing)}")


# A chat turn around the image (SmolLM2 token ids of "<|im_start|>user\n" ... "What is the capital of
# France?<|im_end|>\n<|im_start|>assistant\n"); the image's tokens go after the first three.
VL_PROMPT_TOKENS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
VL_SPECIAL_IDS = dict(vision_start_token_id=49152, vision_end_token_id=49153, image_token_id=49154,
                      video_token_id=49155)    # as build_hf assigns them (tests/data/models/README.md)


def vision_refs(spec: dict, mmproj: Path, out: Path, text_gguf: Path | None = None) -> None:
    """Encode the test image with transformers on the projector file's weights; save the references.

    With text_gguf (the kept qwen3vl-Q8_0.gguf): also the whole model's logits for a prompt holding
    the image, on that file's (dequantized) text weights."""
    kwargs = json.loads(json.dumps(spec["kwargs"]))
    kwargs["text_config"]["vocab_size"] = 49216
    cfg = getattr(transformers, spec["config"])(**kwargs, **VL_SPECIAL_IDS)
    vcfg = cfg.vision_config
    full = getattr(transformers, spec["cls"])(cfg).eval() if text_gguf else None
    visual = full.model.visual if full is not None else \
        transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel._from_config(vcfg, dtype=torch.float32).eval()
    load_vision_into_hf(visual, gguf_tensors(mmproj))
    h, w = VISION_IMAGE_HW
    img = test_image(h, w)
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    pre = json.loads(json.dumps(PREPROCESSOR))
    pre.update(patch_size=vcfg.patch_size, temporal_patch_size=vcfg.temporal_patch_size,
               merge_size=vcfg.spatial_merge_size)
    for k in ("processor_class", "image_processor_type"):
        pre.pop(k)
    proc = Qwen2VLImageProcessorPil(**pre)
    enc = proc(images=[Image.fromarray(img)], return_tensors="pt")
    pixel_values, grid = enc["pixel_values"].float(), enc["image_grid_thw"]
    if grid.tolist() != [[1, h // vcfg.patch_size, w // vcfg.patch_size]]:
        raise RuntimeError(f"the processor resized the test image: grid {grid.tolist()}")
    with torch.no_grad():
        o = visual(pixel_values, grid_thw=grid)
    embd = o.pooler_output.float().numpy()
    ds = np.stack([d.float().numpy() for d in o.deepstack_features])
    print(f"vision: grid {grid.tolist()}, embeddings {embd.shape} (std {embd.std():.3f}), deepstack {ds.shape}")
    extra = {}
    if full is not None:
        load_into_hf(full, gguf_tensors(text_gguf))
        n_img = embd.shape[0]
        ids = (VL_PROMPT_TOKENS[:3] + [VL_SPECIAL_IDS["vision_start_token_id"]] +
               [VL_SPECIAL_IDS["image_token_id"]] * n_img + [VL_SPECIAL_IDS["vision_end_token_id"]] +
               VL_PROMPT_TOKENS[3:])
        input_ids = torch.tensor([ids])
        mm_types = (input_ids == VL_SPECIAL_IDS["image_token_id"]).int()     # text 0, image 1
        with torch.no_grad():
            pos, _ = full.model.get_rope_index(input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
            logits = full(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid,
                          mm_token_type_ids=mm_types).logits[0].float().numpy()
        subset = np.sort(np.random.default_rng(11).choice(logits.shape[-1], N_SUBSET, replace=False))
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOPK]
        print(f"vision prompt: {len(ids)} tokens, logit std {logits.std():.3f}, last argmax {int(logits[-1].argmax())}")
        extra = dict(vl_tokens=np.array(ids, dtype=np.int32), vl_pos_thw=pos[:, 0, :].numpy().T.astype(np.int32),
                     vl_last_logits=logits[-1].astype(np.float32), vl_subset=subset.astype(np.int32),
                     vl_subset_logits=logits[:, subset].astype(np.float32), vl_top_ids=top.astype(np.int32),
                     vl_top_logits=np.take_along_axis(logits, top, axis=-1).astype(np.float32))
    np.savez_compressed(out, image=img, pixel_values=pixel_values.numpy().astype(np.float32),
                        image_grid_thw=grid.numpy().astype(np.int64), embeddings=embd.astype(np.float32),
                        deepstack=ds.astype(np.float32),
                        deepstack_layers=np.array(vcfg.deepstack_visual_indexes, dtype=np.int32), **extra)


# ---- main -------------------------------------------------------------------

def describe(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    types: dict[str, int] = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return dict(size=path.stat().st_size, types=types,
                tensors={t.name: [t.tensor_type.name, [int(s) for s in t.shape]] for t in r.tensors})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", type=Path)
    ap.add_argument("--llama-python")
    ap.add_argument("--tokenizer-gguf", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--out", type=Path, default=Path("tests/data/models"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vision-refs-only", action="store_true",
                    help="only (re)write qwen3vl-mmproj-F16.ref.npz from the projector in --out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    vl_spec = fixtures()["qwen3vl"]
    mmproj_kept = a.out / "qwen3vl-mmproj-F16.gguf"
    if a.vision_refs_only:
        vision_refs(vl_spec, mmproj_kept, a.out / "qwen3vl-mmproj-F16.ref.npz", a.out / "qwen3vl-Q8_0.gguf")
        return
    for opt in ("llama_src", "llama_python", "tokenizer_gguf", "work"):
        if getattr(a, opt) is None:
            ap.error(f"--{opt.replace('_', '-')} is required (unless --vision-refs-only)")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(a.tokenizer_gguf.parent), gguf_file=a.tokenizer_gguf.name)
    base_prompts = [tok.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS]
    summary = {}
    for name, spec in fixtures().items():
        if a.only and name not in a.only:
            continue
        prompts = base_prompts + ([tok.encode(LONG_TEXT, add_special_tokens=False)] if spec.get("gemma") else [])
        hf_dir = a.work / name / "hf"
        build_hf(name, spec, a.tokenizer_gguf.expanduser(), hf_dir, a.seed)
        f16 = a.work / name / f"{name}-F16.gguf"
        convert(a.llama_src, hf_dir, f16)
        if name.startswith("qwen3vl"):
            mm = a.work / name / f"{name}-mmproj-F16.gguf"
            convert(a.llama_src, hf_dir, mm, mmproj=True)
            if name == "qwen3vl":    # one projector is kept (size); qwen3vlmoe's is made the same way
                (a.out / mm.name).write_bytes(mm.read_bytes())
                mm_kept = a.out / mm.name
        model = getattr(transformers, spec["cls"]).from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        # The converter's F16 file against the saved model: every text parameter mapped, F16 rounding apart.
        orig = {k: v.detach().clone() for k, v in model.named_parameters()}
        load_into_hf(model, gguf_tensors(f16))
        conv_err = max(float((orig[k] - v).abs().max()) for k, v in model.named_parameters())
        print(f"{name}: max |F16 GGUF - original parameter| = {conv_err:.2e}")
        extra = mrope_check(model, name) if name.startswith("qwen3vl") else {}
        n_vocab = model.config.get_text_config().vocab_size
        subset = np.sort(np.random.default_rng(11).choice(n_vocab, N_SUBSET, replace=False))
        for q in spec["quant"]:
            qpath = a.work / name / f"{name}-{q}.gguf"
            quantize(a.llama_python, f16, qpath, q)
            load_into_hf(model, gguf_tensors(qpath))
            ref = hf_logits(model, prompts)
            lcp = llama_logits(a.llama_python, qpath, prompts, a.work / name / f"llama-{q}.npz")
            d_all = [float(np.abs(r - l).max()) for r, l in zip(ref, lcp)]
            am = [int((r.argmax(-1) == l.argmax(-1)).sum()) for r, l in zip(ref, lcp)]
            std = float(np.concatenate(ref).std())
            srt = np.sort(np.concatenate(ref), axis=-1)
            margins = srt[:, -1] - srt[:, -2]
            print(f"{name} {q}: logit std {std:.3f}; max |transformers - llama.cpp| per prompt {d_all}; "
                  f"argmax equal {am} of {[len(p) for p in prompts]}; top-2 margin min {margins.min():.4f}")
            summary[f"{name}-{q}"] = dict(logit_std=std, max_abs_tf_llama=d_all, argmax_equal=am,
                                          n_positions=[len(p) for p in prompts],
                                          min_top2_margin=float(margins.min()),
                                          f16_conversion_err=conv_err, **describe(qpath))
            if q not in spec["keep_quant"]:
                continue
            (a.out / qpath.name).write_bytes(qpath.read_bytes())
            save = dict(subset=subset.astype(np.int32), **extra)
            for i, (toks, r, l) in enumerate(zip(prompts, ref, lcp)):
                top = np.argsort(-r, axis=-1, kind="stable")[:, :TOPK]
                save[f"p{i}_tokens"] = np.array(toks, dtype=np.int32)
                save[f"p{i}_top_ids"] = top.astype(np.int32)
                save[f"p{i}_top_logits"] = np.take_along_axis(r, top, axis=-1).astype(np.float32)
                save[f"p{i}_subset_logits"] = r[:, subset].astype(np.float32)
                if i == 0:   # one full row (the rest: top ids and the subset)
                    save[f"p{i}_last_logits"] = r[-1].astype(np.float32)
                save[f"p{i}_llama_top_logits"] = np.take_along_axis(l, top, axis=-1).astype(np.float32)
                save[f"p{i}_llama_subset_logits"] = l[:, subset].astype(np.float32)
                save[f"p{i}_llama_argmax"] = l.argmax(-1).astype(np.int32)
                save[f"p{i}_max_abs_tf_llama"] = np.float32(d_all[i])
            np.savez_compressed(a.out / f"{name}-{q}.ref.npz", **save)
            if name == "qwen3vl":    # after the kept text model: the image prompt runs on its weights
                vision_refs(spec, mm_kept, a.out / "qwen3vl-mmproj-F16.ref.npz", a.out / qpath.name)
    (a.work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tensors"} for k, v in summary.items()},
                     indent=1))


if __name__ == "__main__":
    main()
