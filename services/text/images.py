"""Image parts of a chat message: decode, check, resize and normalise for a vision encoder.

Pure (no I/O, no service state): bytes in, a checked ``Image`` out, or an ``ImageError`` whose
message starts with the part's path (``messages[1].content[2]: ...``), which the gateway answers
with HTTP 400 and the coordinator with INVALID_ARGUMENT.

The steps, in order:

1. the byte size against ``ImageLimits.max_bytes``;
2. the format (PNG, JPEG, WebP, GIF) from the bytes' own signature, and the declared media type
   when one is given must agree with it;
3. the pixel count from the header, before any pixel is decoded, against
   ``ImageLimits.max_decoded_pixels`` (our decompression-bomb limit; Pillow's own
   ``Image.MAX_IMAGE_PIXELS`` is set by us to MAX_DECODED_PIXELS_CAP, the highest a server may
   configure, and its DecompressionBombError/Warning are reported as the same error);
4. decoding the first frame (an animated GIF, WebP or PNG gives its first frame) and converting
   it to 8-bit RGB: alpha is composited over white, palette, grey, CMYK and 16-bit images are
   converted; the hash of these pixels (``pixel_hash``) keys the image in the prefix cache;
5. Qwen2-VL / Qwen3-VL's ``smart_resize``: both sides a multiple of ``factor`` (patch 16 x merge
   2 = 32 for Qwen3-VL), the pixel count within [min_pixels, max_pixels], the aspect ratio kept as
   closely as possible; an aspect ratio above 200 is refused, as the model's processor does;
6. bicubic resize, scale to [0, 1], normalise with the projector's mean and std, float32 laid out
   [3][H][W].
"""
from __future__ import annotations

import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image as PILImage
from PIL import ImageFile, UnidentifiedImageError

# Qwen3-VL's image processor (preprocessor_config.json): patch 16, spatial merge 2, so both sides
# are multiples of 32; size.shortest_edge / size.longest_edge are pixel counts, 256*256 and 4096*4096.
QWEN3VL_FACTOR = 32
QWEN3VL_MIN_PIXELS = 256 * 256
QWEN3VL_MAX_PIXELS = 4096 * 4096
QWEN3VL_MEAN = (0.5, 0.5, 0.5)
QWEN3VL_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
"""Encoded bytes of one image at most (the gRPC message and the HTTP body are 4 MiB by default
too, so a larger image could not arrive anyway)."""
MAX_IMAGES = 16
"""Image parts of one request at most."""
DEFAULT_MAX_DECODED_PIXELS = 2 * QWEN3VL_MAX_PIXELS
"""Pixels of a decoded image at most (width x height from its header, checked before decoding):
33.5 M pixels, 100 MB as RGB. A few KB of PNG or GIF can declare gigapixels."""

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
               "image/webp": "WEBP", "image/gif": "GIF"}
"""Media types taken, and the Pillow format each names."""

MAX_DECODED_PIXELS_CAP = 1 << 30
"""The highest max_decoded_pixels a server may be configured with, and Pillow's own bomb limit
(Image.MAX_IMAGE_PIXELS, set here instead of Pillow's default): Pillow checks it as it opens a
file (its warning is taken as an error here), so it must not be below the configured limit; the
configured limit is checked right after, from the header, before any pixel is decoded."""
PILImage.MAX_IMAGE_PIXELS = MAX_DECODED_PIXELS_CAP
ImageFile.LOAD_TRUNCATED_IMAGES = False   # a truncated file is an error, never grey padding


class ImageError(ValueError):
    """An image part that cannot be used; the message names the part."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    min_pixels: int = QWEN3VL_MIN_PIXELS
    max_pixels: int = QWEN3VL_MAX_PIXELS
    factor: int = QWEN3VL_FACTOR

    def check(self) -> None:
        """Raises ValueError naming the setting that cannot work."""
        if self.max_bytes < 1:
            raise ValueError(f"image max bytes must be >= 1, got {self.max_bytes}")
        if self.factor < 1:
            raise ValueError(f"image factor must be >= 1, got {self.factor}")
        if self.min_pixels < 1:
            raise ValueError(f"image min pixels must be >= 1, got {self.min_pixels}")
        if self.max_pixels < max(self.min_pixels, self.factor * self.factor):
            raise ValueError(f"image max pixels ({self.max_pixels}) must be >= image min pixels "
                             f"({self.min_pixels}) and >= {self.factor}x{self.factor}")
        if not 1 <= self.max_decoded_pixels <= MAX_DECODED_PIXELS_CAP:
            raise ValueError(f"image max decoded pixels must be in [1, {MAX_DECODED_PIXELS_CAP}], "
                             f"got {self.max_decoded_pixels}")


@dataclass(frozen=True)
class Image:
    """A decoded, checked image and what the vision encoder takes."""

    format: str             # PNG, JPEG, WEBP, GIF
    width: int              # decoded size
    height: int
    resized_width: int      # after smart_resize: multiples of the factor
    resized_height: int
    pixel_hash: str         # sha256 hex of the decoded RGB pixels and their size
    pixels: np.ndarray      # float32 [3][resized_height][resized_width], normalised


def smart_resize(height: int, width: int, factor: int = QWEN3VL_FACTOR,
                 min_pixels: int = QWEN3VL_MIN_PIXELS,
                 max_pixels: int = QWEN3VL_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) for the model: both multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible (Qwen2-VL's rule).

    Raises:
        ValueError: the aspect ratio is above 200, or a side is < 1.
    """
    if height < 1 or width < 1:
        raise ValueError(f"the image is {width}x{height}: a side is empty")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"the image is {width}x{height}: its aspect ratio {ratio:.1f} is above "
                         f"{MAX_ASPECT_RATIO}, which the model's processor refuses")
    # a side under factor / 2 rounds to 0: the area is then below min_pixels (>= 1) and the
    # scaling up below gives it at least one factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def _to_rgb(im: PILImage.Image) -> PILImage.Image:
    """8-bit RGB: alpha over white, palette / grey / CMYK converted, 16-bit and float grey scaled."""
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or (a.size and a.max() > 255) else 255.0
        im = PILImage.fromarray(np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "La", "RGBa", "PA"):
        rgba = im.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def pixel_hash(rgb: PILImage.Image) -> str:
    """sha256 of an RGB image's size and pixels: the same pixels give the same hash whatever the
    file format or its encoder's choices."""
    h = hashlib.sha256(f"rgb {rgb.width}x{rgb.height}\n".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def _open(data: bytes, part: str, media_type: str, limits: ImageLimits) -> tuple[str, PILImage.Image]:
    """(format, the opened image): header read and checked, no pixel decoded yet."""
    if not data:
        raise ImageError(f"{part}: the image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{part}: the image is {len(data)} bytes, above the limit of "
                         f"{limits.max_bytes} bytes")
    declared = None
    if media_type:
        declared = MEDIA_TYPES.get(media_type.strip().lower())
        if declared is None:
            raise ImageError(f"{part}: media type {media_type!r} is not supported (supported: "
                             f"image/png, image/jpeg, image/webp, image/gif)")
    fmt = _sniff(data)
    if fmt is None:
        raise ImageError(f"{part}: the bytes are not a PNG, JPEG, WebP or GIF image (they start "
                         f"with {data[:8].hex()})")
    if declared is not None and declared != fmt:
        raise ImageError(f"{part}: the media type says {media_type} but the bytes are {fmt}")
    im = _guard(part, fmt, lambda: PILImage.open(io.BytesIO(data), formats=[fmt]), limits)
    w, h = im.size
    if w * h > limits.max_decoded_pixels:
        im.close()
        raise ImageError(f"{part}: the image declares {w}x{h} = {w * h} pixels, above the limit "
                         f"of {limits.max_decoded_pixels} decoded pixels (a decompression bomb, "
                         f"or simply too large)")
    if w < 1 or h < 1:
        im.close()
        raise ImageError(f"{part}: the image is {w}x{h}: a side is empty")
    return fmt, im


def _guard(part: str, fmt: str, step, limits: ImageLimits):
    """``step()``, Pillow's failures turned into an ImageError naming the part."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            return step()
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as exc:
        # Pillow checks its own limit (MAX_DECODED_PIXELS_CAP, >= the configured one) as it
        # opens the file, before our check can run; its message has the pixel count, not the sides
        m = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{m.group(1)} pixels" if m else "too many pixels"
        raise ImageError(f"{part}: the image declares {size}, above the limit of "
                         f"{limits.max_decoded_pixels} decoded pixels (a decompression bomb, or "
                         f"simply too large)") from None
    except UnidentifiedImageError:
        # Pillow's message names its in-memory file object ("<_io.BytesIO object at 0x...>")
        raise ImageError(f"{part}: the {fmt} image cannot be decoded: its header is not one "
                         f"Pillow can read (a zero-size, corrupt or truncated image)") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, MemoryError) as exc:
        raise ImageError(f"{part}: the {fmt} image cannot be decoded: "
                         f"{exc or type(exc).__name__}") from None


def decode(data: bytes, part: str, media_type: str = "",
           limits: ImageLimits = ImageLimits()) -> tuple[str, PILImage.Image]:
    """(format, 8-bit RGB first frame) of an encoded image.

    Raises:
        ImageError: "<part>: ..." for an empty, too large, unsupported, mislabelled, oversized
            (bomb) or undecodable image.
    """
    fmt, im = _open(data, part, media_type, limits)
    with im:
        def first_frame_rgb() -> PILImage.Image:
            im.seek(0)
            im.load()
            rgb = _to_rgb(im)
            rgb.load()
            return rgb
        return fmt, _guard(part, fmt, first_frame_rgb, limits)


def check(data: bytes, part: str, media_type: str = "",
          limits: ImageLimits = ImageLimits()) -> tuple[str, int, int]:
    """(format, width, height) from the header alone: the checks that need no decoding (size,
    media type, format, the bomb limit, the aspect ratio), cheap enough for the gateway's event
    loop. ``preprocess`` decodes and finds what this cannot (truncated or corrupt pixel data).

    Raises:
        ImageError: "<part>: ..." naming what is wrong.
    """
    fmt, im = _open(data, part, media_type, limits)
    w, h = im.size
    im.close()
    try:
        smart_resize(h, w, limits.factor, limits.min_pixels, limits.max_pixels)
    except ValueError as exc:
        raise ImageError(f"{part}: {exc}") from None
    return fmt, w, h


def preprocess(data: bytes, part: str, media_type: str = "",
               limits: ImageLimits = ImageLimits(), mean: tuple = QWEN3VL_MEAN,
               std: tuple = QWEN3VL_STD) -> Image:
    """Decode, check, resize and normalise one image part (the module's docstring has the steps).

    Raises:
        ImageError: "<part>: ..." naming what is wrong.
    """
    fmt, rgb = decode(data, part, media_type, limits)
    try:
        rh, rw = smart_resize(rgb.height, rgb.width, limits.factor, limits.min_pixels,
                              limits.max_pixels)
    except ValueError as exc:
        raise ImageError(f"{part}: {exc}") from None
    width, height = rgb.size
    resized = rgb if (rw, rh) == rgb.size else rgb.resize((rw, rh), PILImage.Resampling.BICUBIC)
    digest = pixel_hash(rgb)
    planes = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)
    del rgb, resized
    # one float32 array, [3][H][W], worked on in place (at 4096 x 4096 it is 201 MB)
    a = np.ascontiguousarray(planes, dtype=np.float32)
    del planes
    a *= np.float32(1.0 / 255.0)
    a -= np.asarray(mean, dtype=np.float32)[:, None, None]
    a /= np.asarray(std, dtype=np.float32)[:, None, None]
    return Image(format=fmt, width=width, height=height, resized_width=rw,
                 resized_height=rh, pixel_hash=digest, pixels=a)
