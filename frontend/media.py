"""A chat request's images on the server: taken out of the messages (every route's part shapes,
ipc.vision.chat_images), decoded within the server's bounds, and spliced into the prompt's token
ids by the model's own processor (ipc.vision.processor), off the event loop. Bad input is an
InvalidRequestError (400) naming the part; nothing reaches a core.

    --limit-mm-per-prompt '{"image": N}'   images per prompt (vLLM's flag)
    --max-image-bytes, --max-image-pixels   per image, the pixels read from the header before decoding
    --allowed-local-media-path DIR          the one folder file:// URLs may read (no '..')
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from functools import lru_cache

from frontend.errors import InvalidRequestError
from ipc.messages import ImageInput
from ipc.vision.chat_images import extract_images
from ipc.vision.image_decode import ImageLimits
from ipc.vision.processor import VisionProcessor

DEFAULT_IMAGES_PER_PROMPT = 8


@dataclass(frozen=True)
class MediaOptions:
    max_images: int = DEFAULT_IMAGES_PER_PROMPT
    limits: ImageLimits = field(default_factory=ImageLimits)


def parse_limit_mm_per_prompt(value: str | None) -> int:
    """--limit-mm-per-prompt's JSON ({"image": N}) -> N."""
    if value is None:
        return DEFAULT_IMAGES_PER_PROMPT
    try:
        limits = json.loads(value)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 4}}', got {value!r}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 0), int) \
            or limits.get("image", 0) < 0:
        raise ValueError(f"--limit-mm-per-prompt takes {{\"image\": N}} with N >= 0, got {value!r}")
    return limits.get("image", DEFAULT_IMAGES_PER_PROMPT)


@lru_cache(maxsize=4)
def _processor(model_folder: str, tokenizer) -> VisionProcessor | None:
    return VisionProcessor.from_folder(model_folder, tokenizer)


def take_images(messages: list[dict], options: MediaOptions, model_folder: str, tokenizer) -> tuple[list[dict], list]:
    """(the messages with image parts as {"type": "image"}, the decoded images); a 400 naming a bad part."""
    try:
        messages, images = extract_images(messages, options.limits, options.max_images)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if images and _processor(model_folder, tokenizer) is None:
        where = next(f"messages[{i}].content[{j}]" for i, m in enumerate(messages) if isinstance(m.get("content"), list)
                     for j, part in enumerate(m["content"]) if part == {"type": "image"})
        raise InvalidRequestError(f"{where}: this model is text-only: it takes no images (image parts are for "
                                  "vision-language models such as SmolVLM)")
    return messages, images


async def expand_images(token_ids: list[int], images: list, model_folder: str,
                        tokenizer) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image's tokens in place of its marker, and the images' wire records."""
    try:
        return await asyncio.to_thread(_processor(model_folder, tokenizer).expand, token_ids, images)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
