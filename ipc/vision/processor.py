"""A vision-language model's prompt processing, torch-free: each image's frames (idefics3.py, qwen2_vl.py),
its marker in the prompt (`<image>`; Qwen2.5-VL's `<|image_pad|>`) expanded into the model's placeholder
tokens, and the wire records
(ipc.messages.ImageInput) that tell the core which prompt positions each image fills.

The frontend and the offline LLM both call `VisionProcessor.process`, so a prompt tokenizes the same
on either path. The content hash (SHA-256 of the frames' dtype, shape and bytes) keys the core's
encoder cache and enters the prefix cache's block keys (engine.core.request).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ipc.messages import ImageInput, PixelDType
from ipc.vision.idefics3 import Idefics3Preprocessing, image_prompt_string
from ipc.vision.qwen2_vl import IMAGE_PAD, Qwen2VLPreprocessing

IMAGE_MARKER = "<image>"  # where a prompt (or a chat template's output) puts an image
QWEN_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
VISION_ARCHITECTURES = ("Idefics3ForConditionalGeneration", *QWEN_VL_ARCHITECTURES)


class VisionProcessor:
    def __init__(self, tokenizer, preprocessing: Idefics3Preprocessing | Qwen2VLPreprocessing, tokens_per_frame: int,
                 image_token_id: int) -> None:
        self.tokenizer = tokenizer  # ipc.text.tokenizer.Tokenizer
        self.preprocessing = preprocessing
        self.tokens_per_frame = tokens_per_frame
        self.image_token_id = image_token_id

    @classmethod
    def from_folder(cls, folder: str | Path, tokenizer) -> "VisionProcessor | None":
        """The folder's processor, None for a text-only model."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        architecture = (config.get("architectures") or [""])[0]
        if architecture not in VISION_ARCHITECTURES:
            return None
        path = folder / "preprocessor_config.json"
        preprocessor_config = json.loads(path.read_text()) if path.is_file() else {}
        if architecture in QWEN_VL_ARCHITECTURES:  # dynamic resolution: tokens per image, not per frame
            return cls(tokenizer, Qwen2VLPreprocessing.from_dict(preprocessor_config), 0, config["image_token_id"])
        vision = config["vision_config"]
        scale = config.get("scale_factor", 2)
        tokens_per_frame = (vision["image_size"] // vision["patch_size"]) ** 2 // scale ** 2
        preprocessing = Idefics3Preprocessing.from_dict(preprocessor_config)
        return cls(tokenizer, preprocessing, tokens_per_frame, config["image_token_id"])

    def process(self, text: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids, the images' records) for `text` holding one IMAGE_MARKER per image (PIL images)."""
        return self.expand(self.tokenizer.encode(text, add_special_tokens=add_special_tokens), images)

    def expand(self, token_ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """Each image's marker token (the model's image token, as IMAGE_MARKER tokenizes) in `token_ids`
        replaced by the tokens standing for its frames; (the token ids, the images' records). The expansion
        is special tokens and newlines only, which tokenize apart from their neighbours, so this is what
        tokenizing the expanded text whole gives (transformers' Idefics3Processor)."""
        markers = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(markers) != len(images):
            raise ValueError(f"the prompt marks {len(markers)} images with {self.marker} but {len(images)} "
                             "were given")
        expansions = [self._expansion(image) for image in images]
        expanded, start = [], 0
        for marker, (_, image_tokens) in zip(markers, expansions):
            expanded += token_ids[start:marker]
            expanded += image_tokens
            start = marker + 1
        expanded += token_ids[start:]
        return expanded, self.image_records(expanded, [f for f, _ in expansions])

    @property
    def marker(self) -> str:
        return IMAGE_PAD if isinstance(self.preprocessing, Qwen2VLPreprocessing) else IMAGE_MARKER

    def _expansion(self, image) -> tuple:
        """(uint8 frames, the token ids standing for the image in the prompt)."""
        if isinstance(self.preprocessing, Qwen2VLPreprocessing):  # <|image_pad|> x N, between the template's
            frames = self.preprocessing.frames(image)            # <|vision_start|> and <|vision_end|>
            return frames, [self.image_token_id] * self.preprocessing.num_image_tokens(frames)
        frames, rows, cols = self.preprocessing.frames(image)
        return frames, self.tokenizer.encode(image_prompt_string(rows, cols, self.tokens_per_frame),
                                             add_special_tokens=False)

    def num_image_tokens(self, frames) -> int:
        if isinstance(self.preprocessing, Qwen2VLPreprocessing):
            return self.preprocessing.num_image_tokens(frames)
        return len(frames) * self.tokens_per_frame

    def image_records(self, token_ids: list[int], frames: list) -> list[ImageInput]:
        """Each image's record: its frames (uint8 [F, 3, H, W]) and the range from its first placeholder token
        to its last, taking the prompt's placeholders in order, num_image_tokens(frames) an image."""
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        wanted = sum(self.num_image_tokens(f) for f in frames)
        if len(positions) != wanted:
            raise ValueError(f"the prompt holds {len(positions)} image tokens; its images make {wanted}")
        records, used = [], 0
        prep = self.preprocessing
        for image_frames in frames:
            count = self.num_image_tokens(image_frames)
            first, last = positions[used], positions[used + count - 1]
            used += count
            shape = list(image_frames.shape)
            data = image_frames.tobytes()
            digest = hashlib.sha256(f"uint8{shape}".encode() + data).hexdigest()
            records.append(ImageInput(data, shape, PixelDType.UINT8, digest, first, last - first + 1,
                                      prep.rescale_factor, list(prep.image_mean), list(prep.image_std)))
        return records
