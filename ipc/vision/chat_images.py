"""Image parts of chat messages, on every route's shape, taken out in order and replaced by the
`{"type": "image"}` part chat templates render as the model's image marker:

    OpenAI chat       {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    Responses API     {"type": "input_image", "image_url": "data:image/png;base64,..."}
    Anthropic         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "..."}}
    offline LLM.chat  {"type": "image", "image": <a PIL image>}, or any of the above
"""

from __future__ import annotations

from typing import Any

from ipc.vision.image_decode import ImageLimits, decode_base64_image, load_image_url

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def extract_images(messages: list[dict[str, Any]], limits: ImageLimits, max_images: int | None = None
                   ) -> tuple[list[dict[str, Any]], list]:
    """(the messages with each image part as {"type": "image"}, the decoded PIL images in order);
    ValueError naming the part (messages[i].content[j]) on a bad one or past `max_images`."""
    images: list = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            what = f"messages[{i}].content[{j}]"
            if max_images is not None and len(images) >= max_images:
                raise ValueError(f"{what}: more than {max_images} images in one prompt (--limit-mm-per-prompt)")
            images.append(_decode_part(part, limits, what))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _decode_part(part: dict, limits: ImageLimits, what: str):
    kind = part["type"]
    if kind == "image" and "source" in part:  # Anthropic
        source = part["source"]
        if not isinstance(source, dict):
            raise ValueError(f"{what}.source must be an object")
        if source.get("type") == "base64":
            return decode_base64_image(str(source.get("media_type", "")), str(source.get("data", "")), limits, what)
        if source.get("type") == "url":
            return load_image_url(str(source.get("url", "")), limits, what)
        raise ValueError(f"{what}.source.type must be 'base64' or 'url'")
    if kind == "image" and part.get("image") is not None:  # offline: a PIL image
        image = part["image"]
        if not hasattr(image, "convert"):
            raise ValueError(f"{what}.image must be a PIL image")
        return image.convert("RGB")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise ValueError(f"{what}: an image part needs an image_url (a data: URL)")
    return load_image_url(url, limits, what)
