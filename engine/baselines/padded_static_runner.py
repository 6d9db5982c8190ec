"""The padded static baseline's model runner: `ModelRunner`, plus the pad rows its scheduler asks for.

A `PaddedSchedulerOutput` (engine.baselines.padded_static_scheduler) carries the real rows and the pad
rows computed beside them. The real rows are prepared as in every mode; the pad rows follow
them in the same flat batch, each its own sequence, so no real token attends to them:

    prefill:  a a a | b b b b b | pad pad     a's left padding: through every layer, KV to the scratch
    decode:   b     | pad                     a has finished: its pad decode is sampled, the token dropped

Only this baseline pays for the pad rows; the continuous path never sees one.
"""

from __future__ import annotations

import logging

import torch

from engine.core.block_manager import num_blocks_for
from engine.worker.step_inputs import StepInputs
from engine.worker.model_runner import ModelRunner
from engine.baselines.padded_static_scheduler import PaddedSchedulerOutput, PaddingRow
from engine.core.scheduler_output import SampledToken
from engine.worker.step_inputs import append_chunk, pad_block_tables

logger = logging.getLogger(__name__)


class PaddedStaticRunner(ModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The pad rows' token: any id computes the same; EOS, as transformers pads
        eos_token_ids = self.model_config.eos_token_ids
        self.pad_token_id = eos_token_ids[0] if eos_token_ids else 0

    @torch.inference_mode()
    def execute(self, scheduler_output: PaddedSchedulerOutput) -> dict[str, SampledToken]:
        step = self.prepare_step(scheduler_output)
        add_padding_rows(step.inputs, scheduler_output.padding, self.pad_token_id, self.block_size)
        logits = self.run_step(step)
        num_discarded = sum(1 for row in scheduler_output.padding if row.is_sampling)
        if num_discarded:
            # Finished rows: sampled, as a padded engine samples every row, then dropped.
            _discarded = logits[-num_discarded:].argmax(dim=-1)  # [num_discarded]
            logits = logits[:-num_discarded]  # [num_logits_rows - num_discarded, vocab_size]
        return self.sample_step(scheduler_output, step, logits)


def add_padding_rows(inputs: StepInputs, padding: list[PaddingRow], pad_token_id: int, block_size: int) -> None:
    """Append the pad rows to `inputs`, after the real rows (a sampled pad row's logits come last)."""
    if not padding:
        return
    for row in padding:
        end = row.start + row.num_tokens
        # A pad row's table stops at its last block, so a decode step keeps to the CUDA graphs' width.
        append_chunk(inputs, [pad_token_id] * row.num_tokens, row.start,
                     row.block_ids[: num_blocks_for(end, block_size)], block_size)
        if row.is_sampling:
            inputs.sample_rows.append(len(inputs.input_ids) - 1)
    inputs.block_tables = pad_block_tables(inputs.block_tables)
