"""The engine core's configuration, declared once: the record and the command-line flags built from it.

`EngineConfig` is what the offline `LLM(**kwargs)` and the core process fill in. The
frontend starts cores with flags, so the flags are part of the contract between the
two processes: both parsers (`engine.loop.core_process` and `frontend.server_args`) add
them with `add_engine_args`, one flag per field, and the frontend turns what the user
gave back into a core's argv with `engine_argv`. No torch here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields

from ipc.lora_adapter import check_max_lora_rank
from ipc.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct, converted by engine.loader.model_files
AUTO_DTYPE = "auto"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
BATCHING_MODES = ("continuous", "static", "static-padded")
QUANTIZATIONS = ("int8", "int4")
VISION_QUANTIZATIONS = ("int8",)
RUNNERS = ("generate", "pooling")  # vLLM's --runner names
EXECUTOR_BACKENDS = ("mp", "ray")
# Field names whose flag is spelled differently (kept from before the flags were generated).
FLAG_NAMES = {"kv_cache_memory_bytes": "--kv-cache-memory"}


def _flag(help_text: str, **argparse_kwargs) -> dict:
    return {"help": help_text, **argparse_kwargs}


@dataclass
class EngineConfig:
    model: str = field(default=DEFAULT_MODEL, metadata=_flag("a known model name or a local Hugging Face folder"))
    # Small blocks waste less on the last, partly filled block; large ones mean shorter block tables.
    block_size: int = field(default=16, metadata=_flag("tokens per KV-cache block"))
    # The pool is carved into blocks once, at start-up, and never grows.
    kv_cache_memory_bytes: int = field(default=1 << 30, metadata=_flag(
        "bytes for the KV pool when --num-kv-blocks is not given"))
    num_kv_blocks: int | None = field(default=None, metadata=_flag("KV-cache blocks to allocate"))
    max_num_seqs: int = field(default=64, metadata=_flag("running sequences per step (static: the batch size)"))
    # Bounds step latency and activation memory; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = field(default=1024, metadata=_flag(
        "tokens per step, prefill chunks and decodes together"))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "longest prompt + output in tokens (default: the model's own, capped by the KV pool)"))
    batching: str = field(default="continuous", metadata=_flag(
        "continuous; static: the head-of-line-blocking baseline; static-padded: also padded batches, "
        "KV reserved for prompt + max_tokens, finished rows computing until the batch ends", choices=BATCHING_MODES))
    attention_backend: str | None = field(default=None, metadata=_flag(
        "torch, cpu or triton (default: triton on CUDA, cpu (C++ decode kernel) on CPU)"))
    device: str | None = field(default=None, metadata=_flag("default: cuda when available, else cpu"))
    dtype: str | None = field(default=AUTO_DTYPE, metadata=_flag(
        "weights and activations: auto (bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512_BF16, "
        "else float32, and float32 under --quantization; see engine.worker.dtype_policy), float32, bfloat16, float16",
        choices=(AUTO_DTYPE, *DTYPE_NAMES)))
    # A decode reads every context token's K and V each step; the pool's bytes bound how many tokens it holds.
    kv_cache_dtype: str = field(default=AUTO_DTYPE, metadata=_flag(
        "KV cache and attention: auto (the activations' dtype, except bfloat16 beside --quantization's float32 "
        "activations on CPUs with native bf16; see engine.worker.dtype_policy), float32, bfloat16, float16",
        choices=(AUTO_DTYPE, *DTYPE_NAMES)))
    # Weight bytes bound a decode step: int8 halves them (engine.cpu.int8_linear).
    quantization: str | None = field(default=None, metadata=_flag(
        "CPU: int8 (W8A8 on AVX512_VNNI, weights and activations with a scale per group of 64 inputs), "
        "int4 (W4A8, llama.cpp's Q4_1 blocks of 32); default: none, weights in --dtype", choices=QUANTIZATIONS))
    seed: int = field(default=0, metadata=_flag("sampling seed for requests that bring none of their own"))
    num_threads: int | None = field(default=None, metadata=_flag(
        "CPU: torch intra-op threads (default: torch's own)"))
    adaptive_threads: bool = field(default=True, metadata=_flag(
        "CPU, served: step with fewer threads while other processes use the cores (engine.cpu.thread_governor)"))
    enforce_eager: bool = field(default=False, metadata=_flag(
        "CUDA: no CUDA graphs; CPU: no torch.compile even with --compile"))
    compile: bool = field(default=False, metadata=_flag(
        "CPU: torch.compile the forward (engine.worker.compilation): faster steps, the first start compiles for minutes"))
    load_format: str = field(default="auto", metadata=_flag(
        "dummy: random weights of the checkpoint's shape, for timing", choices=("auto", "dummy")))
    # ~2x faster steps here; the primitive caches that would grow with the variety of step
    # sizes are capped (engine.cpu.packing).
    cpu_prepack: bool = field(default=True, metadata=_flag("CPU: oneDNN-prepacked matmul weights"))
    # Decode steps' layers in one C++ loop, not ~15 Python calls a layer (engine.cpu.decode_stack).
    cpu_decode_stack: bool = field(default=True, metadata=_flag(
        "CPU: run decode-only steps' decoder layers in one C++ call"))
    # A .gguf's matmuls on its own blocks, activations in 8 bits per block as llama.cpp's (docs/models.md);
    # off, each is dequantized into the served dtype: the file's weights exactly, at fp32's memory.
    gguf_blocks: bool = field(default=True, metadata=_flag(
        "CPU: serve a .gguf's matmuls from its own blocks (off: dequantize them as they load)"))
    # Off recomputes every prompt, for comparison.
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "reuse the KV of full blocks whose whole prefix matches an earlier request's"))
    # Tensor parallelism (engine.parallel, engine.executor), in torchrun's terms: this core is rank 0 and
    # starts the other ranks of its host; other hosts run `tokenloom engine --node-rank R`.
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "ranks that split the model's heads and weights (gloo on CPU, NCCL on CUDA)"))
    # Pipeline parallelism (engine.parallel.pipeline): consecutive layers per stage, each stage
    # a tensor-parallel group; ranks = tensor_parallel_size x pipeline_parallel_size.
    pipeline_parallel_size: int = field(default=1, metadata=_flag(
        "stages the model's layers are split into, one step's activations passed stage to stage"))
    nnodes: int = field(default=1, metadata=_flag("hosts the tensor-parallel ranks are spread over"))
    node_rank: int = field(default=0, metadata=_flag(
        "this host's index among --nnodes; 0 runs the engine core, the others only workers"))
    master_addr: str = field(default="127.0.0.1", metadata=_flag(
        "host of node 0, where the ranks meet (its TCP store); non-loopback needs --allow-remote"))
    master_port: int = field(default=0, metadata=_flag(
        "port of that store (0: any free port, one host only)"))
    # mp: this host's ranks as our child processes (other hosts by hand, --node-rank); ray: a Ray
    # cluster places every rank (engine.executor.ray_executor). Each step travels our own channel.
    distributed_executor_backend: str = field(default="mp", metadata=_flag(
        "who starts the tensor-parallel ranks: mp (local processes) or ray (a Ray cluster's actors; "
        "pip install tokenloom[ray])", choices=EXECUTOR_BACKENDS))
    # A Ray CPU is a unit of placement, not a core (a rank's threads are its host's cores shared
    # among the host's ranks): a fraction lets more ranks than free CPUs share a node.
    ray_num_cpus_per_worker: float | None = field(default=None, metadata=_flag(
        "ray: CPUs each rank's placement-group bundle asks for (default: 1 where the cluster has a free "
        "CPU for every rank, else the largest 1/k that fits; engine.executor.ray_executor)"))
    grammar_compile_timeout_s: float = field(default=30.0, metadata=_flag(
        "structured outputs: a grammar still compiling after this many seconds fails its request"))
    # JSON text, in vLLM's names (ipc.speculative_config); a dict given in Python becomes its JSON.
    speculative_config: str | None = field(default=None, metadata=_flag(
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft", "model": "self-int4", "num_speculative_tokens": 4}\' (default: off)'))
    # Embeddings only: no generation, and a KV pool sized for prefill alone (engine.worker.pooler).
    runner: str = field(default="generate", metadata=_flag(
        "generate: text generation, and embeddings beside it; pooling: embeddings only (/v1/embeddings), "
        "with a KV pool sized for one step's prefills", choices=RUNNERS))
    # Multi-LoRA serving (engine/lora/, docs/lora.md), in vLLM's names.
    enable_lora: bool = field(default=False, metadata=_flag("serve LoRA adapters (requests name one)"))
    max_loras: int = field(default=4, metadata=_flag("LoRA: distinct adapters in one step (the pool's slots)"))
    max_lora_rank: int = field(default=16, metadata=_flag("LoRA: the highest adapter rank: 8, 16, 32 or 64"))
    max_cpu_loras: int | None = field(default=None, metadata=_flag(
        "LoRA: adapters kept loaded, least recently used evicted beyond it (default: --max-loras)"))

    # Vision-language models: images encoded per step, in image tokens (vLLM's max_num_encoder_input_tokens);
    # a chunk stops before an image that would pass it. One image larger than this still runs, alone.
    max_num_encoder_input_tokens: int = field(default=4096, metadata=_flag(
        "vision-language models: image tokens the vision encoder may produce per step"))
    # The vision encoder is one large compute-bound prefill per image: int8 matmuls (engine.cpu.vision_int8)
    # cut its time, at embeddings within 0.99 cosine of fp32's. Explicit, and not implied by --quantization
    # (which quantizes the text model): vLLM's quantized checkpoints also leave the vision tower as it is.
    vision_quantization: str | None = field(default=None, metadata=_flag(
        "vision-language models, CPU: int8 runs the vision encoder's linears as dynamic int8 matmuls "
        "(fbgemm; weights per channel, activations per call); default: none, the encoder in --dtype",
        choices=VISION_QUANTIZATIONS))

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.runner == "pooling" and self.pipeline_parallel_size > 1:
            raise ValueError("runner pooling is not supported with pipeline_parallel_size > 1")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.dtype not in (None, AUTO_DTYPE, *DTYPE_NAMES):
            raise ValueError(f"dtype must be one of {(AUTO_DTYPE, *DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in (AUTO_DTYPE, *DTYPE_NAMES):
            raise ValueError(f"kv_cache_dtype must be one of {(AUTO_DTYPE, *DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.vision_quantization not in (None, *VISION_QUANTIZATIONS):
            raise ValueError(f"vision_quantization must be one of {VISION_QUANTIZATIONS}, "
                             f"got {self.vision_quantization!r}")
        if self.quantization is not None and self.compile:
            raise ValueError("quantization is not supported with compile (the eager path runs the int8 kernel)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        self._check_parallel()
        if self.enable_lora:
            self._check_lora()
        if isinstance(self.speculative_config, dict):
            self.speculative_config = json.dumps(self.speculative_config)
        SpeculativeConfig.parse(self.speculative_config)  # raises, naming the bad field

    def _check_parallel(self) -> None:
        size, nnodes = self.world_size, self.nnodes
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1 or nnodes < 1:
            raise ValueError("tensor_parallel_size, pipeline_parallel_size and nnodes must be at least 1")
        if size % nnodes:
            raise ValueError(f"{size} ranks (tensor x pipeline parallel) do not divide evenly over {nnodes} nodes")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, {nnodes}), got {self.node_rank}")
        if nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need a fixed master_port to meet at")
        if size > 1 and self.compile:
            raise ValueError("compile is not supported with tensor or pipeline parallelism (the eager path is)")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and nnodes > 1:
            raise ValueError("with the ray backend Ray places every rank: leave nnodes and node_rank unset")
        if self.ray_num_cpus_per_worker is not None and self.ray_num_cpus_per_worker <= 0:
            raise ValueError(f"ray_num_cpus_per_worker must be above 0, got {self.ray_num_cpus_per_worker}")

    def _check_lora(self) -> None:
        check_max_lora_rank(self.max_lora_rank)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        # Tensor parallelism shards each adapter as its base layer (engine/lora/parallel_lora.py); pipeline
        # stages would each need their layers' part of the pool and the slots sent along the stages.
        unsupported = {"compile": self.compile, "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1,
                       f"batching {self.batching}": self.batching != "continuous", "runner pooling": self.runner == "pooling"}
        for what, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"enable_lora is not supported with {what} yet")

    @property
    def world_size(self) -> int:
        """Every rank of the engine: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_TYPES = {"int": int, "int | None": int, "str": str, "str | None": str, "float": float, "float | None": float}


def flag_name(field_name: str) -> str:
    return FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, unset_by_default: bool = False) -> None:
    """One flag per EngineConfig field but `model` (each parser says what its --model means).
    Booleans get --x and --no-x. With `unset_by_default` (the frontend) every default is
    None, so `engine_argv` passes on only what was given and the core's defaults apply."""
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        default = None if unset_by_default else f.default
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        help_text = f.metadata["help"]
        if not unset_by_default and f.default is not None:
            help_text += f" (default: {f.default})"
        if f.type == "bool":
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, type=_TYPES[f.type], default=default,
                                help=help_text, **extra)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config of the flags `add_engine_args` added (and --model)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags that were given (parsed with `unset_by_default`), as a core's argv."""
    argv = []
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None) if f.name != "model" else None
        if value is None:
            continue
        flag = flag_name(f.name)
        if f.type == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


assert all(f.default is not MISSING for f in fields(EngineConfig)), "every engine flag needs a default"
assert all(f.type in (*_TYPES, "bool") for f in fields(EngineConfig)), "a field type add_engine_args cannot map"
