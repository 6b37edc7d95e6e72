"""A generation whose prompt holds images (GenerateTokensRequest.images).

The verifier encodes each image with the projector (vision.py; outside the engine lock, one
encode at a time, so other sessions' steps go on meanwhile), replaces the image's prompt tokens
by its embeddings, gives them the image grid's (t, h, w) positions (vision.rope_positions) and
prefills the whole prompt in one engine call (es_forward_embd, deepstack outputs added at the image
rows). The engine's decode steps, verifies and in-engine runs of the scheduler rotate each token by
its KV position, while after an image Qwen3-VL's position runs ``lag`` = KV position - rotary
position behind it; so this loop runs its own rounds with the positions given
(es_forward_positions), under the engine lock, beside the scheduler's iterations: a plain step
over the pending token, or (speculation, greedy) a verify of the pending token and the draft
service's proposal, the rejected positions rolled back. The draft history is the prompt without
the images' tokens (never drafted or matched) and the output; the rounds' tokens are those of
plain greedy decoding (the engine's verify over n tokens is n decode steps, bitwise).

Not done (refused with FAILED_PRECONDITION): grammar, repetition penalties, logprobs, resumed
generations, KV eviction and sparse attention; token trees (chains only); the cost model (a
round drafts up to k). Prefix reuse works through the prefix cache, keyed by the image's pixels
(``image_keys``).
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from echospec.services.verifier.engine import TOKEN_EMBD, EngineError, sample
from echospec.services.verifier.generation_loop import (FINISH_CONTEXT, DraftUnavailable, GenerationRequest,
                                                       RoundEvent)
from echospec.services.verifier.sessions import (FailedPrecondition, InvalidArgument, engine_error,
                                                 longest_accepted_prefix)
from echospec.services.verifier.vision import rope_positions


def check_images(core: Any, req: GenerationRequest, images: Sequence[Any]) -> list[tuple[int, int, int]]:
    """Refuse an image request this verifier cannot run; the images' (offset, gh, gw) spans.

    Raises:
        FailedPrecondition: no projector loaded; grammar, penalties, logprobs or a resume.
        InvalidArgument: an image whose sizes, pixel bytes or offset do not fit the prompt, or
            whose pixel values are not in [0, 1] (NaN included).
    """
    if core.vision is None:
        raise FailedPrecondition("the verifier has no vision projector (--mmproj): it takes no images")
    if core.config.kv_window > 0 or core.config.sparse_attention:
        raise FailedPrecondition("a prompt with images needs full attention (no --kv-window, no "
                                 "--sparse-attention)")
    refused = [what for what, present in (
        ("grammar (response_format, a required tool choice)", req.grammar is not None),
        ("repetition penalties (frequency_penalty, presence_penalty, repetition_penalty)",
         req.sampling.penalties.active),
        ("logprobs", bool(req.logprobs)),
        ("resumed tokens", bool(req.resumed))) if present]
    if refused:   # named, so a client knows which field to leave out
        raise FailedPrecondition(f"a prompt with images takes no {' and no '.join(refused)} yet "
                                 f"(grammars, penalties, logprobs and resumed tokens are for text "
                                 f"prompts only)")
    side = core.vision.info.side
    spans, end = [], 0
    for i, im in enumerate(images):
        h, w = int(im.height), int(im.width)
        if h <= 0 or w <= 0 or h % side or w % side:
            raise InvalidArgument(f"images[{i}]: {w}x{h} is not a positive multiple of {side} on each side")
        if len(im.pixels) != 3 * h * w * 4:
            raise InvalidArgument(f"images[{i}]: {len(im.pixels)} pixel bytes, want 3 x {h} x {w} float32 "
                                  f"({3 * h * w * 4} bytes)")
        px = np.frombuffer(im.pixels, dtype="<f4")
        lo, hi = float(px.min()), float(px.max())
        if not (0.0 <= lo and hi <= 1.0):   # NaN fails both; the encoder would give NaN logits
            raise InvalidArgument(f"images[{i}]: pixel values must be value / 255, in [0, 1], got "
                                  f"{lo:g} .. {hi:g}")
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
                         cancel: threading.Event, open_draft: Callable[[], Any] | None = None
                         ) -> Iterator[RoundEvent]:
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
        for ev, kv, last in _generate(core, req, images, spans, session, cached, keys, cancel, t0,
                                      open_draft):
            if last:   # back to the prefix cache before the last event: a next turn finds it
                released = True
                core.release(session, kv, len(req.prompt))
            yield ev
    except EngineError as exc:
        raise engine_error(exc, "generation") from None
    finally:
        if not released:
            core.release(session, None)   # state unknown (failed or cancelled): freed


def _generate(core, req, images, spans, session, cached, keys, cancel, t0, open_draft):
    vis = core.vision
    n = len(req.prompt)
    n_ctx = core.config.n_ctx
    toks = np.asarray(req.prompt, dtype=np.int32).copy()
    embds, dss = [], []
    pos = rope_positions(spans, n)
    with core.engine_lock:
        session.rollback(cached)
    # the images are encoded outside the engine lock (one at a time: the vision lock), so the
    # other sessions' steps go on meanwhile; only the prefill below takes the engine
    for im, (off, gh, gw) in zip(images, spans):
        if off + gh * gw <= cached:
            continue              # in the reused prefix: its KV is there
        if cancel.is_set():
            return
        # value / 255 from the coordinator, normalised here with the projector's mean / std
        # (the same float32 operations as services/text/images.py's preprocess)
        px = np.frombuffer(im.pixels, dtype="<f4").reshape(3, im.height, im.width).astype(np.float32)
        px -= np.asarray(vis.info.image_mean, dtype=np.float32)[:, None, None]
        px /= np.asarray(vis.info.image_std, dtype=np.float32)[:, None, None]
        with core.vision_lock:
            if cancel.is_set():   # cancelled while another request's image was encoded
                return
            e, d = vis.encode(px, core.config.batch_threads)
        embds.append(e)
        dss.append(d)
        toks[off:off + gh * gw] = TOKEN_EMBD
    with core.engine_lock:
        rest = toks[cached:]
        logits = "none" if req.sampling.greedy else "last"
        if embds:
            embd = np.concatenate(embds)
            ds = np.concatenate(dss, axis=1) if vis.info.n_deepstack else None
            am, row = session.forward_embd(rest, pos[cached:], embd, ds, logits=logits)
        else:
            am, row = session.forward(rest, logits=logits, positions=pos[cached:])
    kv = list(keys)
    lag = n - (int(pos.max()) + 1)     # KV position - rotary position of the text after the prompt
    rng = int(req.sampling.seed) & 0xFFFFFFFFFFFFFFFF
    s = req.sampling

    def choose(am, row, i):
        nonlocal rng
        if s.greedy:
            return int(am[i])
        tok, rng = sample(row[0], s.temperature, s.top_k, s.top_p, s.min_p, rng)
        return tok

    link, reason = None, ""
    if req.spec:
        if open_draft is None:
            reason = "no draft service configured"
        else:
            try:
                link = open_draft()
                # the draft history: the prompt without the images' tokens (never drafted or matched)
                text = list(req.prompt)
                for off, gh, gw in reversed(spans):
                    del text[off:off + gh * gw]
                link.append(text)
            except DraftUnavailable as exc:
                link, reason = None, str(exc)
    try:
        pending = choose(am, row, -1)
        remaining = req.max_tokens - 1
        v_ms = (time.perf_counter() - t0) * 1e3
        done = pending in req.eos_ids or remaining <= 0
        yield (RoundEvent([pending], v_ms=v_ms, t_ms=core.t_ms, wall_ms=v_ms, n_past=session.n_past,
                          n_ctx=n_ctx, prefill=True, cached_prompt_tokens=cached, spec_reason=reason),
               kv, done)
        unsent = [pending]             # output the draft service has not been sent yet
        while not done and not cancel.is_set():
            t0 = time.perf_counter()
            n_past = session.n_past
            if n_past + 1 > n_ctx:
                yield RoundEvent([], t_ms=core.t_ms, n_past=n_past, n_ctx=n_ctx, finish=FINISH_CONTEXT), kv, True
                return
            draft, source, proposals, reason = [], 0, 0, ""
            k_cap = min(req.k, remaining - 1, n_ctx - n_past - 1)
            if link is not None and k_cap >= 1:
                try:
                    link.send_propose(unsent, k_cap)
                    unsent = []
                    draft = [int(t) for t in link.recv_proposal()[:k_cap]]
                    source, proposals = link.last_source, 1
                except DraftUnavailable as exc:
                    link.close()
                    link, reason = None, f"speculation stopped: {exc}"
            feed = [pending] + draft
            p = n_past - lag
            with core.engine_lock:
                am, row = session.forward(feed, logits="none" if s.greedy else "last",
                                          positions=np.repeat(np.arange(p, p + len(feed))[:, None], 3, axis=1))
                r = longest_accepted_prefix(draft, am[:len(draft)])
                if r < len(draft):
                    session.rollback(n_past + 1 + r)
            kv = kv + feed[:1 + r]
            new = draft[:r] + [choose(am, row, r)]
            out = []
            for t in new[:remaining]:
                out.append(t)
                if t in req.eos_ids:
                    break
            remaining -= len(out)
            unsent += out              # new past the output's end (an EOS, max_tokens) is no output
            pending = new[-1]
            done = (out[-1] in req.eos_ids) or remaining <= 0
            v_ms = (time.perf_counter() - t0) * 1e3
            yield (RoundEvent(out, k=len(draft), accepted=r, v_ms=v_ms, t_ms=core.t_ms, wall_ms=v_ms,
                              n_past=session.n_past, n_ctx=n_ctx, proposals=proposals, source=source,
                              spec_reason=reason), kv, done)
        if link is not None and unsent:   # the output after the last proposal, for the namespace
            link.append(unsent)
    finally:
        if link is not None:
            link.close()
