"""torch.compile of the model's forward on the CPU (opt-in: `EngineConfig.compile`, `--compile`).

Inductor's C++ backend fuses the element-wise work between the matmuls (RMSNorm,
residual adds, rotary, SiLU x up) into a few loops instead of one pass over
memory per op, and, with `freezing`, prepacks the matmul weights for oneDNN
itself (so the engine's own prepacking is skipped). The number of tokens per
step is dynamic: one graph serves every step size (plus one for single-token
steps, which dynamo specializes), so steady state never recompiles.

Attention stays out of the graph as the opaque custom op `tokenloom::paged_attention`:
the backends plan per step from Python lists and call a C++ kernel, none of
which dynamo should trace. A custom op takes only tensors and scalars, so the
step's backend (prepared by the model runner) and KV pool reach it through
`attention_step(...)`, set by the model runner around each compiled forward
(vLLM's forward context does the same). This is the module's one piece of global state.

Inductor's caches live under <tokenloom cache>/inductor/<cpu key> (its C++ is
built for the host's instruction set).

Why opt-in: the warm-up takes minutes at every start, and on this project's CPU it did
not beat eager bf16 on bench_offline (figures: docs/performance.md, "torch.compile on
the CPU"). Eager with prepacked matmuls stays the default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, KVCache
from engine.attention.metadata import AttentionMetadata
from engine.cpu.host import cache_dir, cpu_key
from engine.models.attention import COMPILED

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# The user's choice, read at import (the model runner imports this module): later in the
# process torch fills the variable in with its own default (/tmp/torchinductor_$USER),
# loading the C++ kernels among other things.
_user_cache_dir = os.environ.get(INDUCTOR_CACHE_ENV)


@dataclass
class _AttentionStep:
    backend: AttentionBackend  # prepared for the step
    kv_caches: list[KVCache]


_step: _AttentionStep | None = None


@contextlib.contextmanager
def attention_step(backend: AttentionBackend, kv_caches: list[KVCache]):
    """Make the step's prepared backend and KV pool visible to `paged_attention` for one forward."""
    global _step
    _step = _AttentionStep(backend, kv_caches)
    try:
        yield
    finally:
        _step = None


@torch.library.custom_op("tokenloom::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    layer_index: int,
    scale: float,
    window: int,  # the layer's sliding window; 0: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Store the step's K/V into layer `layer_index`'s paged cache, then attend (inside `attention_step`)."""
    if _step is None:
        raise RuntimeError("tokenloom::paged_attention called outside attention_step()")
    kv_cache = _step.kv_caches[layer_index]
    _step.backend.store_kv(key, value, kv_cache)
    return _step.backend.forward(query, key, value, kv_cache, scale, window).contiguous()


@paged_attention.register_fake
def _(query, key, value, layer_index, scale, window):
    return torch.empty_like(query)


def inductor_cache_dir() -> str:
    """Where compiled code goes: $TORCHINDUCTOR_CACHE_DIR if the user set it, else per CPU in tokenloom's cache."""
    return _user_cache_dir or str(cache_dir() / "inductor" / cpu_key())


def compile_forward(model: torch.nn.Module):
    """The model's forward (input_ids, positions) -> hidden, compiled with the token count dynamic."""
    import torch._inductor.config as inductor_config

    os.environ[INDUCTOR_CACHE_ENV] = inductor_cache_dir()
    inductor_config.freezing = True  # weights are constants: prepacked, folded, never re-read as inputs

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions, None, COMPILED)

    return torch.compile(forward, dynamic=True, fullgraph=True)


def warm_up(compiled, model_runner) -> float:
    """Compile (or load from the cache) both graphs, single-token and multi-token steps; returns seconds.

    Runs two throwaway steps on block 0 of the pool: a 2-token prefill, then one decode."""
    device = model_runner.device
    block_size = model_runner.block_size
    start = time.perf_counter()
    for num_tokens, seq_len in ((2, 2), (1, 3)):
        positions = list(range(seq_len - num_tokens, seq_len))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, -(-seq_len // block_size), dtype=torch.int32, device=device),
            max_query_len=num_tokens,
            max_seq_len=seq_len,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[seq_len],
        )
        model_runner.backend.prepare(metadata)
        with torch.inference_mode(), attention_step(model_runner.backend, model_runner.kv_caches):
            compiled(torch.zeros(num_tokens, dtype=torch.int64, device=device), torch.tensor(positions, device=device))
    for k_cache, v_cache in model_runner.kv_caches:  # leave the pool as it was
        k_cache[0].zero_()
        v_cache[0].zero_()
    return time.perf_counter() - start
