"""The verifier's vision side: the projector loaded beside the model and checked against it, and
the multimodal RoPE positions of a prompt holding images (Qwen3-VL's rule, transformers'
``get_rope_index``).

Positions: a text token takes (p, p, p), p one more than the largest position before it; an image
of gh x gw merged tokens starting where the next text token would (s) gives its token at row r,
column c the position (s, s + r, s + c) (one temporal frame); the text after it continues from
s + max(gh, gw). So after an image the rotary position runs behind the KV position by
n - max(gh, gw) (``position_lag``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from echospec.services.verifier.engine import EngineError, ModelInfo, Vision

# text architectures whose decoder takes image embeddings (deepstack, multimodal RoPE)
VISION_ARCHS = ("qwen3vl", "qwen3vlmoe")


class ProjectorMismatch(ValueError):
    """A projector that does not fit the served model (the message says how)."""


def load_vision(path: str, model: ModelInfo) -> Vision:
    """Load the projector and check that it fits the model.

    Raises:
        ProjectorMismatch: the file cannot be read as a projector ("--mmproj PATH: not a usable
            vision projector: " and the engine's status and message: a missing file, a
            directory, a GGUF of another kind), the model is not a Qwen3-VL text decoder, the
            projector's output width is not the model's hidden size, or it has more deepstack
            outputs than the model has deepstack layers.
    """
    if model.arch not in VISION_ARCHS:
        raise ProjectorMismatch(f"--mmproj {path}: the model's architecture {model.arch!r} takes no "
                                f"image embeddings (a projector goes with {', '.join(VISION_ARCHS)})")
    try:
        v = Vision(path)
    except EngineError as exc:   # named as the projector, not as a GGUF the reader met
        raise ProjectorMismatch(f"--mmproj {path}: not a usable vision projector: {exc}") from None
    try:
        info = v.info
        if info.n_embd != model.n_embd:
            raise ProjectorMismatch(f"--mmproj {path}: the projector's output width {info.n_embd} is "
                                    f"not the model's hidden size {model.n_embd}: it belongs to "
                                    f"another model")
        if info.n_deepstack > model.n_deepstack:
            raise ProjectorMismatch(f"--mmproj {path}: the projector has {info.n_deepstack} "
                                    f"deepstack outputs, the model {model.n_deepstack} deepstack "
                                    f"layers: it belongs to another model")
    except BaseException:
        v.close()
        raise
    return v


def rope_positions(spans: Sequence[tuple[int, int, int]], n_tokens: int, start: int = 0) -> np.ndarray:
    """The (t, h, w) positions of a prompt's tokens.

    Args:
        spans: (offset, gh, gw) per image, in prompt order: gh * gw image tokens from ``offset``.
        n_tokens: the prompt's length.
        start: the position of the prompt's first token.
    Returns:
        int32 [n_tokens, 3].
    """
    out = np.empty((n_tokens, 3), dtype=np.int32)
    nxt, i = start, 0
    for off, gh, gw in spans:
        if off < i or off + gh * gw > n_tokens:
            raise ValueError(f"image span ({off}, {gh}, {gw}) out of order or past the prompt")
        m = off - i
        out[i:off] = (nxt + np.arange(m, dtype=np.int32))[:, None]
        nxt += m
        rows, cols = np.divmod(np.arange(gh * gw, dtype=np.int32), gw)
        out[off:off + gh * gw, 0] = nxt
        out[off:off + gh * gw, 1] = nxt + rows
        out[off:off + gh * gw, 2] = nxt + cols
        nxt += max(gh, gw)
        i = off + gh * gw
    out[i:] = (nxt + np.arange(n_tokens - i, dtype=np.int32))[:, None]
    return out
