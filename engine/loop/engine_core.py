"""The engine core: requests in, one step at a time, per-step token deltas out.

`step()` is schedule -> execute -> update. It knows nothing of sockets: the
core process (`engine.loop.core_process`) and the offline `LLM` both drive it.
With tensor parallelism it is rank 0 and the one scheduler; its executor
(`engine.executor.executor`) starts and drives the other ranks.
"""

from __future__ import annotations

import logging
import time

from engine.core.block_manager import BlockManager
from engine.cpu.host import cache_dir
from engine.config import EngineConfig
from engine.worker.device_and_dtype import kv_bytes_per_block, resolve_kv_pool_dtype
from engine.executor.backends import make_executor
from engine.executor.executor import WorkerDeadError
from engine.loader.model_files import resolve_model
from engine.loop.batching import batching_mode
from engine.models.config import ModelConfig
from engine.models.vision_config import check_images
from engine.core.request import Request
from engine.worker.pooler import check_pooling_request, pooling_num_kv_blocks
from engine.spec_decode.proposer import SpecProposer
from engine.core.scheduler_output import StepOutputs
from engine.core.step_stats import StepStats
from engine.structured_output import GrammarCompilerPool, RequestGrammar
from ipc.messages import ImageInput, LoRARequest, RequestOutput, SchedulerStats, StepCounts
from ipc.pooling_params import PoolingParams
from ipc.sampling_params import SamplingParams, check_request

logger = logging.getLogger(__name__)



class StepError(RuntimeError):
    """The model raised during a step. Its requests have been failed and freed; the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"a step failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.grammar_compiler: GrammarCompilerPool | None = None  # made once the model is loaded
        self.model_path = resolve_model(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path)
        # The pool is sized from the memory budget unless its block count is given.
        if config.node_rank != 0:
            raise ValueError("node_rank > 0 runs workers only (engine.executor.worker_process), not an engine core")
        device, kv_dtype = resolve_kv_pool_dtype(config)
        tp_size = config.tensor_parallel_size
        # Per rank: each holds its share of the KV heads, so the same budget buys more blocks.
        num_kv_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_bytes // kv_bytes_per_block(self.model_config, config.block_size, kv_dtype, tp_size)
        )
        max_model_len = min(self.model_config.max_position_embeddings, config.max_model_len or 2**31)
        if config.runner == "pooling" and not config.num_kv_blocks:  # embeddings only: KV lives one prompt
            num_kv_blocks = min(num_kv_blocks, pooling_num_kv_blocks(config, max_model_len))
        self.num_kv_blocks = num_kv_blocks
        # A sequence must fit in the whole pool by itself, or preemption could not save it.
        # Sliding windows do not cap it: the attention kernels compute them per layer.
        self.max_model_len = min(max_model_len, num_kv_blocks * config.block_size)
        mode = batching_mode(config)
        self.executor = None
        if config.world_size > 1:
            self.executor = make_executor(config, self.model_config, num_kv_blocks, self.max_model_len, device)
        try:
            self.model_runner = mode.runner_class(config, self.model_config, num_kv_blocks, self.max_model_len,
                                             executor=self.executor)
            if self.executor is not None:
                self.executor.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.scheduler = mode.scheduler_class(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
        )
        self.scheduler.max_loras = config.max_loras if config.enable_lora else 0
        # Speculative decoding (engine.spec_decode): proposals for --speculative-config and for requests'
        # predictions; the static baselines keep one token per step.
        self.proposer = None
        if mode.speculates:
            self.proposer = SpecProposer(config.speculative, self.max_model_len, self._load_draft(num_kv_blocks))
        self.step_stats: list[StepStats] = []
        self.record_step_stats = False
        self.count_steps = False  # a dashboard watches: each step returns its StepCounts
        if config.runner != "pooling":  # the grammar compiler builds on its thread now, not at the first grammar
            self._grammar_compiler()

    def _load_draft(self, num_kv_blocks: int):
        """The draft model's proposer for method "draft" (its own KV pool of the target's blocks), else None."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft":
            return None
        from engine.spec_decode.draft_proposer import DraftModelProposer

        return DraftModelProposer(self.config, spec, self.model_config, num_kv_blocks, self.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        images: list[ImageInput] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Check and queue a request; raises ValueError (and changes nothing) on bad input.
        With `pooling_params` it is an embedding request (engine.worker.pooler), `sampling_params` unused.
        With `lora_request` it runs under that LoRA adapter, loaded (and checked) here if it is not yet.

        Everything that reaches a tensor is checked here, against this model, by the same
        `check_request` the frontend runs: the offline API and the core's socket both come
        through here, so a bad value fails this request alone, never a step."""
        if pooling_params is not None or self.config.runner == "pooling":  # else generation, as asked
            sampling_params = check_pooling_request(self.config, pooling_params, sampling_params)
        params = check_request(prompt_token_ids, sampling_params, vocab_size=self.vocab_size,
                               max_model_len=self.max_model_len, cap_max_tokens=pooling_params is None,
                               is_pooling=pooling_params is not None)
        if images or self.model_config.vision is not None:
            check_images(images, prompt_token_ids, self.model_config.vision)
        adapter_read = self._load_adapter(lora_request) if lora_request is not None else None
        request = Request(request_id, prompt_token_ids, params, params.max_tokens, arrival_time, pooling_params, images,
                          lora_request)
        request.adapter_read = adapter_read
        if params.structured_outputs is not None:
            request.grammar = RequestGrammar(self._grammar_compiler().submit(params.structured_outputs),
                                             self.config.grammar_compile_timeout_s,
                                             params.structured_outputs.reasoning_end_token_ids)
        self.scheduler.add_request(request)

    def _load_adapter(self, lora_request: LoRARequest):
        """Its folder checked (ValueError naming the field) and its tensors read off the loop: the read the
        request waits for (engine.lora.adapter_reader), or None when the adapter is cached."""
        lora = getattr(self.model_runner, "lora", None)
        if lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA adapters are off (enable_lora)")
        return lora.prefetch(lora_request)

    def _grammar_compiler(self) -> GrammarCompilerPool:
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompilerPool(self.model_path, self.vocab_size,
                                                        self.model_config.eos_token_ids,
                                                        info_cache_dir=cache_dir() / "grammar")
        return self.grammar_compiler

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        requests = [r for r in map(self.scheduler.requests.get, request_ids) if r is not None]
        outputs = self.scheduler.abort_requests(request_ids)
        for request in requests:
            self.model_runner.release(request)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        """False while every unfinished request waits for its grammar's compile."""
        return self.scheduler.has_schedulable_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise WorkerDeadError if a tensor-parallel worker is gone (a no-op in one process)."""
        if self.executor is not None:
            self.executor.check_workers()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected)."""
        if self.executor is not None:
            self.executor.shutdown()
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()
        lora = getattr(getattr(self, "model_runner", None), "lora", None)  # None too when __init__ failed before it
        if lora is not None:
            lora.reader.shutdown()

    def step(self) -> StepOutputs:
        """schedule -> execute -> update: the step's outputs, and the requests it failed for their own
        parameters, each with why. If the model raises, the step's requests fail (StepError names them,
        already removed) and the engine stays usable."""
        start_time = time.perf_counter()
        results = self.scheduler.take_grammar_failures() if self.scheduler.compiling else StepOutputs()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return self._log_errors(results)
        # Read before update advances the computed counts; only for a dashboard or a benchmark.
        counts = scheduler_output.counts() if self.count_steps or self.record_step_stats else None
        if self.count_steps:
            results.step_counts = counts
        try:
            sampled = self.model_runner.execute(scheduler_output)
        except WorkerDeadError:
            raise  # a rank is gone: not this step's fault, and no later step can run
        except Exception as e:
            request_ids = [s.request.request_id for s in scheduler_output.scheduled]
            logger.exception("a step of %d requests failed; failing them: %s", len(request_ids), request_ids)
            self.scheduler.fail_requests(request_ids)
            for scheduled in scheduler_output.scheduled:
                self.model_runner.release(scheduled.request)
            raise StepError(request_ids, e) from e
        results.extend(self.scheduler.update(scheduler_output, sampled))
        for scheduled in scheduler_output.scheduled:
            if scheduled.request.is_finished:
                self.model_runner.release(scheduled.request)
        if self.proposer is not None and self._may_propose():
            self.proposer.propose(self.scheduler.running)  # the next step's proposed tokens
        if self.record_step_stats:
            self._record(scheduler_output, counts, start_time)
        return self._log_errors(results)

    def _may_propose(self) -> bool:
        """A configured method, or a running request with a prediction; else no request has proposed
        tokens to clear, and none gets any."""
        return (self.proposer.config is not None  # --speculative-config's method
                or any(r.sampling_params.prediction_token_ids for r in self.scheduler.running))

    @staticmethod
    def _log_errors(results: StepOutputs) -> StepOutputs:
        for request_id, message in results.errors:
            logger.info("request %s failed: %s", request_id, message)
        return results

    def _record(self, scheduler_output, counts: StepCounts, start_time: float) -> None:
        self.step_stats.append(
            make_step_stats(scheduler_output, counts, start_time, time.perf_counter(), self.block_manager.num_used_blocks)
        )


def make_step_stats(scheduler_output, counts: StepCounts, start_time: float, end_time: float,
                    num_kv_blocks_used: int) -> StepStats:
    """One step's record, from its batch's `counts` (taken before the update); also built by the
    capacity simulator, on its simulated clock."""
    fields = dict(
        start_time=start_time,
        end_time=end_time,
        num_seqs=len(scheduler_output.scheduled),
        num_tokens=scheduler_output.num_tokens,
        num_prefill_tokens=counts.num_prefill_tokens,
        num_decode_tokens=counts.num_decode_tokens,
        num_kv_blocks_used=num_kv_blocks_used,
        num_prefill_requests=counts.num_prefill_requests,
        num_decode_requests=counts.num_decode_requests,
    )
    return scheduler_output.step_stats(**fields)
