"""A vision-language checkpoint's tensors: the vision tower's (and its connector's) copied into the
model by their own names, the text model's renamed to model.X and handed to the decoder's loader.
Idefics3 and Qwen2.5-VL load this way; only their prefixes differ."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def load_vision_language_weights(load_text: Callable, weights: Iterable, into, vision_params: dict[str, torch.Tensor],
                                 vision_prefixes: tuple[str, ...], text_prefix: str) -> set[str]:
    """`load_text` is the decoder's load_weights (it checks the text model's tensors are all there);
    `vision_params` the model's vision parameters by name. Returns every loaded name."""
    loaded_vision: set[str] = set()

    def text_weights():
        for hf_name, tensor in weights:
            if hf_name.startswith(vision_prefixes):
                name = hf_name.removeprefix("model.")
                if name not in vision_params:
                    raise KeyError(f"unexpected weight {hf_name!r}")
                with torch.no_grad():
                    vision_params[name].copy_(tensor[:])
                loaded_vision.add(name)
            else:
                yield hf_name.replace(text_prefix, "model.", 1), tensor

    loaded = load_text(text_weights(), into)
    missing = set(vision_params) - loaded_vision
    if missing and into is None:
        raise ValueError(f"vision weights missing from the checkpoint: {sorted(missing)[:5]}")
    return loaded | loaded_vision
