"""The engine's own Scheduler (or StaticScheduler, PaddedStaticScheduler) and BlockManager, stepped on a
simulated clock by a runner that prices each step instead of running it.

    now = 0
    loop:  add every request whose arrival_s <= now   (each costs request_overhead_s)
           idle: now = next arrival
           schedule -> price (SimulatedRunner) -> now += cost -> update
           the step's tokens are out at `now` (served: `now` + the server's latency)

The pool is sized as EngineCore sizes it (KV bytes from the profile, blocks of
`block_size`), and so is the context limit, so the same workload takes the same
decisions here as in the engine: tests/simulator/test_simulator_engine.py holds them side by side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.loop.batching import batching_mode
from engine.loop.engine_core import make_step_stats
from engine.core.step_stats import StepStats
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.simulator.hardware_profile import HardwareProfile
from engine.simulator.model_shape import ModelShape
from engine.simulator.simulated_runner import FIRST_SAFE_TOKEN_ID, SimulatedRunner
from engine.simulator.step_cost import StepCostModel, StepShape
from ipc.sampling_params import SamplingParams, check_request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulatedRequest:
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0
    prompt_token_ids: list[int] | None = None  # None: distinct tokens per request (no prefix is shared)


@dataclass(frozen=True)
class SimulatorConfig:
    """The engine settings that shape scheduling (EngineConfig's names and defaults)."""

    batching: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # each device holds 1/PP of the layers; stages run one after another
    num_kv_blocks: int | None = None  # None: from the profile's KV memory
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    is_served: bool = False  # through the HTTP server: the profile's server_* terms apply


@dataclass
class RequestTimes:
    arrival_s: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # when each output token was out

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.token_times[-1] - self.arrival_s


@dataclass
class SimulationResult:
    requests: list[RequestTimes]  # in input order
    step_stats: list[StepStats]  # on the simulated clock, from 0
    step_shapes: list[StepShape]  # what each step was priced on
    num_kv_blocks: int
    max_model_len: int
    num_preemptions: int

    @property
    def elapsed_s(self) -> float:
        """From the first arrival to the last token, as the benchmarks time a run."""
        return max(r.token_times[-1] for r in self.requests) - min(r.arrival_s for r in self.requests)


class Simulator:
    def __init__(self, shape: ModelShape, profile: HardwareProfile,
                 config: SimulatorConfig = SimulatorConfig()) -> None:
        self.shape = shape
        self.profile = profile
        self.config = config
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.cost_model = StepCostModel(shape, profile, tp, pp)
        # Each device holds 1/TP of every block (its share of the KV heads) of 1/PP of the layers.
        bytes_per_block = shape.kv_bytes_per_token * config.block_size // (tp * pp)
        self.num_kv_blocks = config.num_kv_blocks or max(
            1, profile.kv_pool_bytes(shape.cost.weight_bytes // (tp * pp)) // bytes_per_block)
        # As the engine: sliding windows are computed per layer and do not cap the context.
        limit = min(shape.max_position_embeddings, self.num_kv_blocks * config.block_size)
        self.max_model_len = min(config.max_model_len or limit, limit)

    def make_scheduler(self) -> Scheduler:
        return batching_mode(self.config).scheduler_class(
            BlockManager(self.num_kv_blocks, self.config.block_size),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=list(self.shape.eos_token_ids),
            enable_prefix_caching=self.config.enable_prefix_caching,
        )

    def run(self, requests: list[SimulatedRequest]) -> SimulationResult:
        if not requests:
            raise ValueError("no requests to simulate")
        scheduler = self.make_scheduler()
        runner = SimulatedRunner(self.cost_model)
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        times = [RequestTimes(r.arrival_s, r.num_prompt_tokens) for r in requests]
        step_stats: list[StepStats] = []
        step_shapes: list[StepShape] = []
        step_factor = self.profile.server_step_factor if self.config.is_served else 1.0
        latency = self.profile.server_latency_s if self.config.is_served else 0.0
        now, next_index = 0.0, 0
        while next_index < len(order) or scheduler.has_unfinished_requests():
            while next_index < len(order) and requests[order[next_index]].arrival_s <= now:
                i = order[next_index]
                scheduler.add_request(self._make_request(i, requests[i]))
                now += self.profile.request_overhead_s
                next_index += 1
            if not scheduler.has_unfinished_requests():
                now = requests[order[next_index]].arrival_s  # idle until the next arrival
                continue
            output = scheduler.schedule()
            if output.is_empty:
                raise RuntimeError("the scheduler scheduled nothing with requests waiting")
            counts = output.counts()  # before update advances the computed counts
            sampled, shape, cost = runner.execute(output)
            start, now = now, now + cost.total_s * step_factor
            for request_output in scheduler.update(output, sampled).outputs:
                times[int(request_output.request_id)].token_times.append(now + latency)
            step_stats.append(make_step_stats(output, counts, start, now, scheduler.block_manager.num_used_blocks))
            step_shapes.append(shape)
        return SimulationResult(times, step_stats, step_shapes, self.num_kv_blocks, self.max_model_len,
                                scheduler.num_preemptions)

    def _make_request(self, index: int, r: SimulatedRequest) -> Request:
        """A real Request, checked and capped as EngineCore.add_request does."""
        token_ids = r.prompt_token_ids or distinct_prompt(index, r.num_prompt_tokens, self.shape.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        params = check_request(token_ids, params, vocab_size=self.shape.vocab_size, max_model_len=self.max_model_len,
                               cap_max_tokens=True)
        return Request(str(index), token_ids, params, params.max_tokens, r.arrival_s)


def distinct_prompt(index: int, num_tokens: int, vocab_size: int) -> list[int]:
    """A prompt whose first block no other index shares (its first two tokens spell the
    index), so prefix caching finds nothing, as with random prompts; cheap for 10,000."""
    base = vocab_size - FIRST_SAFE_TOKEN_ID
    first = [FIRST_SAFE_TOKEN_ID + index % base, FIRST_SAFE_TOKEN_ID + index // base % base]
    return (first + [FIRST_SAFE_TOKEN_ID] * num_tokens)[:num_tokens]
