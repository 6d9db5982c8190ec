"""`--vision-quantization int8`: a vision tower's linears as dynamic int8 matmuls (fbgemm).

A vision encoder is one large prefill: SigLIP-B/16 at 512 px is 1024 patches through 12 layers,
about 174 GFLOP of linears, compute-bound. fbgemm's dynamic quantized linear runs it on AVX2's
vpmaddubsw (AVX512_VNNI's vpdpbusd where the CPU has it): the weights int8 with a scale per output
channel, each call's activations quantized per tensor, int32 accumulation, fp32 out. It is the
encoder only: the text model keeps its own `--quantization` (or none), and the connector (one small
matmul on 64 rows a frame) stays in fp32.

Without VNNI, vpmaddubsw sums pairs of u8 x s8 products into int16, which can saturate; the
activations are then quantized to 7 bits (`reduce_range`), as torch's quantize_dynamic does on x86.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The attribute a vision-language model keeps its tower in: Idefics3's SigLIP, Qwen2.5-VL's ViT.
VISION_TOWERS = ("vision_model", "visual")


class DynamicInt8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per call (fbgemm's prepacked weight)."""

    def __init__(self, linear: nn.Linear, reduce_range: bool) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out], symmetric
        with warnings.catch_warnings():
            # torch marks its quantized tensors deprecated; fbgemm's prepack still takes only them.
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales.double(), torch.zeros_like(scales, dtype=torch.long),
                                                 0, torch.qint8)
            bias = linear.bias.detach().float() if linear.bias is not None else None
            self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_range = reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).contiguous(), self.packed,
                                                 self.reduce_range)  # [rows, out]
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (fbgemm dynamic)"


def check_vision_quantization_supported(scheme: str, device_type: str) -> None:
    """ValueError naming the flag unless this torch and device can run it (EngineConfig has checked the name)."""
    if device_type != "cpu":
        raise ValueError(f"vision_quantization={scheme!r} runs on the CPU only (fbgemm's int8 matmuls)")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"vision_quantization={scheme!r} needs torch built with fbgemm (x86); this one has "
                         f"{torch.backends.quantized.supported_engines}")


def quantize_vision_tower(model: nn.Module, reduce_range: bool) -> int:
    """Swap every nn.Linear of the model's vision tower for a DynamicInt8Linear; how many were swapped
    (0 for a text-only model)."""
    torch.backends.quantized.engine = "fbgemm"  # the packed weights are fbgemm's
    count = 0
    for attr in VISION_TOWERS:
        tower = getattr(model, attr, None)
        if not isinstance(tower, nn.Module):
            continue
        for module in list(tower.modules()):
            if hasattr(module, "fuse_qkv"):
                module.fuse_qkv()
        for module in list(tower.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, DynamicInt8Linear(child, reduce_range))
                    count += 1
    if count:
        logger.info("vision encoder: %d linears in int8 (fbgemm dynamic%s)", count,
                    ", 7-bit activations: no VNNI" if reduce_range else "")
    return count
