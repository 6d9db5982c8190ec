"""The hostile case for images (issue #57): bad image parts on every chat route.

Each body carries one bad image part, in the route's own shape (OpenAI's image_url, the Responses
API's input_image, Anthropic's base64 image block), and must get a 400 in the route's error shape
whose message names the part (`content[`), with no exception text; no core may die. Against a
text-only model a good image is a 400 too ("text-only"), which is one of the cases.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image

from scripts.hostile.adapters import shape_problem
from scripts.hostile.client import Target

TOO_MANY = 65  # past any --limit-mm-per-prompt a hostile run's server has (8 by default)


def png(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a tiny body: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# name -> (media type, base64 data) for inline images, or a URL
INLINE = {
    "not_an_image": ("image/png", b64(b"plain text, no pixels")),
    "truncated_png": ("image/png", b64(png(64, 64)[:60])),
    "30000x30000": ("image/png", b64(header_only_png(30000, 30000))),
    "unsupported_media_type": ("image/svg+xml", b64(b"<svg/>")),
    "bad_base64": ("image/png", "@@not base64@@"),
    "image_to_text_only_model": ("image/png", b64(png())),
}
URLS = {
    "http_url": "http://127.0.0.1:1/cat.png",
    "file_outside_folder": "file:///etc/passwd",
    "file_dot_dot": "file:///tmp/../etc/passwd",
}


def bodies() -> dict[str, tuple[str, dict]]:
    """(route, body) for every case on every route."""
    out = {}
    for name, (media_type, data) in INLINE.items():
        url = f"data:{media_type};base64,{data}"
        out[f"chat {name}"] = ("/v1/chat/completions", chat_body([{"type": "image_url", "image_url": {"url": url}}]))
        out[f"responses {name}"] = ("/v1/responses", responses_body([{"type": "input_image", "image_url": url}]))
        out[f"messages {name}"] = ("/v1/messages", messages_body([{"type": "image", "source": {
            "type": "base64", "media_type": media_type, "data": data}}]))
    for name, url in URLS.items():
        out[f"chat {name}"] = ("/v1/chat/completions", chat_body([{"type": "image_url", "image_url": {"url": url}}]))
        out[f"responses {name}"] = ("/v1/responses", responses_body([{"type": "input_image", "image_url": url}]))
    good = f"data:image/png;base64,{b64(png())}"
    out["chat too_many_images"] = ("/v1/chat/completions", chat_body(
        [{"type": "image_url", "image_url": {"url": good}}] * TOO_MANY))
    return out


def chat_body(parts: list[dict]) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}], "max_tokens": 2}


def responses_body(parts: list[dict]) -> dict:
    return {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, *parts]}],
            "max_output_tokens": 2, "store": False}


def messages_body(parts: list[dict]) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}], "max_tokens": 2}


def bad_images(target: Target) -> dict:
    pids = target.core_pids()
    answers = {}
    for name, (route, body) in bodies().items():
        status, text, _ = target.post(route, body, timeout=60)
        problem = shape_problem(route, status, text)
        if problem is None and "content[" not in text:
            problem = f"the error does not name the part: {text[:200]!r}"
        answers[name] = {"status": status, "problem": problem}
    problems = {name: a for name, a in answers.items() if a["problem"]}
    is_alive = target.health()[0] == 200 and target.core_pids() == pids
    return {"passed": not problems and is_alive, "num_sent": len(answers), "core_alive_same_pid": is_alive,
            "problems": problems}
