"""The price of one engine step, from what it contains.

    step = overhead + combine(weights, matmuls) + KV reads + attention + all-reduce + pipeline

    overhead    step_overhead + seq_overhead · num_seqs       (the engine's own work)
    weights     weight bytes / TP / (bandwidth · eff)          (every weight read once)
    matmuls     (tokens · body FLOPs + sampled · logits FLOPs) / TP / (peak · eff)
    KV reads    (context tokens read + tokens written) · KV bytes per token / TP / (bandwidth · eff)
    attention   (query, key) pairs · 4·layers·heads·head_dim / TP / (peak · eff)
    all-reduce  2 per layer + 1 (the embedding), ring: 2·(TP-1)/TP · tokens · hidden bytes / link + latency
    pipeline    (PP-1) stage hand-offs of (hidden, residual): 2 · tokens · hidden bytes / link + latency,
                and the sampled rows' logits back to rank 0: sampled · vocab bytes / link + latency

Pipeline stages run one after another within a step (engine.parallel.pipeline: no
overlap), so their compute adds up to the whole model's: PP divides the memory, not the
time, and adds its hand-offs; TP divides the compute and adds its all-reduces.

`combine` is max (a roofline: the weight stream and the arithmetic overlap, as on a
GPU, and as this CPU's oneDNN matmuls measure: a decode step of 1 to 8 sequences costs
about the same) or + (no overlap), per the profile's `overlap`. KV reads and attention
FLOPs add: the reads are mostly decodes' and the FLOPs prefills', different sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.baselines.padded_static_scheduler import PaddedSchedulerOutput
from engine.simulator.hardware_profile import HardwareProfile
from engine.simulator.model_shape import ModelShape


@dataclass(frozen=True)
class StepShape:
    """What the cost depends on, summed over a step's scheduled sequences."""

    num_seqs: int
    num_tokens: int  # new tokens: prefill chunks and decodes
    num_sampled: int  # sequences that reach their last token and get logits
    num_context_tokens: int  # KV rows attention reads: each sequence's length at the step's end
    num_attention_pairs: int  # causal (query, key) pairs: a chunk of q after c computed has q·c + q(q+1)/2

    @classmethod
    def of(cls, scheduler_output) -> "StepShape":
        """Read before `Scheduler.update` advances the computed counts."""
        num_tokens = num_sampled = num_context = num_pairs = 0
        for scheduled in scheduler_output.scheduled:
            q, c = scheduled.num_new_tokens, scheduled.request.num_computed_tokens
            num_tokens += q
            num_sampled += scheduled.is_sampling
            num_context += c + q
            num_pairs += q * c + q * (q + 1) // 2
        # static-padded: pad rows priced as the real rows, since they are computed
        padding = scheduler_output.padding if isinstance(scheduler_output, PaddedSchedulerOutput) else []
        for row in padding:
            q, c = row.num_tokens, row.start
            num_tokens += q
            num_sampled += row.is_sampling
            num_context += c + q
            num_pairs += q * c + q * (q + 1) // 2
        num_seqs = len(scheduler_output.scheduled) + len(padding)
        return cls(num_seqs, num_tokens, num_sampled, num_context, num_pairs)


@dataclass(frozen=True)
class PeakTimes:
    """Each term's seconds at 100% of peak on one device, before efficiencies."""

    weights_s: float
    matmuls_s: float
    kv_s: float
    attention_s: float


@dataclass(frozen=True)
class StepCost:
    overhead_s: float
    linear_s: float  # weights and matmuls, combined
    attention_s: float  # KV reads and attention FLOPs
    allreduce_s: float
    pipeline_s: float = 0.0  # the hand-offs between pipeline stages

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.linear_s + self.attention_s + self.allreduce_s + self.pipeline_s


class StepCostModel:
    def __init__(self, shape: ModelShape, profile: HardwareProfile, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1) -> None:
        if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        if tensor_parallel_size * pipeline_parallel_size > 1 and profile.link_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"profile {profile.name!r} has no link bandwidth for tensor or pipeline parallelism")
        self.shape = shape
        self.profile = profile
        self.tp = tensor_parallel_size
        self.pp = pipeline_parallel_size
        self.peak_flops = profile.peak_flops(shape.dtype)

    def peak_times(self, step: StepShape) -> PeakTimes:
        shape, bandwidth, tp = self.shape, self.profile.memory_bandwidth_bytes_per_s, self.tp
        cost = shape.cost
        matmul_flops = step.num_tokens * cost.body_flops_per_token + step.num_sampled * cost.head_flops_per_token
        # KV heads are split across devices, as the weights and the FLOPs are.
        kv_bytes = (step.num_context_tokens + step.num_tokens) * shape.kv_bytes_per_token
        return PeakTimes(
            weights_s=shape.cost.weight_bytes / tp / bandwidth,
            matmuls_s=matmul_flops / tp / self.peak_flops,
            kv_s=kv_bytes / tp / bandwidth,
            attention_s=step.num_attention_pairs * shape.attention_flops_per_pair / tp / self.peak_flops,
        )

    def price(self, step: StepShape) -> StepCost:
        p = self.profile
        peak = self.peak_times(step)
        combine = max if p.overlap else (lambda a, b: a + b)
        return StepCost(
            overhead_s=p.step_overhead_s + p.seq_overhead_s * step.num_seqs,
            linear_s=combine(peak.weights_s / p.bandwidth_efficiency, peak.matmuls_s / p.matmul_efficiency),
            attention_s=peak.kv_s / p.kv_read_efficiency + peak.attention_s / p.attention_efficiency,
            allreduce_s=self.allreduce_s(step.num_tokens),
            pipeline_s=self.pipeline_s(step.num_tokens, step.num_sampled),
        )

    def pipeline_s(self, num_tokens: int, num_sampled: int) -> float:
        """The step's hand-offs between stages and its logits' trip back to rank 0."""
        if self.pp == 1:
            return 0.0
        p, shape = self.profile, self.shape
        handoff_bytes = 2 * num_tokens * shape.hidden_size * shape.element_size  # hidden and residual
        logits_bytes = num_sampled * shape.vocab_size * shape.element_size
        num_messages = (self.pp - 1) + (1 if num_sampled else 0)
        num_bytes = (self.pp - 1) * handoff_bytes + logits_bytes
        return num_bytes / p.link_bandwidth_bytes_per_s + num_messages * p.link_latency_s

    def allreduce_s(self, num_tokens: int) -> float:
        """Ring all-reduce: each device sends and receives 2·(TP-1)/TP of the buffer."""
        if self.tp == 1:
            return 0.0
        num_bytes = num_tokens * self.shape.allreduce_bytes_per_token  # every all-reduce of the step, together
        num_allreduces = self.shape.num_allreduces_per_step
        p = self.profile
        ring_s = 2 * (self.tp - 1) / self.tp * num_bytes / p.link_bandwidth_bytes_per_s
        return ring_s + num_allreduces * p.link_latency_s
