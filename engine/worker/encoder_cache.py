"""The vision encoder's side of a step: each image's token embeddings, from the encoder cache or
a fresh encoder run, placed at the rows of the step's batch that hold its placeholder tokens.

The cache is keyed by the image's content hash (ipc.messages.ImageInput.content_hash), so an image
sent again, by the same request or another, is encoded once (`num_encoder_runs` counts the runs).
Entries go least recently used first once the cache holds more than `max_num_rows` embedding
rows, except an image some request is partway through (a prefill chunk cut through its tokens):
that one stays until its last token is computed, or its request ends. The image just encoded stays
too, even one larger than the whole cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from engine.worker.step_inputs import ImageSlice, image_rows_to_tensor, pixels_to_tensor

logger = logging.getLogger(__name__)


class EncoderCache:
    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_rows: int) -> None:
        self.model = model  # has embed_images (engine.models.idefics3)
        self.device = device
        self.max_num_rows = max_num_rows
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # content hash -> [num_tokens, hidden]
        self.in_progress: dict[str, set[str]] = {}  # request id -> hashes of images it is partway through
        self.num_encoder_runs = 0

    def embeddings(self, image) -> torch.Tensor:
        """[num image tokens, hidden]: the image's token embeddings, encoded at most once while cached."""
        embeds = self.entries.get(image.content_hash)
        if embeds is not None:
            self.entries.move_to_end(image.content_hash)
            return embeds
        embeds = self.model.embed_images(pixels_to_tensor(image, self.device))  # [num_tokens, hidden]
        self.num_encoder_runs += 1
        self.entries[image.content_hash] = embeds
        # The new entry stays even when it alone is more than the cache holds: the step reads it now,
        # and a chunk cut through it marks it in progress only after this call (an image near Qwen's
        # max_pixels with a lowered --max-num-encoder-input-tokens was encoded again for every chunk).
        self._evict(keep=image.content_hash)
        return embeds

    def step_rows(self, slices: list[ImageSlice]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the batch rows [n], their embeddings [n, hidden]) of the step's image tokens; None: no images."""
        if not slices:
            return None
        parts = []
        for s in slices:
            embeds = self.embeddings(s.image)
            parts.append(embeds[s.first_embed_row : s.first_embed_row + len(s.rows)])  # [len(rows), hidden]
            hashes = self.in_progress.setdefault(s.request_id, set())
            if s.reaches_end:
                hashes.discard(s.image.content_hash)
            else:
                hashes.add(s.image.content_hash)
        return image_rows_to_tensor(slices, self.device), torch.cat(parts)

    def release(self, request_id: str) -> None:
        self.in_progress.pop(request_id, None)

    def _evict(self, keep: str) -> None:
        num_rows = sum(e.shape[0] for e in self.entries.values())
        kept = set().union({keep}, *self.in_progress.values())
        for content_hash in list(self.entries):
            if num_rows <= self.max_num_rows:
                break
            if content_hash not in kept:
                num_rows -= self.entries.pop(content_hash).shape[0]
