"""Runs one scheduled step on the model: prepare, run, sample.

Owns the model, the paged KV pool (one K and one V tensor per layer, carved
into blocks once at start-up), the attention backend and the sampler; the constructor
builds them in named steps, in order: model, backend, model preparation (the CPU fast
paths), KV pool, sampler, CUDA graphs or compilation. The host's CPU features are read
once and handed to each step that needs them.

Under tensor parallelism every rank has a ModelRunner holding its shard. Rank 0
turns the scheduler's output into a `StepInputs` record of lists, hands it to
the executor (which sends it to the workers) and runs `forward_step` on it;
the workers run `forward_step` on the same record; only rank 0 samples. The step's
lists and tensors are made in `engine.worker.step_inputs`.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.backend import AttentionBackend, KVCache
from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler_output import SampledToken, SchedulerOutput
from engine.cpu.execution_plan import CpuExecutionPlan
from engine.lora.adapter_pool import LoRAPool
from engine.lora.parallel_lora import AdapterSharding, step_adapters, use_step_adapters
from engine.loader.gguf_blocks import blocks_for_model
from engine.loader.gguf_model import load_gguf_model
from engine.loader.load_heap import frees_returned_while_loading
from engine.loader.model_files import gguf_file_of
from engine.models import load_model
from engine.models.config import ModelConfig
from engine.parallel.parallel_layers import num_local_kv_heads
from engine.parallel.parallel_state import TensorParallelGroup
from engine.parallel.pipeline import WHOLE_MODEL
from engine.sample.logits_processing import LogitsProcessingState
from engine.sample.prompt_logprobs import PromptLogprobsCollector
from engine.sample.sampler import Sampler, SamplingBatch, sampling_kernels
from engine.sample.verifier import verify
from engine.worker.attention_choice import make_attention_backend, resolve_attention_backend
from engine.worker.compilation import compile_forward, inductor_cache_dir, warm_up
from engine.worker.cuda_graph_check import check_replays
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.worker.encoder_cache import EncoderCache
from engine.worker.mrope_positions import MRopePositions
from engine.worker.device_and_dtype import (
    cpu_features_of, kv_bytes_per_block, resolve_device, resolve_dtype, resolve_kv_cache_dtype,
)
from engine.worker.pooler import Pooler
from engine.worker.step_executors import make_step_executor
from engine.worker.step_inputs import (PreparedStep, StepInputs, is_plain_greedy, make_sampling_batch, prepare_step,
                                       token_lora_slots)
from ipc.lora_adapter import ModelShape

logger = logging.getLogger(__name__)


def make_lora_pool(config: EngineConfig, model_config: ModelConfig, model, dtype, device,
                   tp: TensorParallelGroup | None = None) -> LoRAPool | None:
    """The LoRA adapters' pool around the model's layers under --enable-lora (this rank's shard
    of each adapter under TP), else None."""
    if not config.enable_lora:
        return None
    shape = ModelShape.from_folder(model_config.path)
    sharding = AdapterSharding(shape, model_config, tp) if tp is not None and tp.size > 1 else None
    return LoRAPool(model, shape, config.max_loras, config.max_lora_rank, config.max_cpu_loras, dtype, device,
                    sharding=sharding)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int, max_model_len: int,
                 tp: TensorParallelGroup | None = None, executor=None) -> None:
        """`tp`: this rank's group (a worker's); `executor`: rank 0's engine.executor.executor,
        whose group it is. Neither: one process, the model whole."""
        self.config = config
        self.model_config = model_config
        self.executor = executor
        self.tp = executor.group if executor is not None else tp
        self.block_size = config.block_size
        self.device = resolve_device(config)
        cpu = cpu_features_of(self.device)  # read once; every choice below that needs it is handed it
        self.dtype, reason = resolve_dtype(config, self.device, cpu)
        logger.info("dtype %s on %s (%s)", str(self.dtype).removeprefix("torch."), self.device, reason)
        self.kv_dtype, reason = resolve_kv_cache_dtype(config, self.device, cpu, self.dtype)
        if self.kv_dtype != self.dtype:
            logger.info("KV cache and attention in %s (%s)", str(self.kv_dtype).removeprefix("torch."), reason)
        # Compiled, inductor prepacks the weights itself (freezing).
        self.is_compiled = config.compile and not config.enforce_eager and self.device.type == "cpu"
        backend_name = resolve_attention_backend(config.attention_backend, self.device.type, self.kv_dtype, cpu)
        # The one door into the CPU wing (threads, huge pages, fast paths, the decode stack), before the
        # weights load; a GPU runner's plan applies nothing.
        self.cpu_plan = CpuExecutionPlan.make(config, model_config.path, self.device, self.dtype, cpu, backend_name,
                                              self.is_compiled, is_tensor_parallel=self.tp is not None,
                                              read_gguf_blocks=blocks_for_model)
        with frees_returned_while_loading():  # the peak: the model and one tensor, not its freed buffers too
            self.model = self._load_model(num_kv_blocks)
            if self.kv_dtype != self.dtype:
                self.model.set_attention_dtype(self.kv_dtype)
            self.backend = self._make_backend(backend_name, self.cpu_plan.attention_kernels)
            self.kv_caches = self._make_kv_pool(num_kv_blocks)
            self.decode_stack = self.cpu_plan.prepare(self.model, self.backend, self.kv_caches,
                                                      self.num_weight_bytes)
        # Around the prepared layers (the fused and quantized ones are its base layers); the decode stack
        # keeps the base's weights and adds the adapters from the pool's own tensors.
        self.lora = make_lora_pool(config, model_config, self.model, self.dtype, self.device, self.tp)
        if self.lora is not None and self.decode_stack is not None:
            self.decode_stack.use_lora(self.lora.layers, self.lora.state, self.lora.scales)
        self.sampler = self._make_sampler()
        self.forward_times: tuple[float, float | None] = (0.0, None)  # the last step's forward (perf_counter)
        self.execute_times: tuple[float, float] | None = None  # the last execute's start and end
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs = PromptLogprobsCollector()
        self.pooler = Pooler()
        self.pooled_hidden: torch.Tensor | None = None  # forward_step's pooled rows, for execute's pooler
        # A vision-language model's image embeddings by content hash, a few steps' worth of encoder budget.
        self.encoder_cache = (EncoderCache(self.model, self.device, 4 * config.max_num_encoder_input_tokens)
                              if getattr(self.model, "is_multimodal", False) else None)
        # Qwen2.5-VL's 3-component positions (engine.worker.mrope_positions); None: 1D positions as they are.
        self.mrope = MRopePositions(model_config.vision) if getattr(self.model, "uses_mrope", False) else None
        self.cuda_graphs = self._capture_cuda_graphs(max_model_len)
        self.compiled_forward = None
        if self.is_compiled:
            self._compile()
        self.step_executor = make_step_executor(
            self.model, self.kv_caches, self.backend, self.device, self.dtype, self.tp, cuda_graphs=self.cuda_graphs,
            compiled_forward=self.compiled_forward, decode_stack=self.decode_stack)
        logger.info("steps run on: %s", self.step_executor.name)

    def _load_model(self, num_kv_blocks: int) -> torch.nn.Module:
        """From the folder's safetensors, or from the GGUF file the folder names, in its own blocks
        where the CPU plan has kernels for them (engine/loader/gguf_model.py)."""
        gguf_path = gguf_file_of(self.model_config.path)
        if gguf_path is not None and self.config.load_format == "auto":
            kv_pool_bytes = num_kv_blocks * kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype,
                                                               self.config.tensor_parallel_size)
            model = load_gguf_model(self.model_config, gguf_path, self.dtype, self.device, self.tp,
                                    kernels=self.cpu_plan.gguf_kernels(), reserve_bytes=kv_pool_bytes)
        else:
            model = load_model(self.model_config, self.dtype, self.device, self.config.load_format, self.tp)
        # Counted before prepacking, which turns weights into opaque oneDNN buffers; a GgufLinear
        # counts its blocks (num_weight_bytes).
        self.num_params = sum(p.numel() for p in model.parameters())
        self.num_weight_bytes = (sum(p.numel() * p.element_size() for p in model.parameters())
                                 + sum(getattr(m, "num_weight_bytes", 0) for m in model.modules()))
        return model

    def _make_backend(self, name: str, kernels) -> AttentionBackend:
        """`kernels`: the fused CPU ops' (the backend's KV store then runs fused with rotary), or None."""
        windows = tuple(sorted({self.model_config.window_of(i) for i in range(self.model_config.num_layers)}))
        return make_attention_backend(name, self.block_size, windows, kernels)

    def _make_kv_pool(self, num_kv_blocks: int) -> list[KVCache]:
        """One K and one V tensor per layer (this pipeline stage's layers; None for the others), in the
        backend's block layout."""
        num_kv_heads = num_local_kv_heads(self.model_config.num_kv_heads, self.config.tensor_parallel_size)
        shape = self.backend.kv_cache_shape(num_kv_blocks, self.block_size, num_kv_heads, self.model_config.head_dim)
        logger.info("KV pool: %d blocks of %d tokens on %s", num_kv_blocks, self.block_size, self.device)
        num_layers = self.model_config.num_layers
        stage = self.tp.stage if self.tp is not None else WHOLE_MODEL
        new = self.cpu_plan.new_kv_tensor  # on the CPU, on huge pages
        return [(new(shape, self.kv_dtype), new(shape, self.kv_dtype)) if stage.holds(i, num_layers) else None
                for i in range(num_layers)]

    def _make_sampler(self) -> Sampler:
        kernels = sampling_kernels(self.device)
        self.logits_state = LogitsProcessingState(self.model_config.vocab_size, self.device, kernels)
        return Sampler(torch.Generator().manual_seed(self.config.seed), kernels, self.logits_state)

    def _capture_cuda_graphs(self, max_model_len: int) -> CudaGraphRunner:
        """Decode steps replay CUDA graphs sized for the longest sequence."""
        cuda_graphs = CudaGraphRunner(
            self.model, self.kv_caches, self.backend, device=self.device, block_size=self.block_size,
            max_num_seqs=self.config.max_num_seqs, max_model_len=max_model_len,
            enforce_eager=self.config.enforce_eager or self.tp is not None,  # graphs would capture the collectives
        )
        cuda_graphs.capture(check_replays)
        return cuda_graphs

    def _compile(self) -> None:
        self.compiled_forward = compile_forward(self.model)
        seconds = warm_up(self.compiled_forward, self)
        logger.info("torch.compile: forward ready in %.1f s (cache: %s)", seconds, inductor_cache_dir())

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the model on the step's flat batch; return a new token for each request that reached its end."""
        prepare0 = time.perf_counter()
        step = self.prepare_step(scheduler_output)
        self.forward_times = (time.perf_counter(), None)
        if any(request.grammar is not None for request in step.sampled_requests):
            self.logits_state.start_grammar_fill(step.sampled_requests)  # hidden behind the forward
        logits = self.run_step(step)
        self.forward_times = (self.forward_times[0], time.perf_counter())
        sampled = self.sample_step(scheduler_output, step, logits)
        self.execute_times = (prepare0, time.perf_counter())  # the step trace's (engine/loop/step_trace.py)
        return sampled

    def prepare_step(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The step's inputs as lists, and which logits rows go where (engine.worker.step_inputs)."""
        image_token_id = self.model_config.vision.image_token_id if self.encoder_cache is not None else None
        step = prepare_step(scheduler_output, self.block_size, self.prompt_logprobs, image_token_id)
        if self.mrope is not None:
            self.mrope.apply(step, scheduler_output)
        if self.lora is not None:  # each adapter of the step in a pool slot, and each sequence's slot
            lora_requests = [s.request.lora_request for s in scheduler_output.scheduled]
            step.inputs.lora_slots = self.lora.step_slots(lora_requests)
            if self.executor is not None and step.inputs.lora_slots:  # the workers' pools follow this one
                step.inputs.lora_adapters = step_adapters(self.lora, lora_requests)
        return step

    def run_step(self, step: PreparedStep) -> torch.Tensor | None:
        """The model on every rank: the logits of `step.inputs.sample_rows`; pooled rows collected."""
        if self.executor is None:
            images = self.encoder_cache.step_rows(step.image_slices) if step.image_slices else None
            if step.mrope_positions is not None:  # the image tokens' (temporal, height, width)
                images = (*images, torch.tensor(step.mrope_positions, dtype=torch.int64, device=self.device))
            logits = self.forward_step(step.inputs, images=images)  # [num_logits_rows, vocab_size]
        else:
            logits = self.executor.run_step(step.inputs, self.forward_step)  # every rank runs it
        if step.pooling_plans:
            self.pooler.collect(self.pooled_hidden, step.pooling_plans)  # finished ones get request.embedding
            self.pooled_hidden = None
        return logits

    def sample_step(self, scheduler_output: SchedulerOutput, step: PreparedStep,
                    logits: torch.Tensor | None) -> dict[str, SampledToken]:
        """Prompt log-probs, then a token (or verified proposals) for each request at its end."""
        sampled_requests = step.sampled_requests
        if step.prompt_plans:
            self.prompt_logprobs.collect(logits, step.prompt_plans)
            logits = logits[step.sampled_rows]  # [num_sampled, vocab_size]
        if not sampled_requests:
            return {}
        drafts = [s.spec_token_ids for s in scheduler_output.scheduled if s.is_sampling]
        if any(drafts):
            tokens = self._verify(logits, sampled_requests, drafts)
        elif all(map(is_plain_greedy, sampled_requests)):
            tokens = self.sampler.sample_greedy(logits)
        else:
            tokens = self.sampler.sample(logits, self._prepare_sampling(sampled_requests))
        for request, token in zip(sampled_requests, tokens):
            if request.sampling_params.prompt_logprobs is not None:
                token.prompt_logprobs = self.prompt_logprobs.take(request)
        return {request.request_id: token for request, token in zip(sampled_requests, tokens)}

    def _verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[SampledToken]:
        """A step with proposed tokens: the rows without any are sampled as usual, the others verified
        (engine.sample.verifier). logits: each request's 1 + len(draft) rows, in order."""
        starts = [0]
        for draft in drafts:
            starts.append(starts[-1] + 1 + len(draft))
        plain = [i for i, draft in enumerate(drafts) if not draft]
        speculated = [i for i, draft in enumerate(drafts) if draft]
        tokens: list[SampledToken | None] = [None] * len(requests)
        if plain:
            plain_rows = [starts[i] for i in plain]
            for i, token in zip(plain, self.sampler.sample(logits[plain_rows], self._prepare_sampling(
                    [requests[i] for i in plain]))):
                tokens[i] = token
        rows = [row for i in speculated for row in range(starts[i], starts[i + 1])]
        expanded = [requests[i] for i in speculated for _ in range(1 + len(drafts[i]))]  # a row per position
        verified = verify(self.sampler, logits[rows], self._prepare_sampling(expanded), [drafts[i] for i in speculated])
        for i, token in zip(speculated, verified):
            tokens[i] = token
        return tokens

    @torch.inference_mode()
    def forward_step(self, inputs: StepInputs, as_rows: bool = False, images=None) -> torch.Tensor | None:
        """The model on one step's inputs, on the one step executor chosen at start: the sampled
        rows' logits (None when none are sampled, and on a worker rank). The pooled rows' final
        hidden states go to `pooled_hidden`. `as_rows`: a step of a few short chunks (a draft model's
        catch-up) may run as one-token rows, as a verification step does."""
        if self.lora is not None:
            use_step_adapters(self.lora, inputs.lora_adapters)  # a worker's new adapters (rank 0 has them)
            self.lora.state.prepare(*token_lora_slots(inputs), self.device)
        result = self.step_executor.forward(inputs, as_rows, images)  # images: (rows [n], embeddings [n, hidden])
        self.pooled_hidden = result.pooled  # [num_pooled, hidden_size] or None
        return result.logits  # [num_sampled, vocab_size] or None

    def release(self, request: Request) -> None:
        """Drop a finished request's state, in the parts it used."""
        request_id, params = request.request_id, request.sampling_params
        self.generators.pop(request_id, None)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs.release(request_id)
        if request.pooling_params is not None:
            self.pooler.release(request_id)
        if params.needs_logits_processing:
            self.logits_state.release(request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.release(request_id)
        if self.mrope is not None:
            self.mrope.release(request_id)

    def _prepare_sampling(self, requests: list[Request]) -> SamplingBatch:
        return make_sampling_batch(requests, self.model_config, self.device, self.generators, self.logits_state)
