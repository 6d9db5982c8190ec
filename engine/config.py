"""Engine configuration: one record, filled from the offline API or the command line."""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.dtype_policy import AUTO, DTYPE_NAMES

BATCHING_MODES = ("continuous", "static")


@dataclass
class EngineConfig:
    model: str = "smollm2"  # "smollm2" or a local Hugging Face folder
    # Tokens per KV block: small blocks waste less on the last, partly filled block;
    # large ones mean shorter block tables.
    block_size: int = 16
    # Memory for the KV pool when num_kv_blocks is not given; the pool is carved
    # into blocks once, at start-up, and never grows.
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64  # running sequences per step (static: the batch size)
    # Tokens per step, prefill chunks and decodes together: bounds step latency
    # and activation memory; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's own, capped by the KV pool
    batching: str = "continuous"  # or "static": the head-of-line-blocking baseline
    attention_backend: str | None = None  # None: triton on CUDA, cpu (C++ decode kernel) on CPU
    device: str | None = None  # None: cuda when available, else cpu
    # "auto" (or None): bf16 on CUDA and on CPUs with native bf16 matmul (AMX-BF16,
    # AVX512_BF16), else fp32; see engine.dtype_policy. Or float32, bfloat16, float16.
    dtype: str | None = "auto"
    seed: int = 0  # for requests that bring no seed of their own
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    enforce_eager: bool = False  # CUDA: skip CUDA graphs; CPU: no torch.compile even if `compile` is set
    # CPU: torch.compile the forward (engine.compilation): faster steps, a slower first start.
    compile: bool = False
    load_format: str = "auto"  # "dummy": random weights of the checkpoint's shape, for timing
    # CPU: oneDNN-prepacked matmul weights, ~2x faster steps here; the primitive caches
    # that would grow with the variety of step sizes are capped (engine.models.cpu_packing).
    cpu_prepack: bool = True
    # Reuse the KV of full blocks whose whole prefix matches an earlier request's
    # (engine.block_manager); off recomputes every prompt, for comparison.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.dtype not in (None, AUTO, *DTYPE_NAMES):
            raise ValueError(f"dtype must be one of {(AUTO, *DTYPE_NAMES)}, got {self.dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
