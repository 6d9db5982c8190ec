"""One batch of random prompts decoding in lockstep on the real engine, its steps recorded.

    llm = lockstep_llm("smollm2", num_rows=64, input_len=128, output_len=128, block_size=16)
    prompts = random_prompts(seed=0, vocab_size=llm.engine.model_config.vocab_size, num_rows=64, input_len=128)
    steps, elapsed_s = generate_recorded(llm, prompts, SamplingParams(max_tokens=128, ignore_eos=True))

The engine is sized so that one step prefills every prompt and the whole batch fits the
KV cache at full length: every later step then decodes all B rows, with no preemption to
distort the timing. bench decode and bench logits_processing measure such steps.
"""

from __future__ import annotations

import argparse
import random
import time


def add_lockstep_args(p: argparse.ArgumentParser) -> None:
    """The flags every lockstep bench takes: the model, its dtype, the engine's sizes, the seed and --json."""
    p.add_argument("--model", default="smollm2", help="smollm2 or a local folder with config.json")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: bfloat16 on CUDA and on CPUs with native bf16 matmul, else float32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup-output-len", type=int, default=4)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")


def lockstep_llm(model: str, num_rows: int, input_len: int, output_len: int, block_size: int,
                 num_kv_blocks: int | None = None, max_num_batched_tokens: int | None = None, **engine_args):
    """An LLM (no tokenizer: the prompts are token ids) sized for the batch; None keeps a size's default."""
    from engine.llm import LLM

    blocks_per_seq = -(-(input_len + output_len) // block_size)
    return LLM(
        model,
        skip_tokenizer_init=True,
        block_size=block_size,
        max_num_seqs=num_rows,
        # Room for the whole batch at full length: a preemption would distort the timing.
        num_kv_blocks=num_kv_blocks or num_rows * blocks_per_seq,
        # One step prefills every prompt.
        max_num_batched_tokens=max_num_batched_tokens or max(num_rows * input_len, num_rows),
        **engine_args,
    )


def random_prompts(seed: int, vocab_size: int, num_rows: int, input_len: int) -> list[list[int]]:
    """`num_rows` prompts of `input_len` token ids drawn uniformly from the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_rows)]


def generate_recorded(llm, prompts: list[list[int]], params) -> tuple[list, float]:
    """One generate with the engine's StepStats recorded: its steps and its wall time in seconds.

    Every request must make exactly max_tokens tokens (the params ignore EOS): a shorter one
    would shrink the batch and the steps would no longer be the lockstep batch measured.
    """
    import torch

    engine = llm.engine
    engine.step_stats.clear()
    engine.record_step_stats = True
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # work queued before does not count against this generate
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start
    finally:
        engine.record_step_stats = False
    expected = (params[0] if isinstance(params, list) else params).max_tokens
    lengths = sorted({len(o.token_ids) for o in outputs})
    if lengths != [expected]:
        raise RuntimeError(f"expected {expected} output tokens per request, got lengths {lengths}")
    return list(engine.step_stats), elapsed_s
