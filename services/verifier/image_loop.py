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
and resumed generations (FAILED_PRECONDITION), prefix reuse (the session starts empty and is freed
at the end: its KV holds image rows the token ids do not describe).
"""
from __future__ import annotations

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


def run_image_generation(core: Any, req: GenerationRequest, images: Sequence[Any],
                         cancel: threading.Event) -> Iterator[RoundEvent]:
    """Run one generation of a prompt with images; yield a RoundEvent per engine step (the
    first: the prefill's, with the first token). ``check_images`` first.

    Raises:
        InvalidArgument, ResourceExhausted: engine refusals (as VerifierErrors).
    """
    spans = check_images(core, req, images)
    t0 = time.perf_counter()
    session, _ = core.acquire(req.prompt)
    try:
        yield from _generate(core, req, images, spans, session, cancel, t0)
    except EngineError as exc:
        raise engine_error(exc, "generation") from None
    finally:
        core.release(session, None)   # freed: its KV holds image rows


def _generate(core, req, images, spans, session, cancel, t0) -> Iterator[RoundEvent]:
    vis = core.vision
    n = len(req.prompt)
    n_ctx = core.config.n_ctx
    toks = np.asarray(req.prompt, dtype=np.int32).copy()
    embds, dss = [], []
    pos = rope_positions(spans, n)
    with core.engine_lock:
        session.rollback(0)
        for im, (off, gh, gw) in zip(images, spans):
            # value / 255 from the coordinator, normalised here with the projector's mean / std
            # (the same float32 operations as services/text/images.py's preprocess)
            px = np.frombuffer(im.pixels, dtype="<f4").reshape(3, im.height, im.width).astype(np.float32)
            px -= np.asarray(vis.info.image_mean, dtype=np.float32)[:, None, None]
            px /= np.asarray(vis.info.image_std, dtype=np.float32)[:, None, None]
            e, d = vis.encode(px, core.config.batch_threads)
            embds.append(e)
            dss.append(d)
            toks[off:off + gh * gw] = TOKEN_EMBD
        embd = np.concatenate(embds)
        ds = np.concatenate(dss, axis=1) if vis.info.n_deepstack else None
        _, row = session.forward_embd(toks, pos, embd, ds, logits="last")
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
        yield RoundEvent([tok], v_ms=v_ms, t_ms=core.t_ms, wall_ms=v_ms, n_past=n_past, n_ctx=n_ctx,
                         prefill=first, spec_reason=SPEC_REASON if first and req.spec else "")
        first = False
        if tok in req.eos_ids or produced >= req.max_tokens or cancel.is_set():
            return
        if n_past + 1 > n_ctx:
            yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx, finish=FINISH_CONTEXT)
            return
        t0 = time.perf_counter()
        p = n_past - lag
        with core.engine_lock:
            _, row = session.forward([tok], logits="last", positions=np.array([[p, p, p]]))
