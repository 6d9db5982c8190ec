"""tokenloom's engine: paged KV cache, continuous batching, our own model code.

`from engine import LLM, SamplingParams` is the offline API (and `LoRARequest`, vLLM's
`vllm.lora.request.LoRARequest`). Names load
lazily so that torch-free parts (`engine.loader.model_files`) stay torch-free.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "PoolingParams", "LoRARequest", "EngineConfig", "EngineCore"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ipc.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from ipc.pooling_params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from ipc.messages import LoRARequest

        return LoRARequest
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "EngineCore":
        from engine.loop.engine_core import EngineCore

        return EngineCore
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
