"""bench_offline's "hf" mode: transformers' own static batching on the same workload."""

from __future__ import annotations

import time

from engine.core.step_stats import PaddedStepStats
from scripts.lib.offline_result import ModeResult, useful_positions
from scripts.lib.workload import WorkloadRequest


def run_hf(workload: list[WorkloadRequest], args, model_path: str) -> ModeResult:
    """transformers' static batching: left-padded batches, every row runs to the batch's
    longest output (min_new_tokens = max_new_tokens, so EOS cannot end a row early)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from engine.config import EngineConfig
    from engine.worker.device_and_dtype import resolve_device_and_dtype

    class StepTimes(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token column."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    startup = time.perf_counter()
    device, dtype = resolve_device_and_dtype(EngineConfig(model=args.model, dtype=args.dtype))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    startup_s = time.perf_counter() - startup
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id
    if isinstance(pad_token_id, list):
        pad_token_id = pad_token_id[0]

    def generate(batch: list[WorkloadRequest], streamer=None):
        num_padded = max(r.num_prompt_tokens for r in batch)
        num_new = max(r.max_tokens for r in batch)
        # Left padding keeps every row's last prompt token in the last column; the mask hides the pads.
        num_pads = [num_padded - r.num_prompt_tokens for r in batch]
        input_ids = torch.tensor([[pad_token_id] * n + r.prompt_token_ids for n, r in zip(num_pads, batch)])
        attention_mask = torch.tensor([[0] * n + [1] * r.num_prompt_tokens for n, r in zip(num_pads, batch)])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=pad_token_id,
                streamer=streamer,
            )
        if out.shape[1] != num_padded + num_new:
            raise RuntimeError(f"hf: expected {num_padded + num_new} columns, got {out.shape[1]}")
        return num_padded, num_new

    generate([WorkloadRequest(r.prompt_token_ids, 4) for r in workload[: args.hf_batch_size]])  # warm-up: one batch
    batches = [workload[i : i + args.hf_batch_size] for i in range(0, len(workload), args.hf_batch_size)]
    ttfts, latencies, step_stats = [], [], []
    num_computed = 0
    start = time.perf_counter()
    for batch in batches:
        timer = StepTimes()
        num_padded, num_new = generate(batch, timer)
        times = timer.times  # times[0]: before prefill; times[k]: token k of every row is out
        num_computed += len(batch) * (num_padded + num_new - 1)
        for r in batch:
            ttfts.append(times[1] - start)
            latencies.append(times[r.max_tokens] - start)
        # Steps as the engine records them, counting only rows that still need their tokens.
        # Its padding is counted as static-padded's: left padding, and the rows already done.
        num_prompt = sum(r.num_prompt_tokens for r in batch)
        step_stats.append(PaddedStepStats(
            start_time=times[0], end_time=times[1], num_seqs=len(batch), num_tokens=num_prompt,
            num_prefill_tokens=num_prompt, num_decode_tokens=0, num_kv_blocks_used=0,
            num_prefill_requests=len(batch), num_padding_tokens=len(batch) * num_padded - num_prompt))
        for k in range(1, num_new):
            num_live = sum(1 for r in batch if r.max_tokens > k)
            step_stats.append(PaddedStepStats(
                start_time=times[k], end_time=times[k + 1], num_seqs=num_live, num_tokens=num_live,
                num_prefill_tokens=0, num_decode_tokens=num_live, num_kv_blocks_used=0,
                num_decode_requests=num_live, num_finished_row_tokens=len(batch) - num_live))
    elapsed = time.perf_counter() - start
    del model
    return ModeResult(
        mode="hf",
        elapsed_s=elapsed,
        num_requests=len(workload),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in workload),
        num_output_tokens=sum(r.max_tokens for r in workload),
        num_useful_positions=useful_positions(workload),
        num_computed_positions=num_computed,
        ttfts=ttfts,
        latencies=latencies,
        step_stats=step_stats,
        dtype=str(dtype).removeprefix("torch."),
        startup_s=startup_s,
    )
