"""The ways a step can run on the model, one of which a runner chooses once, at start
(`make_step_executor`), and calls every step:

    PipelineStageStep  this rank's layers between its pipeline neighbours
    CudaGraphStep      CUDA: decode steps replay a captured graph, others run eager
    CompiledStep       CPU, --compile: inductor's forward
    DecodeStackStep    CPU: decode steps (and verification rows) in one C++ call, others eager
    EagerStep          the model's own forward

Each takes a step's `StepInputs` and returns its sampled rows' logits and its pooled rows' final
hidden states. A verification step's rows (`as_rows`: a few short chunks the decode stack may take
as one-token rows) and an embedding request's pooled rows are arguments of that one call, not
branches around it. The tensors are made here, from the inputs' lists, by engine.worker.step_inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache
from engine.cpu.prefetch_tuner import prefetch_tuner_for
from engine.parallel.parallel_state import TensorParallelGroup
from engine.parallel.pipeline import forward_stage
from engine.worker.compilation import attention_step
from engine.worker.step_inputs import StepInputs, selects_output_rows, to_row_tensors, to_tensors
from ipc.speculative_config import MAX_SPECULATIVE_TOKENS


@dataclass
class StepResult:
    logits: torch.Tensor | None  # [num_sampled, vocab_size]; None when none are sampled, and on a worker rank
    pooled: torch.Tensor | None  # [num_pooled, hidden_size]: the rows inputs.pooling_rows names


class EagerStep:
    """The model's own forward. Only the sampled rows leave the last layer; pooled rows follow them."""

    name = "eager"

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], backend: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = device

    def forward(self, inputs: StepInputs, as_rows: bool = False, images=None) -> StepResult:
        """`images`: (batch rows [n], their embeddings [n, hidden]) of a vision-language step's image
        tokens, which take the place of their placeholders' embeddings; such a step runs eager. An M-RoPE
        model's adds the step's positions [3, num_tokens] (engine.worker.mrope_positions)."""
        input_ids, positions, metadata, selected_rows = to_tensors(inputs, self.device)  # sampled, then pooled
        self.backend.prepare(metadata)  # the step's plan, made once for every layer
        if images is not None:
            positions = images[2] if len(images) > 2 else positions
            hidden = EagerStep.run(self, inputs, input_ids, positions, metadata, selected_rows,
                                   merge_images(self.model.embed(input_ids), *images[:2]))
        else:
            hidden = self.run(inputs, input_ids, positions, metadata, selected_rows)
        return self.finish(inputs, hidden)

    def run(self, inputs: StepInputs, input_ids, positions, metadata, selected_rows,
            inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The selected rows' final hidden states, [num_sampled + num_pooled, hidden_size]."""
        output_rows = selected_rows if selects_output_rows(inputs) else None
        return self.model(input_ids, positions, self.kv_caches, self.backend, output_rows, inputs_embeds=inputs_embeds)

    def finish(self, inputs: StepInputs, hidden: torch.Tensor) -> StepResult:
        pooled = None
        if inputs.pooling_rows:
            pooled = hidden[len(inputs.sample_rows):]  # [num_pooled, hidden_size]
            hidden = hidden[: len(inputs.sample_rows)]  # [num_sampled, hidden_size]
        logits = self.model.compute_logits(hidden) if inputs.sample_rows else None  # [num_sampled, vocab_size]
        return StepResult(logits, pooled)


class PipelineStageStep(EagerStep):
    """This rank's stage: receive the hidden states, run its layers, send them on (engine.parallel.pipeline)."""

    name = "pipeline stage"

    def __init__(self, model, kv_caches, backend, device, group: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(model, kv_caches, backend, device)
        self.group = group
        self.dtype = dtype

    def forward(self, inputs: StepInputs, as_rows: bool = False, images=None) -> StepResult:
        if inputs.pooling_rows:
            raise ValueError("embeddings are not supported with pipeline parallelism")
        input_ids, positions, metadata, sample_rows = to_tensors(inputs, self.device)
        self.backend.prepare(metadata)
        logits = forward_stage(self.model, self.group.stage, input_ids, positions, self.kv_caches, self.backend,
                               sample_rows, self.dtype)
        return StepResult(logits, None)


class CudaGraphStep(EagerStep):
    """Decode steps of a captured batch size replay their graph (engine.worker.cuda_graphs)."""

    name = "CUDA graphs"

    def __init__(self, model, kv_caches, backend, device, cuda_graphs) -> None:
        super().__init__(model, kv_caches, backend, device)
        self.cuda_graphs = cuda_graphs

    def run(self, inputs, input_ids, positions, metadata, selected_rows) -> torch.Tensor:
        if self.cuda_graphs.can_run(metadata) and not inputs.has_lora_rows:  # graphs are of the base alone
            return self.cuda_graphs.run(input_ids, positions, metadata)[selected_rows]  # [num_selected, hidden_size]
        return super().run(inputs, input_ids, positions, metadata, selected_rows)


class CompiledStep(EagerStep):
    """inductor's forward of the whole model (engine.worker.compilation); the backend and KV pool
    reach its attention op through `attention_step`."""

    name = "torch.compile"

    def __init__(self, model, kv_caches, backend, device, compiled_forward) -> None:
        super().__init__(model, kv_caches, backend, device)
        self.compiled_forward = compiled_forward

    def run(self, inputs, input_ids, positions, metadata, selected_rows) -> torch.Tensor:
        with attention_step(self.backend, self.kv_caches):
            return self.compiled_forward(input_ids, positions)[selected_rows]  # [num_selected, hidden_size]


class DecodeStackStep(EagerStep):
    """Decode-only steps, and steps of a few tokens per sequence taken as one-token rows (verification,
    a draft's catch-up), in one C++ call (engine.cpu.decode_stack); everything else eager."""

    name = "decode stack"

    def __init__(self, model, kv_caches, backend, device, decode_stack) -> None:
        super().__init__(model, kv_caches, backend, device)
        self.decode_stack = decode_stack
        self.prefetch_tuner = prefetch_tuner_for(model)  # None where no linear has a prefetch switch

    def forward(self, inputs: StepInputs, as_rows: bool = False, images=None) -> StepResult:
        tuner = self.prefetch_tuner
        if tuner is None or images is not None or len(inputs.input_ids) != 1 or inputs.pooling_rows:
            return self._forward(inputs, as_rows, images)
        tuner.begin_step()  # a one-token step: its calls take the tuner's choice of prefetch
        start = time.perf_counter()
        result = self._forward(inputs, as_rows, images)
        tuner.end_step(time.perf_counter() - start)
        return result

    def _forward(self, inputs: StepInputs, as_rows: bool = False, images=None) -> StepResult:
        if images is not None or not self.runs_as_rows(inputs, as_rows):
            return super().forward(inputs, as_rows, images)
        hidden = self.decode_stack.forward_rows(*to_row_tensors(inputs, self.device))  # [num_tokens, hidden_size]
        if len(inputs.sample_rows) < len(inputs.input_ids):
            hidden = hidden[inputs.sample_rows]  # [num_sampled, hidden_size]
        return self.finish(inputs, hidden)

    def run(self, inputs, input_ids, positions, metadata, selected_rows) -> torch.Tensor:
        if (len(inputs.sample_rows) == len(inputs.input_ids) and not inputs.pooling_rows and self.runs_lora(inputs)
                and self.decode_stack.can_run(metadata, self.backend)):
            # A decode-only step: every row is sampled, in order.
            return self.decode_stack.forward(input_ids, positions, metadata, self.backend)  # [num_seqs, hidden_size]
        return super().run(inputs, input_ids, positions, metadata, selected_rows)

    def runs_lora(self, inputs: StepInputs) -> bool:
        """Whether the stack can take the step's adapter rows: none, or the runner gave it the LoRA pool."""
        return not inputs.has_lora_rows or self.decode_stack.has_lora

    def runs_as_rows(self, inputs: StepInputs, as_rows: bool) -> bool:
        """A step of several tokens per sequence that the stack takes as one-token rows: a verification
        step (decodes, some with proposed tokens after them: every row sampled, so none is a prompt's
        middle) or one the caller marks, within the stack's width; none pooled."""
        # A sequence of more tokens than a verification's (a prompt with prompt log-probs) takes the
        # prefill kernel, which reads each key once for all its rows.
        return (1 < max(inputs.query_lens) <= 1 + MAX_SPECULATIVE_TOKENS and not inputs.pooling_rows
                and self.runs_lora(inputs)
                and (as_rows or len(inputs.sample_rows) == len(inputs.input_ids))
                and self.decode_stack.can_run_rows(len(inputs.input_ids)))


def merge_images(embeds: torch.Tensor, rows: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
    """[num_tokens, hidden] token embeddings with `rows` [n] replaced by `image_embeds` [n, hidden]."""
    embeds[rows] = image_embeds.to(embeds.dtype)
    return embeds


def make_step_executor(model: nn.Module, kv_caches: list[KVCache], backend: AttentionBackend, device: torch.device,
                       dtype: torch.dtype, group: TensorParallelGroup | None, cuda_graphs=None,
                       compiled_forward=None, decode_stack=None) -> EagerStep:
    """The one way this runner runs its steps, from what it built at start (at most one of a pipeline
    stage, CUDA graphs, a compiled forward and a decode stack applies to a runner)."""
    parts = (model, kv_caches, backend, device)
    if group is not None and group.stage.is_pipelined:
        return PipelineStageStep(*parts, group, dtype)
    if cuda_graphs is not None and cuda_graphs.is_enabled:
        return CudaGraphStep(*parts, cuda_graphs)
    if compiled_forward is not None:
        return CompiledStep(*parts, compiled_forward)
    if decode_stack is not None:
        return DecodeStackStep(*parts, decode_stack)
    return EagerStep(*parts)
