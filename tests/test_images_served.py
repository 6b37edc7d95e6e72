"""An image chat served end to end: `serve --mmproj` loads the projector beside the Qwen3-VL model,
the coordinator renders each image as <|vision_start|> + one <|image_pad|> per merged token +
<|vision_end|>, and the verifier encodes the image, prefills with the image grid's positions
(es_forward_embd) and decodes with positions continuing after the image.

Fixture: tests/data/models/qwen3vl-Q8_0.gguf + qwen3vl-mmproj-F16.gguf; the reference
qwen3vl-mmproj-F16.ref.npz holds transformers' test image (224x320: no resize) and its logits for
the chat turn "<|im_start|>user\\n" + image + "What is the capital of France?<|im_end|>\\n
<|im_start|>assistant\\n" (88 tokens), which a ChatML template without a default system message
renders from one user message [image, text].
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import openai
import pytest
from PIL import Image as PILImage

from echospec.services.text import images
from echospec.services.verifier.engine import TOKEN_EMBD, Model, Vision
from echospec.services.verifier.vision import rope_positions
from echospec.v1 import coordinator_pb2 as cpb
from echospec.v1 import verifier_pb2, verifier_pb2_grpc
from tests.test_images_api import data_url
from tests.test_image_prompt import BOUND, MODELS

VL = MODELS / "qwen3vl-Q8_0.gguf"
MMPROJ = MODELS / "qwen3vl-mmproj-F16.gguf"
QUESTION = "What is the capital of France?"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
N_OUT = 6
ECHOSPEC = [sys.executable, "-m", "echospec.cli"]


@pytest.fixture(scope="module")
def ref():
    return np.load(MODELS / "qwen3vl-mmproj-F16.ref.npz")


@pytest.fixture(scope="module")
def png(ref) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(ref["image"]).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    tpl = tmp_path_factory.mktemp("tpl") / "chatml.jinja"
    tpl.write_text(TEMPLATE)
    st = start_stack(str(VL), mmproj=str(MMPROJ), chat_template=str(tpl), n_ctx=256, n_threads=1,
                     http_port=0, spec=False)
    ch = grpc.insecure_channel(st.target)
    oc = openai.OpenAI(base_url=st.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield st, coordinator_pb2_grpc.CoordinatorServiceStub(ch), oc
    finally:
        oc.close()
        ch.close()
        st.stop(0.5)


def direct(ref, png) -> list[int]:
    """Greedy tokens of the engine itself on the reference prompt: the image preprocessed as the
    coordinator does, normalised with the projector's mean / std, encoded, prefilled with
    es_forward_embd at get_rope_index's positions, then decoded with positions after the image."""
    v = Vision(str(MMPROJ))
    m = Model(str(VL))
    s = m.new_session(n_ctx=256, n_threads=1)
    try:
        img = images.preprocess(png, "image", "image/png", mean=v.info.image_mean, std=v.info.image_std)
        embd, ds = v.encode(img.pixels)
        toks = ref["vl_tokens"].astype(np.int32).copy()
        toks[toks == 49154] = TOKEN_EMBD
        pos = ref["vl_pos_thw"]
        am, _ = s.forward_embd(toks, pos, embd, ds, logits="last")
        out = [int(am[-1])]
        p = int(pos.max()) + 1
        while len(out) < N_OUT:
            am, _ = s.forward([out[-1]], positions=np.array([[p, p, p]]))
            out.append(int(am[0]))
            p += 1
        return out
    finally:
        s.close()
        m.close()
        v.close()


def chat(stub, png, **kw):
    msg = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png, media_type="image/png"),
                                              cpb.ContentPart(text=QUESTION)])
    kw.setdefault("max_tokens", N_OUT)
    return stub.Complete(cpb.CompleteRequest(messages=[msg], **kw), timeout=120).result


def test_positions_are_get_rope_index(ref):
    assert np.array_equal(rope_positions([(4, 7, 10)], len(ref["vl_tokens"])), ref["vl_pos_thw"])
    # two images and text between them: each continues from the largest position + 1
    pos = rope_positions([(1, 2, 3), (9, 1, 2)], 12)
    assert pos[:, 0].tolist() == [0, 1, 1, 1, 1, 1, 1, 4, 5, 6, 6, 8]
    assert pos[1:7, 1].tolist() == [1, 1, 1, 2, 2, 2] and pos[1:7, 2].tolist() == [1, 2, 3, 1, 2, 3]


def test_image_chat_matches_the_engine_and_transformers(stack, ref, png):
    _, stub, _ = stack
    want = direct(ref, png)
    # transformers' first token is a near-tie (test_image_prompt.py): one of its top two
    assert want[0] in ref["vl_top_ids"][-1, :2]
    r = chat(stub, png)
    assert r.prompt_tokens == len(ref["vl_tokens"]) == 88   # the 70 image tokens counted
    assert list(r.token_ids) == want[:len(r.token_ids)] and len(r.token_ids) >= 1


def test_speculation_on_gives_the_same_tokens(stack, png):
    """Speculation over the text tokens: the draft service's proposals verified at the positions
    after the image; the tokens are those of plain decoding."""
    from echospec.v1 import common_pb2
    _, stub, _ = stack
    off = chat(stub, png, spec=common_pb2.SPEC_MODE_OFF, max_tokens=32)
    on = chat(stub, png, spec=common_pb2.SPEC_MODE_ON, max_tokens=32)
    assert list(on.token_ids) == list(off.token_ids) and on.text == off.text
    assert len(on.token_ids) == 32
    assert on.spec_enabled and on.spec_reason == "", on.spec_reason
    assert on.stats.tries >= 1 and on.stats.hits >= 1, on.stats


def test_an_image_generation_leaves_its_text_and_output_to_the_draft_namespace(stack, png):
    """The draft session of a speculative image generation holds the prompt without its image
    tokens and the whole output, so its namespace keeps both (the output after the last
    proposal included)."""
    from echospec.v1 import common_pb2
    st, stub, _ = stack
    memory = st._servers["draft"][1].memory
    for i, n in enumerate((1, 7, 32)):
        r = chat(stub, png, spec=common_pb2.SPEC_MODE_ON, max_tokens=n, draft_namespace=f"image{i}")
        assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH, r.finish_reason
        want = r.prompt_tokens - 70 + len(r.token_ids)   # the image's 70 tokens are never drafted
        deadline = time.monotonic() + 10
        while memory.n_tokens(f"image{i}") != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert memory.n_tokens(f"image{i}") == want, n


def test_gateway_image_url_gives_the_same_text(stack, png):
    _, stub, oc = stack
    want = chat(stub, png).text
    r = oc.chat.completions.create(model="qwen3vl-Q8_0", max_tokens=N_OUT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": QUESTION}]}])
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == 88


def test_cli_image_gives_the_same_text(stack, png, tmp_path):
    import json

    st, stub, _ = stack
    f = tmp_path / "image.png"
    f.write_bytes(png)
    want = chat(stub, png)
    r = subprocess.run([*ECHOSPEC, "generate", "--target", st.target, "--image", str(f), "--max-tokens",
                        str(N_OUT), "--json", QUESTION], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["text"] == want.text and j["token_ids"] == list(want.token_ids)


def turn2(stub, png, answer: str):
    msgs = [cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png, media_type="image/png"),
                                                cpb.ContentPart(text=QUESTION)]),
            cpb.ChatMessage(role="assistant", content=answer),
            cpb.ChatMessage(role="user", content="And of Italy?")]
    return stub.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=N_OUT), timeout=120).result


def test_second_turn_reuses_the_image_prefix_with_the_same_tokens(stack, png, tmp_path):
    """The prefix cache keys an image by its pixels: the second turn about the image prefills
    only what follows the first turn's prompt, and its tokens are those of a verifier that reuses
    nothing (--no-prefix-cache)."""
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    _, stub, _ = stack
    first = chat(stub, png)
    again = turn2(stub, png, first.text)
    assert again.stats.cached_prompt_tokens >= 88
    other = np.asarray(PILImage.open(io.BytesIO(png))).copy()
    other[0, 0] ^= 1                      # one pixel changed: nothing after the image is reused
    buf = io.BytesIO()
    PILImage.fromarray(other).save(buf, "PNG")
    changed = turn2(stub, buf.getvalue(), first.text)
    assert changed.stats.cached_prompt_tokens <= 4
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(TEMPLATE)
    st = start_stack(str(VL), mmproj=str(MMPROJ), chat_template=str(tpl), n_ctx=256, n_threads=1,
                     spec=False, prefix_cache=False)
    ch = grpc.insecure_channel(st.target)
    try:
        cold = turn2(coordinator_pb2_grpc.CoordinatorServiceStub(ch), png, first.text)
    finally:
        ch.close()
        st.stop(0.5)
    assert cold.stats.cached_prompt_tokens == 0
    assert list(again.token_ids) == list(cold.token_ids) and again.prompt_tokens == cold.prompt_tokens


class HeldEncoder:
    """The verifier's vision encoder held: each encode records its pixels' shape, says it
    started (``entered``) and waits for ``release`` before encoding."""

    def __init__(self, vis):
        import threading
        self.vis, self.real = vis, vis.encode
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), []

    def _encode(self, px, n_threads=1):
        self.calls.append(px.shape)
        self.entered.set()
        assert self.release.wait(60)
        return self.real(px, n_threads)

    def __enter__(self):
        self.vis.encode = self._encode
        return self

    def __exit__(self, *exc):
        self.release.set()
        del self.vis.encode


def test_other_sessions_go_on_while_an_image_is_encoded(stack, png):
    """The encode runs outside the engine lock (was: under it, so every other session stalled for
    the encode's length): a text chat finishes while an image's encode is held."""
    from concurrent.futures import ThreadPoolExecutor

    st, stub, _ = stack
    other = np.asarray(PILImage.open(io.BytesIO(png))).copy()
    other[1, 1] ^= 2                      # an image no earlier test sent: the prefix cache lacks it
    buf = io.BytesIO()
    PILImage.fromarray(other).save(buf, "PNG")
    png = buf.getvalue()
    with ThreadPoolExecutor(1) as ex, HeldEncoder(st.verifier.core.vision) as held:
        fut = ex.submit(chat, stub, png)
        assert held.entered.wait(60)
        text = stub.Complete(cpb.CompleteRequest(
            messages=[cpb.ChatMessage(role="user", content=QUESTION)], max_tokens=N_OUT), timeout=60)
        assert len(text.result.token_ids) >= 1
        assert not fut.done()
        held.release.set()
        got = fut.result(timeout=120)
    assert list(got.token_ids) == list(chat(stub, png).token_ids)


def test_a_request_cancelled_while_its_images_are_preprocessed_generates_nothing(stack, png, caplog):
    """The coordinator preprocesses one image at a time; a client that cancels meanwhile ended
    the RPC before the coordinator registered its cancel callback, which gRPC then never ran:
    the verifier generated every token for nobody (was: tokens_out=100, code=CANCELLED)."""
    import logging
    st, stub, _ = stack
    gate = st._servers["coordinator"].servicer.image_parts._one_at_a_time
    caplog.set_level(logging.INFO, logger="echospec.coordinator")
    msg = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png), cpb.ContentPart(text="cancelled")])
    with gate:   # another request's image is being preprocessed
        fut = stub.Complete.future(cpb.CompleteRequest(messages=[msg], max_tokens=100), timeout=60)
        time.sleep(0.5)
        fut.cancel()
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    done = []   # the coordinator's request log line of the cancelled call
    while time.monotonic() < deadline and not done:
        done = [f for f in (getattr(r, "fields", None) for r in caplog.records)
                if f and f.get("rpc") == "Complete" and f.get("code") == "CANCELLED"]
        time.sleep(0.1)
    assert done, [getattr(r, "fields", r.getMessage()) for r in caplog.records]
    assert done[-1]["tokens_out"] == 0, done[-1]
    assert chat(stub, png, max_tokens=2).token_ids   # the stack goes on


def test_an_image_cancelled_while_waiting_for_the_encoder_is_not_encoded(stack, png):
    """One encode at a time: a request cancelled while another's image is encoded gives up
    when its turn comes instead of encoding an image for nobody (was: encoded, then dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    st, stub, _ = stack

    def variant(bit):   # images no earlier test sent: the prefix cache lacks them
        a = np.asarray(PILImage.open(io.BytesIO(png))).copy()
        a[2, 2] ^= bit
        buf = io.BytesIO()
        PILImage.fromarray(a).save(buf, "PNG")
        return buf.getvalue()

    with ThreadPoolExecutor(1) as ex, HeldEncoder(st.verifier.core.vision) as held:
        first = ex.submit(chat, stub, variant(4), max_tokens=2)
        assert held.entered.wait(60)
        msg = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=variant(8)),
                                                  cpb.ContentPart(text=QUESTION)])
        fut = stub.Complete.future(cpb.CompleteRequest(messages=[msg], max_tokens=2), timeout=60)
        time.sleep(1.0)   # it waits for the encoder
        fut.cancel()
        time.sleep(0.5)
        held.release.set()
        assert first.result(timeout=120).token_ids
        time.sleep(1.0)
    assert len(held.calls) == 1, held.calls


def test_two_images_match_the_engine(stack, ref, png):
    """Two images in one message, text between them: the served tokens are the engine's on the
    prompt the template renders, with both images' embeddings in order and each image's grid
    positions (the second continuing after the first)."""
    from echospec.services.text.tokenizer import Tokenizer

    _, stub, _ = stack
    flipped = io.BytesIO()
    PILImage.fromarray(np.ascontiguousarray(ref["image"][::-1])).save(flipped, "PNG")
    png2 = flipped.getvalue()
    msg = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png), cpb.ContentPart(text="and"),
                                              cpb.ContentPart(image=png2), cpb.ContentPart(text=QUESTION)])
    r = stub.Complete(cpb.CompleteRequest(messages=[msg], max_tokens=N_OUT), timeout=120).result
    ph = "<|vision_start|>" + "<|image_pad|>" * 70 + "<|vision_end|>"
    ids = Tokenizer.from_gguf(str(VL)).prompt_ids(
        f"<|im_start|>user\n{ph}and{ph}{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert r.prompt_tokens == len(ids)
    toks = np.asarray(ids, dtype=np.int32)
    starts = [i for i in range(len(toks)) if toks[i] == 49154 and toks[i - 1] == 49152]
    assert len(starts) == 2
    v, m = Vision(str(MMPROJ)), Model(str(VL))
    s = m.new_session(n_ctx=256, n_threads=1)
    try:
        enc = [v.encode(images.preprocess(b, "image", "image/png", mean=v.info.image_mean,
                                          std=v.info.image_std).pixels) for b in (png, png2)]
        pos = rope_positions([(starts[0], 7, 10), (starts[1], 7, 10)], len(toks))
        toks[toks == 49154] = TOKEN_EMBD
        am, _ = s.forward_embd(toks, pos, np.concatenate([e for e, _ in enc]),
                               np.concatenate([d for _, d in enc], axis=1))
        want = [int(am[-1])]
        p = int(pos.max()) + 1
        while len(want) < N_OUT:
            am, _ = s.forward([want[-1]], positions=np.array([[p, p, p]]))
            want.append(int(am[0]))
            p += 1
    finally:
        s.close()
        m.close()
        v.close()
    assert list(r.token_ids) == want[:len(r.token_ids)] and len(r.token_ids) >= 1


def test_sampling_with_an_image_is_reproducible(stack, png):
    _, stub, _ = stack
    a = chat(stub, png, temperature=0.9, seed=7, max_tokens=12)
    b = chat(stub, png, temperature=0.9, seed=7, max_tokens=12)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 12
    assert list(a.token_ids) != list(chat(stub, png, max_tokens=12).token_ids)


def test_a_cancelled_image_generation_frees_its_session(stack, png):
    from echospec.v1 import common_pb2
    st, stub, _ = stack
    msg = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=png), cpb.ContentPart(text=QUESTION)])
    call = stub.Generate(cpb.GenerateRequest(messages=[msg], max_tokens=150, spec=common_pb2.SPEC_MODE_ON),
                         timeout=120)
    next(iter(call))
    call.cancel()
    want = chat(stub, png)
    ch = grpc.insecure_channel(st.verifier_target)
    try:
        vs = verifier_pb2_grpc.VerifierServiceStub(ch)
        for _ in range(100):
            if vs.GetConfig(verifier_pb2.GetConfigRequest(), timeout=30).active_sessions == 0:
                break
            time.sleep(0.05)
        assert vs.GetConfig(verifier_pb2.GetConfigRequest(), timeout=30).active_sessions == 0
    finally:
        ch.close()
    assert list(chat(stub, png).token_ids) == list(want.token_ids)


def test_getinfo_and_verifier_config_say_images(stack):
    st, stub, _ = stack
    info = stub.GetInfo(cpb.GetInfoRequest(), timeout=30)
    assert info.images is True and info.images_missing == ""
    ch = grpc.insecure_channel(st.verifier_target)
    try:
        cfg = verifier_pb2_grpc.VerifierServiceStub(ch).GetConfig(verifier_pb2.GetConfigRequest(), timeout=30)
    finally:
        ch.close()
    assert cfg.images is True


def test_images_too_large_for_the_context_are_named(stack):
    """Images whose tokens alone exceed the context are refused naming the image that crosses
    it (was: "prompt of 213170 bytes cannot fit the context ...: a token covers at most 81 bytes
    of text", the image pads counted as text)."""
    st, stub, oc = stack

    def png(side):
        buf = io.BytesIO()
        PILImage.new("RGB", (side, side), "white").save(buf, "PNG")
        return buf.getvalue()

    def refused(parts):
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(cpb.CompleteRequest(messages=[cpb.ChatMessage(role="user", parts=parts)],
                                              max_tokens=2), timeout=120)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        return e.value.details()

    tail = "which cannot fit the context of 256 tokens: send a smaller image, or serve with a " \
           "lower --image-max-pixels"
    # 640x640: 20 x 20 merged tokens, with its start and end 402
    assert refused([cpb.ContentPart(image=png(640)), cpb.ContentPart(text="hi")]) == \
        f"messages[0].parts[0]: the image takes 402 tokens (640x640 after resizing), {tail}"
    # 320x320 fits alone (102 tokens), not three times (306)
    three = [cpb.ContentPart(image=png(320))] * 3
    assert refused(three) == (f"messages[0].parts[2]: the image takes 102 tokens (320x320 after "
                              f"resizing) and the images before it 204, {tail}")
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model="qwen3vl-Q8_0", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(png(640))}}]}])
    assert e.value.body["param"] == "messages[0].content[1]", e.value.body
    assert chat(stub, png(320), max_tokens=2).token_ids   # the stack goes on


@pytest.mark.parametrize("field, body, says", [
    ("logprobs", {"logprobs": True}, "takes no logprobs yet"),
    ("penalties", {"frequency_penalty": 0.5}, "takes no repetition penalties (frequency_penalty, "),
    ("grammar", {"response_format": {"type": "json_object"}}, "takes no grammar (response_format"),
])
def test_image_prompts_name_the_refused_field(stack, png, field, body, says):
    # was: "takes no grammar, repetition penalties, logprobs or resumed tokens yet" whichever was sent
    st, _, oc = stack
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model="qwen3vl-Q8_0", max_tokens=2, extra_body=body, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                         {"type": "text", "text": QUESTION}]}])
    assert e.value.body["code"] == "failed_precondition", e.value.body
    assert says in e.value.body["message"], e.value.body
    named = [w for w in ("no logprobs", "no repetition penalties", "no grammar")
             if w in e.value.body["message"]]
    assert len(named) == 1, e.value.body   # only the field sent


@pytest.mark.parametrize("which", ["text_gguf", "missing", "directory", "fifo", "other_model"])
def test_bad_mmproj_exits_2_with_a_message(which, tmp_path):
    model, mmproj, says = str(VL), str(MMPROJ), ""
    if which == "text_gguf":
        mmproj, says = str(VL), "not a usable vision projector"
    elif which == "missing":
        mmproj, says = str(tmp_path / "none.gguf"), "no such file"
    elif which == "directory":
        mmproj, says = str(tmp_path), "is a directory"
    elif which == "fifo":
        os.mkfifo(tmp_path / "pipe.gguf")
        mmproj, says = str(tmp_path / "pipe.gguf"), "not a regular file"
    else:
        model, says = str(MODELS / "qwen3moe-Q4_K_M.gguf"), "takes no image embeddings"
    r = subprocess.run([*ECHOSPEC, "serve", "--model", model, "--mmproj", mmproj, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--mmproj" in r.stderr and says in r.stderr, r.stderr


@pytest.mark.parametrize("which", ["missing", "text_gguf"])
def test_load_vision_names_an_unreadable_projector(which, tmp_path):
    # the verifier started on its own (ECHOSPEC_MMPROJ) said only "gguf: cannot open ...", not
    # that the file was meant as the projector
    from echospec.services.verifier.vision import ProjectorMismatch, load_vision
    path = str(tmp_path / "none.gguf") if which == "missing" else str(VL)
    m = Model(str(VL), repack=False)
    try:
        with pytest.raises(ProjectorMismatch) as e:
            load_vision(path, m.info)
    finally:
        m.close()
    assert str(e.value).startswith(f"--mmproj {path}: not a usable vision projector: ES_ERR_"), e.value


def test_without_a_projector_the_vl_model_refuses_images(png, tmp_path):
    """The same Qwen3-VL model served without --mmproj is text-only: the coordinator refuses the
    image, and its verifier refuses GenerateTokens images itself (FAILED_PRECONDITION)."""
    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2_grpc

    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(TEMPLATE)
    st = start_stack(str(VL), chat_template=str(tpl), n_ctx=256, n_threads=1, spec=False)
    ch = grpc.insecure_channel(st.target)
    vch = grpc.insecure_channel(st.verifier_target)
    try:
        with pytest.raises(grpc.RpcError) as e:
            chat(coordinator_pb2_grpc.CoordinatorServiceStub(ch), png)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "served without a vision projector" in e.value.details()
        vstub = verifier_pb2_grpc.VerifierServiceStub(vch)
        assert vstub.GetConfig(verifier_pb2.GetConfigRequest(), timeout=30).images is False
        req = verifier_pb2.GenerateTokensRequest(
            prompt=[1, 49152, 49154, 49153, 198], max_tokens=2,
            images=[verifier_pb2.Image(pixels=np.zeros((3, 32, 32), "<f4").tobytes(), height=32,
                                       width=32, offset=2)])
        with pytest.raises(grpc.RpcError) as e:
            list(vstub.GenerateTokens(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no vision projector" in e.value.details()
    finally:
        vch.close()
        ch.close()
        st.stop(0.5)


def test_bad_image_requests_to_the_verifier_are_named(stack):
    """GenerateTokens images that do not fit the prompt: INVALID_ARGUMENT naming the image; the
    verifier serves the next request."""
    st, _, _ = stack
    ch = grpc.insecure_channel(st.verifier_target)
    vstub = verifier_pb2_grpc.VerifierServiceStub(ch)
    px = np.zeros((3, 32, 64), "<f4").tobytes()

    def refused(images, prompt=(1, 49152, 49154, 49154, 49153, 198)):
        with pytest.raises(grpc.RpcError) as e:
            list(vstub.GenerateTokens(verifier_pb2.GenerateTokensRequest(
                prompt=list(prompt), max_tokens=2, images=images), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        return e.value.details()

    try:
        assert "not a positive multiple of 32" in refused([verifier_pb2.Image(pixels=px, height=30, width=64, offset=2)])
        assert "pixel bytes" in refused([verifier_pb2.Image(pixels=px[:-4], height=32, width=64, offset=2)])
        assert "runs past the prompt" in refused([verifier_pb2.Image(pixels=px, height=32, width=64, offset=5)])
        two = [verifier_pb2.Image(pixels=px, height=32, width=64, offset=2)] * 2
        assert "images[1]" in refused(two)
        # pixels are value / 255: NaN or infinite ones were encoded, then failed as INTERNAL
        # "ES_ERR_BAD_WEIGHTS: the logits ... hold a NaN", blaming the model's weights
        for bad, says in ((float("nan"), "nan .. nan"), (float("inf"), "inf .. inf"), (-0.5, "-0.5 .. -0.5"),
                          (2.0, "2 .. 2")):
            pb = np.full((3, 32, 64), bad, "<f4").tobytes()
            assert refused([verifier_pb2.Image(pixels=pb, height=32, width=64, offset=2)]) == \
                f"images[0]: pixel values must be value / 255, in [0, 1], got {says}"
        ok = list(vstub.GenerateTokens(verifier_pb2.GenerateTokensRequest(
            prompt=[1, 49152, 49154, 49154, 49153, 198], max_tokens=2,
            images=[verifier_pb2.Image(pixels=px, height=32, width=64, offset=2)]), timeout=60))
        assert sum(len(r.result.tokens) for m in ok for r in m.rounds) == 2
    finally:
        ch.close()
