"""A generation whose prompt holds images (GenerateTokensRequest.images).

The verifier encodes each image with the projector (vision.py), replaces the image's prompt tokens
by its embeddings, gives them the image grid's (t, h, w) positions (vision.rope_positions) and
prefills the whole prompt in one engine call (es_forward_embd, deepstack outputs added at the image
rows). The engine's decode steps, verifies and in-engine runs rotate each token by its KV position,
while after an image Qwen3-VL's position runs ``lag`` = KV position - rotary position behind it;
so this loop decodes one token per engine call with the position given (es_forward_positions),
under the engine lock, beside the scheduler's iterations.

What it does not do (each refused or switched off with a reason): speculation (the verify path
takes no explicit positions: the generation decodes plainly, and the first event's spec_reason
says so; the output is the same as with speculation off), grammar, repetition penalties, logprobs
and resumed generations (FAILED_PRECONDITION), KV eviction and sparse attention (refused). Prefix
reuse works through the prefix cache, keyed by the image's pixels (``image_keys``).
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np

from echospec.services.verifier.engine import TOKEN_EMBD, EngineError, sample
from echospec.services.verifier.generation_loop import FINISH_CONTEXT, GenerationRequest, RoundEvent
from echospec.services.verifier.sessions import FailedPrecondition, InvalidArgument, engine_error
from echospec.services.verifier.vision import rope_positions

SPEC_REASON = ("speculation is off for a prompt with images: the verify step takes no explicit "
               "multimodal positions yet; the generation decodes plainly (same output)")


def check_images(core: Any, req: GenerationRequest, images: Sequence[Any]) -> list[tuple[int, int, int]]:
    """Refuse an image request this verifier cannot run; the images' (offset, gh, gw) spans.

    Raises:
        FailedPrecondition: no projector loaded; grammar, penalties, logprobs or a resume.
        InvalidArgument: an image whose sizes, pixel bytes or offset do not fit the prompt.
    """
    if core.vision is None:
        raise FailedPrecondition("the verifier has no vision projector (--mmproj): it takes no images")
    if core.config.kv_window > 0 or core.config.sparse_attention:
        raise FailedPrecondition("a prompt with images needs full attention (no --kv-window, no "
                                 "--sparse-attention)")
    if req.grammar is not None or req.logprobs or req.sampling.penalties.active or req.resumed:
        raise FailedPrecondition("a prompt with images takes no grammar, repetition penalties, "
                                 "logprobs or resumed tokens yet")
    side = core.vision.info.side
    spans, end = [], 0
    for i, im in enumerate(images):
        h, w = int(im.height), int(im.width)
        if h <= 0 or w <= 0 or h % side or w % side:
            raise InvalidArgument(f"images[{i}]: {w}x{h} is not a positive multiple of {side} on each side")
        if len(im.pixels) != 3 * h * w * 4:
            raise InvalidArgument(f"images[{i}]: {len(im.pixels)} pixel bytes, want 3 x {h} x {w} float32 "
                                  f"({3 * h * w * 4} bytes)")
        gh, gw = h // side, w // side
        if im.offset < end or im.offset + gh * gw > len(req.prompt):
            raise InvalidArgument(f"images[{i}]: offset {im.offset} with {gh * gw} tokens overlaps the "
                                  f"previous image or runs past the prompt of {len(req.prompt)} tokens")
        spans.append((int(im.offset), gh, gw))
        end = im.offset + gh * gw
    return spans


def image_keys(prompt: Sequence[int], spans: Sequence[tuple[int, int, int]],
               images: Sequence[Any]) -> list[int]:
    """The prompt as the prefix cache keys it: each image's tokens replaced by a negative id
    made from the sha256 of its size and pixel bytes (computed here, not taken from the caller),
    so a session is reused only over the same images at the same places; text tokens as they
    are (a text prompt and an image prompt share what comes before the first image)."""
    keys = list(prompt)
    for (off, gh, gw), im in zip(spans, images):
        d = hashlib.sha256(f"{im.height}x{im.width}\n".encode() + im.pixels).digest()
        keys[off:off + gh * gw] = [-2 - int.from_bytes(d[:7], "big")] * (gh * gw)
    return keys


def run_image_generation(core: Any, req: GenerationRequest, images: Sequence[Any],
                         cancel: threading.Event) -> Iterator[RoundEvent]:
    """Run one generation of a prompt with images; yield a RoundEvent per engine step (the
    first: the prefill's, with the first token). ``check_images`` first.

    Prefix reuse: the prefix cache is keyed by ``image_keys``; a reused prefix never ends inside
    an image (it is cut back to the image's start), and only the images after it are encoded.
    The session goes back with the keys of its KV (prompt and output less the pending token).

    Raises:
        InvalidArgument, ResourceExhausted: engine refusals (as VerifierErrors).
    """
    spans = check_images(core, req, images)
    t0 = time.perf_counter()
    keys = image_keys(req.prompt, spans, images)
    session, cached = core.acquire(keys)
    for off, gh, gw in spans:
        if off < cached < off + gh * gw:
            cached = off
    released = False
    try:
        for ev, kv, last in _generate(core, req, images, spans, session, cached, keys, cancel, t0):
            if last:   # back to the prefix cache before the last event: a next turn finds it
                released = True
                core.release(session, kv, len(req.prompt))
            yield ev
    except EngineError as exc:
        raise engine_error(exc, "generation") from None
    finally:
        if not released:
            core.release(session, None)   # state unknown (failed or cancelled): freed


def _generate(core, req, images, spans, session, cached, keys, cancel, t0):
    vis = core.vision
    n = len(req.prompt)
    n_ctx = core.config.n_ctx
    toks = np.asarray(req.prompt, dtype=np.int32).copy()
    embds, dss = [], []
    pos = rope_positions(spans, n)
    with core.engine_lock:
        session.rollback(cached)
        for im, (off, gh, gw) in zip(images, spans):
            if off + gh * gw <= cached:
                continue              # in the reused prefix: its KV is there
            # value / 255 from the coordinator, normalised here with the projector's mean / std
            # (the same float32 operations as services/text/images.py's preprocess)
            px = np.frombuffer(im.pixels, dtype="<f4").reshape(3, im.height, im.width).astype(np.float32)
            px -= np.asarray(vis.info.image_mean, dtype=np.float32)[:, None, None]
            px /= np.asarray(vis.info.image_std, dtype=np.float32)[:, None, None]
            e, d = vis.encode(px, core.config.batch_threads)
            embds.append(e)
            dss.append(d)
            toks[off:off + gh * gw] = TOKEN_EMBD
        rest = toks[cached:]
        if embds:
            embd = np.concatenate(embds)
            ds = np.concatenate(dss, axis=1) if vis.info.n_deepstack else None
            _, row = session.forward_embd(rest, pos[cached:], embd, ds, logits="last")
        else:
            _, row = session.forward(rest, logits="last", positions=pos[cached:])
    kv = list(keys)
    nxt = int(pos.max()) + 1           # the rotary position of the token at KV position n
    lag = n - nxt
    rng = int(req.sampling.seed) & 0xFFFFFFFFFFFFFFFF
    s = req.sampling
    produced, first = 0, True
    while True:
        tok, rng = sample(row[0], s.temperature, s.top_k, s.top_p, s.min_p, rng)
        produced += 1
        v_ms = (time.perf_counter() - t0) * 1e3
        n_past = session.n_past
        done = tok in req.eos_ids or produced >= req.max_tokens
        full = not done and n_past + 1 > n_ctx
        yield (RoundEvent([tok], v_ms=v_ms, t_ms=core.t_ms, wall_ms=v_ms, n_past=n_past, n_ctx=n_ctx,
                          prefill=first, cached_prompt_tokens=cached if first else 0,
                          spec_reason=SPEC_REASON if first and req.spec else ""), kv, done)
        first = False
        if full:
            yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx, finish=FINISH_CONTEXT), kv, True
        if done or full or cancel.is_set():
            return
        t0 = time.perf_counter()
        p = n_past - lag
        with core.engine_lock:
            _, row = session.forward([tok], logits="last", positions=np.array([[p, p, p]]))
        kv = kv + [tok]
