"""Image preprocessing (services/text/images.py): decoding, hostile files, Qwen3-VL's smart_resize,
normalisation and the pixel hash. Pure: no service runs."""
from __future__ import annotations

import io
import random
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from echospec.services.text import images
from echospec.services.text.images import ImageError, ImageLimits, preprocess, smart_resize

ROOT = Path(__file__).resolve().parents[1]

PART = "messages[1].content[2]"


def encode(im: PILImage.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, seed: int = 0) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height, with one tiny IDAT (a bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


# -- smart_resize: Qwen2-VL / Qwen3-VL's rule, factor 32, budget 256*256 .. 4096*4096 ----------
@pytest.mark.parametrize("hw, want", [
    ((480, 640), (480, 640)),       # already multiples of 32, inside the budget
    ((500, 700), (512, 704)),       # each side to the nearest multiple of 32
    ((1, 1), (256, 256)),           # scaled up to the minimum budget (256*256)
    ((100, 100), (256, 256)),
    ((8192, 4096), (5792, 2880)),   # scaled down under the maximum budget (4096*4096)
    ((1000, 5), (3648, 32)),        # aspect ratio 200: still taken, scaled up to the minimum
])
def test_smart_resize_qwen3vl_defaults(hw, want):
    assert smart_resize(*hw) == want


# Golden values from transformers' Qwen2-VL smart_resize (the rule Qwen3-VL's processor uses) with
# factor 32; ours matched it on 35,000 random sizes and budgets when these were taken.
@pytest.mark.parametrize("hw, default_budget, small_budget", [
    ((1080, 1920), (1088, 1920), (32, 64)),
    ((33, 4000), (32, 4000), (32, 704)),
    ((3, 7), (192, 416), (32, 64)),
    ((15, 600), (64, 1632), (32, 224)),
    ((10, 10), (256, 256), (32, 32)),
    ((448, 448), (448, 448), (64, 64)),
    ((896, 896), (896, 896), (64, 64)),
    ((1000, 5), (3648, 32), (480, 32)),
    ((8192, 4096), (5792, 2880), (64, 32)),
])
def test_smart_resize_golden(hw, default_budget, small_budget):
    assert smart_resize(*hw) == default_budget
    assert smart_resize(*hw, 32, 1024, 4096) == small_budget


def test_pixels_golden():
    """transformers' Qwen2VLImageProcessorPil with Qwen3-VL's settings (patch 16, merge 2, mean and
    std 0.5, 256*256 .. 4096*4096) on this image, its patches laid back out as [3][H][W]: the
    grid 14 x 22 patches, these sums and values (ours matched every element within 1.2e-7)."""
    im = PILImage.fromarray(np.random.default_rng(11).integers(0, 256, (61, 97, 3), dtype=np.uint8))
    out = preprocess(encode(im, "PNG"), PART)
    assert out.pixels.shape == (3, 224, 352)
    x = out.pixels.astype(np.float64)
    # 236,544 elements, each within 1.2e-7 of transformers' (float32 rounding): sums within 0.03
    assert x.sum() == pytest.approx(-313.1796104311943, abs=0.03)
    assert np.abs(x).sum() == pytest.approx(92758.37250036001, abs=0.03)
    assert x[:, 100, 200] == pytest.approx([0.984314, -0.670588, -0.87451], abs=1e-6)
    assert x[1, 0, :3] == pytest.approx([0.803922, 0.678431, 0.403922], abs=1e-6)


def test_smart_resize_custom_budget():
    assert smart_resize(100, 100, 32, 1024, 4096) == (64, 64)
    assert smart_resize(10, 10, 32, 1024, 4096) == (32, 32)
    assert smart_resize(300, 200, 32, 1024, 4096) == (64, 32)


def test_smart_resize_properties():
    rng = random.Random(7)
    for _ in range(500):
        h, w = rng.randint(1, 9000), rng.randint(1, 9000)
        if max(h, w) / min(h, w) > 200:
            continue
        lo, hi = rng.choice([(256 * 256, 4096 * 4096), (1024, 64 * 64), (32 * 32, 1 << 20)])
        rh, rw = smart_resize(h, w, 32, lo, hi)
        assert rh % 32 == 0 and rw % 32 == 0 and rh >= 32 and rw >= 32, (h, w, rh, rw)
        # within the budget, unless a thin image's short side is held at its floor of 32 (the
        # model's rule does the same)
        assert rh * rw <= hi or min(rh, rw) == 32, (h, w, lo, hi, rh, rw)
        if max(h, w) / min(h, w) <= 4:   # extreme ratios may need a side's floor of 32
            assert rh * rw >= lo, (h, w, lo, hi, rh, rw)


def test_smart_resize_refuses_aspect_ratio_above_200():
    with pytest.raises(ValueError, match="aspect ratio 100000.0 is above 200"):
        smart_resize(1, 100000)


# -- decoding: formats, modes, frames ------------------------------------------------------------
@pytest.mark.parametrize("fmt, media", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                         ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_formats_decode_to_rgb(fmt, media):
    im = PILImage.new("RGB", (70, 50), (200, 30, 40))
    out = preprocess(encode(im, fmt), PART, media)
    assert out.format == fmt and (out.width, out.height) == (70, 50)
    assert out.pixels.dtype == np.float32
    assert out.pixels.shape == (3, out.resized_height, out.resized_width)
    assert out.resized_height % 32 == 0 and out.resized_width % 32 == 0
    assert out.resized_height * out.resized_width >= 256 * 256


def test_media_type_is_optional_and_jpg_alias_taken():
    jpeg = encode(PILImage.new("RGB", (40, 40), "red"), "JPEG")
    assert preprocess(jpeg, PART).format == "JPEG"
    assert preprocess(jpeg, PART, "image/jpg").format == "JPEG"


def test_gif_gives_its_first_frame():
    red = PILImage.new("RGB", (32, 32), (255, 0, 0))
    blue = PILImage.new("RGB", (32, 32), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    with PILImage.open(io.BytesIO(data)) as check:
        assert check.n_frames == 2
    fmt, rgb = images.decode(data, PART, "image/gif")
    assert rgb.mode == "RGB" and rgb.getpixel((5, 5)) == (255, 0, 0)


@pytest.mark.parametrize("fmt", ["WEBP", "PNG"])
def test_animated_webp_and_png_give_their_first_frame(fmt):
    red = PILImage.new("RGB", (32, 32), (255, 0, 0))
    blue = PILImage.new("RGB", (32, 32), (0, 0, 255))
    kw = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(red, fmt, save_all=True, append_images=[blue], duration=100, **kw)
    with PILImage.open(io.BytesIO(data)) as check:
        assert check.n_frames == 2
    _, rgb = images.decode(data, PART)
    assert rgb.getpixel((5, 5)) == (255, 0, 0)


def test_rgba_is_composited_over_white():
    im = PILImage.new("RGBA", (4, 1))
    im.putdata([(255, 0, 0, 255), (255, 0, 0, 0), (0, 0, 0, 0), (0, 0, 255, 128)])
    _, rgb = images.decode(encode(im, "PNG"), PART)
    assert rgb.mode == "RGB"
    assert [rgb.getpixel((x, 0)) for x in range(3)] == [(255, 0, 0), (255, 255, 255), (255, 255, 255)]
    r, g, b = rgb.getpixel((3, 0))
    assert b == 255 and 125 <= r <= 128 and r == g


def test_grey_palette_cmyk_and_16bit_become_rgb():
    _, rgb = images.decode(encode(PILImage.new("L", (3, 3), 77), "PNG"), PART)
    assert rgb.mode == "RGB" and rgb.getpixel((1, 1)) == (77, 77, 77)
    pal = PILImage.new("RGB", (3, 3), (10, 200, 30)).convert("P", palette=PILImage.Palette.ADAPTIVE)
    _, rgb = images.decode(encode(pal, "PNG"), PART)
    assert rgb.getpixel((0, 0)) == (10, 200, 30)
    see_through = pal.copy()
    see_through.info["transparency"] = see_through.getpixel((0, 0))
    _, rgb = images.decode(encode(see_through, "PNG", transparency=see_through.getpixel((0, 0))), PART)
    assert rgb.getpixel((2, 2)) == (255, 255, 255)
    _, rgb = images.decode(encode(PILImage.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"), PART)
    r, g, b = rgb.getpixel((4, 4))
    assert rgb.mode == "RGB" and r > 200 and g < 60 and b < 60
    wide = PILImage.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    data = encode(wide, "PNG")
    with PILImage.open(io.BytesIO(data)) as check:
        assert check.mode.startswith("I")
    _, rgb = images.decode(data, PART)
    assert rgb.getpixel((0, 0)) == (255, 255, 255)


def test_normalisation_mean_std_and_layout():
    im = PILImage.new("RGB", (64, 32))
    im.paste((255, 255, 255), (0, 0, 32, 32))   # left half white, right half black
    out = preprocess(encode(im, "PNG"), PART, limits=ImageLimits(min_pixels=32 * 32))
    assert (out.resized_width, out.resized_height) == (64, 32)   # no resize: already aligned
    assert np.all(out.pixels[:, :, :32] == 1.0) and np.all(out.pixels[:, :, 32:] == -1.0)
    other = preprocess(encode(im, "PNG"), PART, limits=ImageLimits(min_pixels=32 * 32),
                       mean=(0.0, 0.5, 1.0), std=(1.0, 0.25, 0.5))
    assert other.pixels[0, 0, 0] == 1.0 and other.pixels[1, 0, 0] == 2.0
    assert other.pixels[2, 0, 0] == 0.0 and other.pixels[2, 0, 40] == -2.0


# -- the pixel hash ------------------------------------------------------------------------------
def test_hash_is_stable_across_lossless_encodings():
    im = noise(97, 61)
    png = preprocess(encode(im, "PNG"), PART)
    webp = preprocess(encode(im, "WEBP", lossless=True), PART)
    assert encode(im, "PNG") != encode(im, "WEBP", lossless=True)
    assert png.pixel_hash == webp.pixel_hash
    assert np.array_equal(png.pixels, webp.pixels)
    assert preprocess(encode(noise(97, 61, seed=1), "PNG"), PART).pixel_hash != png.pixel_hash
    # the same bytes laid out as another size are another image
    a = PILImage.frombytes("RGB", (4, 6), bytes(range(72)))
    b = PILImage.frombytes("RGB", (6, 4), bytes(range(72)))
    assert images.pixel_hash(a) != images.pixel_hash(b)


# -- hostile input: each a clear error naming the part ------------------------------------------
def test_truncated_png_and_jpeg():
    for fmt in ("PNG", "JPEG"):
        data = encode(noise(200, 200), fmt)
        with pytest.raises(ImageError, match=rf"^{PART.replace('[', '.').replace(']', '.')}: "
                                             rf"the {fmt} image cannot be decoded"):
            preprocess(data[:len(data) // 2], PART)


def test_not_an_image_empty_and_mislabelled():
    with pytest.raises(ImageError, match=r"not a PNG, JPEG, WebP or GIF image"):
        preprocess(b"hello, world, not an image", PART)
    with pytest.raises(ImageError, match=r"the image is empty"):
        preprocess(b"", PART)
    with pytest.raises(ImageError, match=r"media type says image/jpeg but the bytes are PNG"):
        preprocess(encode(noise(8, 8), "PNG"), PART, "image/jpeg")
    with pytest.raises(ImageError, match=r"media type 'image/bmp' is not supported"):
        preprocess(encode(noise(8, 8), "BMP"), PART, "image/bmp")
    with pytest.raises(ImageError, match=r"not a PNG, JPEG, WebP or GIF"):
        preprocess(encode(noise(8, 8), "BMP"), PART)


def test_byte_cap():
    data = encode(noise(64, 64), "PNG")
    with pytest.raises(ImageError, match=rf"the image is {len(data)} bytes, above the limit of 1000"):
        preprocess(data, PART, limits=ImageLimits(max_bytes=1000))


def test_decompression_bomb_header_refused_before_decoding():
    bomb = png_header_only(60000, 60000)   # 3.6 G pixels declared in 80 bytes
    assert len(bomb) < 100
    with pytest.raises(ImageError, match=r"^messages.1..content.2.: the image .*decompression bomb"):
        preprocess(bomb, PART)
    # our limit, not Pillow's: a small image is refused under a small limit
    with pytest.raises(ImageError, match=r"declares 100x100 = 10000 pixels, above the limit of 5000"):
        preprocess(encode(noise(100, 100), "PNG"), PART, limits=ImageLimits(max_decoded_pixels=5000))
    # Pillow's limit is ours too (its check runs first for a header above it)
    assert PILImage.MAX_IMAGE_PIXELS == images.MAX_DECODED_PIXELS_CAP == 1 << 30
    with pytest.raises(ImageError, match=r"^messages.1..content.2.: the image declares 20000x20000 "
                                         r"= 400000000 pixels, above the limit of 33554432 decoded"):
        preprocess(png_header_only(20000, 20000), PART)
    for w, h in ((60000, 60000), (40000, 30000)):   # above Pillow's error / warning threshold
        with pytest.raises(ImageError, match=rf"the image declares {w * h} pixels, above the limit "
                                             rf"of 33554432 decoded pixels \(a decompression bomb"):
            preprocess(png_header_only(w, h), PART)


def test_extreme_shapes():
    with pytest.raises(ImageError, match=r"^messages.1..content.2.: the image is 100000x1: its "
                                         r"aspect ratio 100000.0 is above 200"):
        preprocess(encode(PILImage.new("RGB", (100000, 1)), "PNG"), PART)
    one = preprocess(encode(PILImage.new("RGB", (1, 1), (0, 0, 0)), "PNG"), PART)
    assert (one.resized_width, one.resized_height) == (256, 256)
    assert np.all(one.pixels == -1.0)


def test_limits_check():
    ImageLimits().check()
    with pytest.raises(ValueError, match="image max pixels"):
        ImageLimits(min_pixels=10000, max_pixels=5000).check()
    with pytest.raises(ValueError, match="image max bytes"):
        ImageLimits(max_bytes=0).check()


MEMORY_CHILD = r"""
import io, sys, threading
sys.path.insert(0, sys.argv[1])
from PIL import Image
from echospec.services.common.config import CoordinatorConfig
from echospec.services.coordinator.image_parts import ImageParts, ImagePartError

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2 ** 20

buf = io.BytesIO()
Image.new("RGB", (4096, 4096), (10, 200, 30)).save(buf, "PNG")
data = buf.getvalue()
parts = ImageParts(CoordinatorConfig(), "m.gguf", lambda: type("Cfg", (), {"images": True})())
base = rss_mib()

def one():
    img = parts.image(data, "image/png", "messages[0].parts[0]")
    del img

threads = [threading.Thread(target=one) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(round(rss_mib() - base))
"""


def test_large_images_in_many_threads_leave_no_memory_behind():
    """Each worker thread that preprocessed a large image kept its intermediates in its malloc
    arena (a new-user trial: 8-16 concurrent 5792x5792 images grew a server from 0.3 to 3.3 GB,
    kept while idle); the coordinator gives the freed pages back after each image."""
    import subprocess
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc (Linux) to read the resident set")
    r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(ROOT)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kept = int(r.stdout.strip().splitlines()[-1])
    assert kept < 60, f"{kept} MiB kept after six 4096x4096 images in six threads"
