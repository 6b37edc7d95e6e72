"""Chat messages given as parts (ChatMessage.parts): text parts joined as the message's content,
image parts decoded, checked and preprocessed (services/text/images.py), then refused while the
served model takes no images.

Memory: an image part is at most ``image_max_bytes`` encoded (and the gRPC message is bounded by
max_message_bytes), its header is checked against ``image_max_decoded_pixels`` before a pixel is
decoded, a request carries at most images.MAX_IMAGES of them, and one image is preprocessed at a
time in the whole coordinator (a lock), its arrays dropped before the next and the freed pages
given back (``release_freed_memory``): a burst of image requests waits instead of holding many
decoded images at once, and leaves no image's worth of memory behind in each worker thread.

With a verifier that takes images (GetConfig ``images``: it loaded a projector), each image part
becomes Qwen3-VL's placeholder in the message's text, ``<|vision_start|>``, one ``<|image_pad|>``
per merged token ((H / 32) * (W / 32)) and ``<|vision_end|>``; the prompt's runs of image pads are
then matched to the images (``image_spans``) and the pixels go to the verifier in [0, 1] (value /
255): the verifier normalises them with its projector's mean and std.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from echospec.services.common.config import CoordinatorConfig
from echospec.services.common.memory import release_freed_memory
from echospec.services.text import images


class ImagePartError(ValueError):
    """A chat message's part that cannot be used (INVALID_ARGUMENT); the message names it."""


def limits_of(config: CoordinatorConfig) -> images.ImageLimits:
    return images.ImageLimits(max_bytes=config.image_max_bytes,
                              max_decoded_pixels=config.image_max_decoded_pixels,
                              min_pixels=config.image_min_pixels,
                              max_pixels=config.image_max_pixels)


VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# the coordinator's pixels are value / 255; the verifier normalises with its projector's mean / std
UNIT_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def image_tokens(img: images.Image) -> int:
    """The merged tokens of one image: (H / 32) x (W / 32) of its resized size."""
    return (img.resized_height // images.QWEN3VL_FACTOR) * (img.resized_width // images.QWEN3VL_FACTOR)


def placeholder(img: images.Image) -> str:
    """The text standing for one image in a Qwen3-VL chat: its merged tokens as image pads."""
    return VISION_START + IMAGE_PAD * image_tokens(img) + VISION_END


def image_spans(ids: list[int], pad_id: int, imgs: list[images.Image]) -> list[int]:
    """The prompt offset of each image's pads: the runs of ``pad_id`` in ``ids``, one per image,
    each as long as its image's merged tokens.

    Raises:
        ImagePartError: the runs do not match the images (an image pad typed in a text part).
    """
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == pad_id:
            j = i
            while j < len(ids) and ids[j] == pad_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    want = [(im.resized_height // images.QWEN3VL_FACTOR) * (im.resized_width // images.QWEN3VL_FACTOR)
            for im in imgs]
    if [n for _, n in runs] != want:
        raise ImagePartError(f"the prompt's {IMAGE_PAD} tokens ({len(runs)} runs) do not match its "
                             f"{len(imgs)} images: a text part holds {IMAGE_PAD}")
    return [off for off, _ in runs]


class ImageParts:
    """The coordinator's handling of message parts (one per coordinator).

    Args:
        verifier_config: () -> a verifier's last GetConfigResponse or None; images are taken
            while it says ``images``.
    """

    def __init__(self, config: CoordinatorConfig, model: str,
                 verifier_config: Callable[[], Any] | None = None):
        self.limits = limits_of(config)
        self.limits.check()
        self._no_projector = (f"{model} is served without a vision projector, so it reads text only"
                              if model else "the model is served without a vision projector, so it "
                                            "reads text only")
        self._verifier_config = verifier_config
        self.mean, self.std = UNIT_MEAN, UNIT_STD
        self._one_at_a_time = threading.Lock()

    @property
    def missing(self) -> str:
        """Why images are refused ("": a verifier takes them, having loaded a projector)."""
        cfg = self._verifier_config() if self._verifier_config is not None else None
        return "" if cfg is not None and getattr(cfg, "images", False) else self._no_projector

    def contents(self, messages: Any) -> list[str]:
        """The text of each ChatMessage (``contents_and_images``' texts)."""
        return self.contents_and_images(messages)[0]

    def contents_and_images(self, messages: Any) -> tuple[list[str], list[images.Image]]:
        """The text of each ChatMessage: its content, or its parts joined (an image part as its
        placeholder); and the preprocessed images in order. The parts' shapes and the number of
        images are checked first, then each image is preprocessed.

        Raises:
            ImagePartError: content and parts both set, a part both text and image, more than
                images.MAX_IMAGES images in the request, a bad image, or any image while the
                served model takes none.
        """
        out, todo, shapes = [], [], []
        for i, m in enumerate(messages):
            if not m.parts:
                out.append(m.content)
                continue
            if m.content:
                raise ImagePartError(f"messages[{i}]: set content or parts, not both")
            texts = []
            for j, p in enumerate(m.parts):
                where = f"messages[{i}].parts[{j}]"
                if p.image and p.text:
                    raise ImagePartError(f"{where}: a part is text or an image, not both")
                if p.image:
                    todo.append((p, where))
                    texts.append(len(todo) - 1)
                    if len(todo) > images.MAX_IMAGES:
                        raise ImagePartError(f"{where}: more than {images.MAX_IMAGES} images in "
                                             f"one request")
                elif p.media_type:
                    raise ImagePartError(f"{where}: media_type {p.media_type!r} is set but the "
                                         f"image bytes are empty")
                else:
                    texts.append(p.text)
            shapes.append((len(out), texts))
            out.append("")
        imgs = [self.image(p.image, p.media_type, where) for p, where in todo]
        for k, texts in shapes:
            out[k] = "".join(placeholder(imgs[t]) if isinstance(t, int) else t for t in texts)
        return out, imgs

    def image(self, data: bytes, media_type: str, where: str) -> images.Image:
        """The preprocessed image of one part (pixels value / 255, float32 [3][H][W]).

        Raises:
            ImagePartError: the image is bad ("<where>: ..."), or the served model takes no
                images.
        """
        with self._one_at_a_time:
            try:
                img = images.preprocess(data, where, media_type, self.limits, self.mean, self.std)
            except images.ImageError as exc:
                raise ImagePartError(str(exc)) from None
            finally:
                # the decoded and resized intermediates are freed by now: give their pages back
                # (else each gRPC worker thread keeps a large image's worth in its malloc arena)
                release_freed_memory()
        missing = self.missing
        if missing:
            raise ImagePartError(f"{where}: the served model takes no images ({missing}); "
                                 f"the image itself is valid ({img.format} {img.width}x{img.height}, "
                                 f"{img.resized_width}x{img.resized_height} after resizing)")
        return img
