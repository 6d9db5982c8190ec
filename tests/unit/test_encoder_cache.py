"""engine.worker.encoder_cache: each image encoded once while it is needed, least recently used out first.

The encoder is a real (tiny) module whose embedding rows are the image's pixels, so a row read from the
cache can be checked against the pixels it came from."""

from __future__ import annotations

import hashlib

import torch

from engine.worker.encoder_cache import EncoderCache
from engine.worker.step_inputs import ImageSlice
from ipc.messages import ImageInput, PixelDType

HIDDEN = 4


class PixelRows(torch.nn.Module):
    """An encoder that makes one embedding row of every HIDDEN pixels."""

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:  # [frames, C, H, W] -> [num_rows, HIDDEN]
        return pixels.reshape(-1, HIDDEN).clone()


def make_image(seed: int, num_rows: int) -> ImageInput:
    pixels = torch.arange(num_rows * HIDDEN, dtype=torch.float32) + 1000 * seed  # [num_rows * HIDDEN]
    data = pixels.numpy().tobytes()
    return ImageInput(data=data, shape=[1, 1, num_rows, HIDDEN], dtype=PixelDType.FLOAT32,
                      content_hash=hashlib.sha256(data).hexdigest(), offset=0, length=num_rows)


def chunk(request_id: str, image: ImageInput, first: int, num_rows: int) -> ImageSlice:
    return ImageSlice(request_id, image, rows=list(range(num_rows)), first_embed_row=first,
                      reaches_end=first + num_rows == image.length)


def test_an_image_larger_than_the_cache_is_encoded_once_across_its_chunks():
    """A chunk cut through an image larger than the whole cache: the next chunk reads the rows it left,
    instead of encoding the image again (once per chunk for a Qwen image near max_pixels)."""
    cache = EncoderCache(PixelRows(), torch.device("cpu"), max_num_rows=8)
    big = make_image(1, 20)
    for first in (0, 8, 16):
        _, embeds = cache.step_rows([chunk("r", big, first, min(8, 20 - first))])
        expected = torch.frombuffer(bytearray(big.data), dtype=torch.float32).view(-1, HIDDEN)[first:first + 8]
        assert torch.equal(embeds, expected)
    assert cache.num_encoder_runs == 1
    cache.release("r")
    cache.step_rows([chunk("s", make_image(2, 4), 0, 4)])  # finished and released: it may go now
    assert big.content_hash not in cache.entries and cache.num_encoder_runs == 2


def test_least_recently_used_goes_first_and_a_repeat_is_not_encoded_again():
    cache = EncoderCache(PixelRows(), torch.device("cpu"), max_num_rows=8)
    a, b, c = make_image(1, 4), make_image(2, 4), make_image(3, 4)
    cache.step_rows([chunk("ra", a, 0, 4)])
    cache.step_rows([chunk("rb", b, 0, 4)])
    cache.step_rows([chunk("ra2", a, 0, 4)])  # a used again: b is now the oldest
    assert cache.num_encoder_runs == 2
    cache.step_rows([chunk("rc", c, 0, 4)])
    assert list(cache.entries) == [a.content_hash, c.content_hash]
