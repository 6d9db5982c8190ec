"""An M-RoPE model's positions (Qwen2.5-VL, engine.models.qwen2_5_vl): a request with images has its
prompt's 3-component positions computed once from its images' grids; each step then gives its tokens

    a text or decode token at sequence position p:  one position, the prompt's (all three alike) or
                                                    p + the request's rope delta past the prompt;
    an image token:                                 its (temporal, height, width), in a [3, num_tokens]
                                                    list for the step's (eager) image path.

So decode steps stay 1D on every fast path, and a prefill chunk that starts or ends inside an image, or
after a prefix-cache hit, takes its tokens' positions from the whole prompt's. Requests without images
keep their positions: their delta is 0.
"""

from __future__ import annotations

import numpy as np

from engine.core.scheduler_output import SchedulerOutput
from engine.models.qwen2_5_vl import mrope_positions
from engine.worker.step_inputs import PreparedStep


class MRopePositions:
    def __init__(self, vision) -> None:
        self.vision = vision  # engine.models.qwen_vision_config.QwenVisionConfig
        self.prompts: dict[str, tuple[np.ndarray, int]] = {}  # request id -> ([3, num_prompt], delta)

    def apply(self, step: PreparedStep, scheduler_output: SchedulerOutput) -> None:
        """Shift `step`'s positions in place; a step with image tokens gets step.mrope_positions too."""
        inputs = step.inputs
        rows: list[tuple[int, int, np.ndarray]] = []  # (first row, end row, [3, n]) of requests with images
        for i, scheduled in enumerate(scheduler_output.scheduled):
            request = scheduled.request
            if not request.images:
                continue
            prompt, delta = self._prompt(request)
            lo, hi = inputs.query_start_loc[i], inputs.query_start_loc[i + 1]
            seq_positions = np.arange(inputs.positions[lo], inputs.positions[lo] + hi - lo)  # [n]
            in_prompt = seq_positions < prompt.shape[1]
            ours = np.where(in_prompt, prompt[:, np.minimum(seq_positions, prompt.shape[1] - 1)],
                            seq_positions + delta)  # [3, n]
            inputs.positions[lo:hi] = ours[0].tolist()  # equal to the others' wherever a 1D path reads it
            rows.append((lo, hi, ours))
        if step.image_slices:
            full = np.tile(np.asarray(inputs.positions, dtype=np.int64), (3, 1))  # [3, num_tokens]
            for lo, hi, ours in rows:
                full[:, lo:hi] = ours
            step.mrope_positions = full.tolist()

    def release(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)

    def _prompt(self, request) -> tuple[np.ndarray, int]:
        entry = self.prompts.get(request.request_id)
        if entry is None:
            entry = self.prompts[request.request_id] = mrope_positions(request.prompt_token_ids, request.images,
                                                                       self.vision)
        return entry
