"""Chat messages given as parts (ChatMessage.parts): text parts joined as the message's content,
image parts decoded, checked and preprocessed (services/text/images.py), then refused while the
served model takes no images.

Memory: an image part is at most ``image_max_bytes`` encoded (and the gRPC message is bounded by
max_message_bytes), its header is checked against ``image_max_decoded_pixels`` before a pixel is
decoded, a request carries at most images.MAX_IMAGES of them, and one image is preprocessed at a
time in the whole coordinator (a lock), its arrays dropped before the next: a burst of image
requests waits instead of holding many decoded images at once.
"""
from __future__ import annotations

import threading
from typing import Any

from echospec.services.common.config import CoordinatorConfig
from echospec.services.text import images


class ImagePartError(ValueError):
    """A chat message's part that cannot be used (INVALID_ARGUMENT); the message names it."""


def limits_of(config: CoordinatorConfig) -> images.ImageLimits:
    return images.ImageLimits(max_bytes=config.image_max_bytes,
                              max_decoded_pixels=config.image_max_decoded_pixels,
                              min_pixels=config.image_min_pixels,
                              max_pixels=config.image_max_pixels)


class ImageParts:
    """The coordinator's handling of message parts (one per coordinator)."""

    def __init__(self, config: CoordinatorConfig, model: str):
        self.limits = limits_of(config)
        self.limits.check()
        # No served model has a vision projector yet (the vision encoder is not wired in); when one
        # does, `missing` is "" and the preprocessed pixels go to it.
        self.missing = (f"{model} is served without a vision projector, so it reads text only"
                        if model else "the model is served without a vision projector, so it "
                                      "reads text only")
        self.mean, self.std = images.QWEN3VL_MEAN, images.QWEN3VL_STD
        self._one_at_a_time = threading.Lock()

    def contents(self, messages: Any) -> list[str]:
        """The text of each ChatMessage: its content, or its text parts joined. The parts'
        shapes and the number of images are checked first, then each image is preprocessed.

        Raises:
            ImagePartError: content and parts both set, a part both text and image, more than
                images.MAX_IMAGES images in the request, a bad image, or any image while the
                served model takes none.
        """
        out, todo = [], []
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
                    if len(todo) > images.MAX_IMAGES:
                        raise ImagePartError(f"{where}: more than {images.MAX_IMAGES} images in "
                                             f"one request")
                elif p.media_type:
                    raise ImagePartError(f"{where}: media_type {p.media_type!r} is set but the "
                                         f"image bytes are empty")
                else:
                    texts.append(p.text)
            out.append("".join(texts))
        for p, where in todo:
            self.image(p.image, p.media_type, where)
        return out

    def image(self, data: bytes, media_type: str, where: str) -> images.Image:
        """The preprocessed image of one part.

        Raises:
            ImagePartError: the image is bad ("<where>: ..."), or the served model takes no
                images.
        """
        with self._one_at_a_time:
            try:
                img = images.preprocess(data, where, media_type, self.limits, self.mean, self.std)
            except images.ImageError as exc:
                raise ImagePartError(str(exc)) from None
        if self.missing:
            raise ImagePartError(f"{where}: the served model takes no images ({self.missing}); "
                                 f"the image itself is valid ({img.format} {img.width}x{img.height}, "
                                 f"{img.resized_width}x{img.resized_height} after resizing)")
        return img
