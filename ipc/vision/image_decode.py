"""Images from a request, bounded: a `data:image/...;base64,` URL, a `file://` path under the one
folder the server allows (--allowed-local-media-path), or a PIL image given offline. This server
fetches nothing: an http(s) URL is refused. Every failure is a ValueError whose message names what
was wrong, for a 400.

Bounds: the encoded bytes (max_bytes), the decoded pixels (max_pixels, read from the header before
any pixel is decoded, so a small file that expands to a huge image, a decompression bomb, is refused
unread), and the formats PIL may open (no PSD, EPS or other exotic decoders).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from PIL import Image

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF",
               "image/bmp": "BMP"}
FORMATS = tuple(sorted(set(MEDIA_TYPES.values())))


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width x height; 30000 x 30000 is far past it
    allowed_local_media_path: str | None = None  # file:// URLs only under this folder


def decode_image_bytes(data: bytes, limits: ImageLimits, what: str = "image") -> Image.Image:
    """The decoded RGB image, or ValueError naming `what`."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"{what}: {len(data)} bytes, more than the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:  # PIL's own guard, at twice its MAX_IMAGE_PIXELS
        raise ValueError(f"{what}: more pixels than the limit of {limits.max_pixels} ({e})") from None
    except (OSError, ValueError):  # PIL's message holds the buffer's repr: ours says it plainly
        raise ValueError(f"{what}: not an image this server reads ({', '.join(FORMATS)})") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ValueError(f"{what}: {width} x {height} pixels, more pixels than the limit of {limits.max_pixels}")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, Image.DecompressionBombError, ValueError, SyntaxError):
        raise ValueError(f"{what}: the image data is broken or truncated") from None


def decode_base64_image(media_type: str, payload: str, limits: ImageLimits, what: str = "image") -> Image.Image:
    """An image given as base64 with its media type (Anthropic's source, or a data URL's parts)."""
    if media_type.lower() not in MEDIA_TYPES:
        raise ValueError(f"{what}: media type {media_type!r} is not supported (supported: {', '.join(MEDIA_TYPES)})")
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ValueError(f"{what}: more than the limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: the base64 data is not valid") from None
    return decode_image_bytes(data, limits, what)


def load_image_url(url: str, limits: ImageLimits, what: str = "image") -> Image.Image:
    """An image_url's image: data: or file:// (under the allowed folder); anything else is refused."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{what}: url must be a non-empty string")
    if url.startswith("data:"):
        header, sep, payload = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if not sep or encoding.lower() != "base64":
            raise ValueError(f"{what}: a data URL must be data:image/<type>;base64,<data>")
        return decode_base64_image(media_type, payload, limits, what)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return decode_image_bytes(_read_local_file(url, limits, what), limits, what)
    if scheme in ("http", "https"):
        raise ValueError(f"{what}: this server fetches no URLs; send the image inline as a data:image/...;base64 URL")
    raise ValueError(f"{what}: URL scheme {scheme or url[:16]!r} is not supported (data: or file://)")


def _read_local_file(url: str, limits: ImageLimits, what: str) -> bytes:
    if limits.allowed_local_media_path is None:
        raise ValueError(f"{what}: file:// URLs need the server started with --allowed-local-media-path")
    path = unquote(urlparse(url).path)
    if ".." in path.split("/"):
        raise ValueError(f"{what}: a file:// path may not contain '..'")
    root = os.path.realpath(limits.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"{what}: {path} is outside the allowed media folder")
    try:
        if os.path.getsize(real) > limits.max_bytes:
            raise ValueError(f"{what}: the file is larger than the limit of {limits.max_bytes} bytes")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
