"""Where one decode step's time goes on a GGUF model, op by op, JSON out (issue #59).

    flock /tmp/bench.lock python -m scripts.bench.gguf_decode_profile --model F.gguf --json results/gguf_profile.json

The engine's own ModelRunner serves the file at its defaults (decode stack, work pool, the
kernels' threads), and one sequence decodes --steps one-token steps at --context tokens of
context. Each step is timed in its parts:

- `embed`, `rotary` (the tables), `final_norm`, `lm_head` (the tied output head, Q6_K over the
  whole vocabulary in a Q4_K_M file) and `sample` (argmax) from Python, as the runner calls them;
- inside the decode stack's C++ loop (`DecodeStack.set_profiling`), per layer: the norms, the
  rotary + KV store, attention, silu×mul and each matmul (qkv, o, gate_up, down), a clock read
  between ops;
- `stack_region`: the stack's call less its marks (entering and leaving the work pool's region,
  and the final norm where the stack ends with it: then `final_norm` is 0);
- `final_norm_warm`: the final norm's call once more, straight after the first (not part of the
  step): the first runs on the caches the layers' weight stream left, so the gap is what the step's
  Python pays for a cold cache, call by call.

What a server adds per token beside this (scheduling, sampling's bookkeeping, the frontend) is
one over scripts/bench/single_user.py's decode tok/s less this step.

Each matmul's figures are grouped by role and the GGUF types of its parts ("gate_up Q4_K",
"down Q6_K", "qkv Q4_K+Q6_K"), with its weight bytes, GB/s and share of the stream rate (the
kernels' own threads reading 8 MB slices, scripts/bench/gguf_kernels.py's figure). Times are
medians over the steps (per step: each op summed over its layers), with the fast decile beside
them; `fixed_us` is a one-row call of each type (quantizing the activations, the hand-out),
the per-call cost that a matmul pays beside its read.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict

import torch

from engine.config import EngineConfig
from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import GgufLinear
from engine.loader.model_files import resolve_model
from engine.models.config import ModelConfig
from engine.worker.model_runner import ModelRunner
from scripts.bench.gguf_kernels import random_blocks, stream_rate, time_calls
from scripts.bench.probes.fused import step_inputs
from scripts.lib.bench_report import machine_info, run_and_report

logger = logging.getLogger(__name__)

PHASES = ("norm", "qkv", "rotary_store", "attention", "o_proj", "post_norm", "gate_up", "silu_mul", "down")
MATMULS = {"qkv": "qkv_proj", "o_proj": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


def linear_of(layer, phase: str) -> torch.nn.Module:
    owner = layer.mlp if phase in ("gate_up", "down") else layer.self_attn
    return getattr(owner, MATMULS[phase])


def type_label(linear: torch.nn.Module) -> str:
    if not isinstance(linear, GgufLinear):
        return type(linear).__name__
    return "+".join(dict.fromkeys(linear.type_names))  # the parts' types, in order, once each


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"us": round(statistics.median(ordered) * 1e6, 1), "us_p10": round(ordered[len(ordered) // 10] * 1e6, 1)}


def profile_steps(runner: ModelRunner, context: int, num_steps: int, block_size: int) -> tuple[dict, list]:
    """Per step: each part's seconds (Python-side parts, and the stack's phase sums per layer)."""
    stack_step = runner.decode_stack
    model, native = runner.model, stack_step._stack
    parts = defaultdict(list)
    layer_phases = []  # per step: [num_layers, phases] seconds
    with torch.inference_mode():
        for step in range(num_steps + 2):  # two warm-ups
            input_ids, positions, metadata, _ = step_inputs([1], [context], block_size)
            t0 = time.perf_counter()
            runner.backend.prepare(metadata)
            block_tables, seq_lens = runner.backend.decode_tables()
            t1 = time.perf_counter()
            hidden = model.embed(input_ids)  # [1, hidden]
            t2 = time.perf_counter()
            cos, sin = model.rotary.cos_sin(positions, model.attention_dtype or hidden.dtype)
            t3 = time.perf_counter()
            native.set_profiling(True)
            hidden, residual = native.forward(hidden, cos.squeeze(1), sin.squeeze(1), metadata.slot_mapping,
                                              block_tables, seq_lens)
            t4 = time.perf_counter()
            phases = native.phase_seconds()  # [num_layers, phases]
            native.set_profiling(False)
            t_spare = t5 = t_warm = time.perf_counter()
            if not stack_step._has_final_norm:  # else the stack's call ended with it (inside stack_region)
                spare = hidden.clone(), residual.clone()  # the same call again, warm (final_norm_warm)
                t_spare = time.perf_counter()
                hidden, _ = model.norm(hidden, residual)
                t5 = time.perf_counter()
                model.norm(*spare)
                t_warm = time.perf_counter()
            outside = (t_spare - t4) + (t_warm - t5)  # not the step's: the spare copies and the warm call
            logits = model.compute_logits(hidden)  # [1, vocab] fp32
            t6 = time.perf_counter()
            logits.argmax(dim=-1)
            t7 = time.perf_counter()
            if step < 2:
                continue
            for name, seconds in (("prepare", t1 - t0), ("embed", t2 - t1), ("rotary", t3 - t2), ("stack", t4 - t3),
                                  ("final_norm", t5 - t_spare), ("final_norm_warm", t_warm - t5),
                                  ("lm_head", t6 - t_warm), ("sample", t7 - t6), ("step", t7 - t0 - outside)):
                parts[name].append(seconds)
            layer_phases.append(phases)
    return parts, layer_phases


def fixed_costs(types: set[str], threads: int) -> dict:
    """One-row, 2048-input calls of each type: the matmul's cost beside its read."""
    torch.set_num_threads(threads)
    generator = __import__("numpy").random.default_rng(0)
    result = {}
    for type_name in sorted(types):
        layer = GgufLinear([(type_name, random_blocks(type_name, 8, 2048, generator))], 2048)
        result[type_name] = round(time_calls([layer], torch.randn(1, 2048, dtype=torch.bfloat16), 0.3)[1] * 1e6, 1)
    return result


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model_config = ModelConfig.from_folder(path)
    block_size = 16
    num_blocks = -(-args.context // block_size) + 1
    config = EngineConfig(model=path, block_size=block_size, max_num_seqs=1)
    runner = ModelRunner(config, model_config, num_blocks, args.context + 1)
    if runner.decode_stack is None:
        raise SystemExit("this model's steps do not run on the decode stack; see the runner's log")
    stream = stream_rate(threads=args.threads)
    rate = stream["slice_gb_s"]
    kernels = load_gguf_kernels()
    kernels.set_one_token_prefetch(args.prefetch == "on")  # not the tuner's: these steps are not the engine's
    try:
        parts, layer_phases = profile_steps(runner, args.context, args.steps, block_size)
    finally:
        kernels.set_one_token_prefetch(True)
    stack = torch.stack(layer_phases)  # [steps, layers, phases]
    ops: dict[str, dict] = {}
    groups = defaultdict(list)  # (phase, types) -> layer indices
    for i, layer in enumerate(runner.model.layers):
        for p, phase in enumerate(PHASES):
            label = f"{phase} {type_label(linear_of(layer, phase))}" if phase in MATMULS else phase
            groups[label].append((i, p))
    for label, cells in groups.items():
        per_step = [sum(float(stack[s, i, p]) for i, p in cells) for s in range(stack.shape[0])]
        entry = {"calls": len(cells), **summary(per_step)}
        phase = label.split(" ")[0]
        if phase in MATMULS:
            weight_bytes = sum(linear_of(runner.model.layers[i], phase).num_weight_bytes for i, _ in cells)
            entry.update(weight_bytes=weight_bytes, gb_s=round(weight_bytes / entry["us"] / 1e3, 2),
                         share_of_stream=round(weight_bytes / entry["us"] / 1e3 / rate, 3))
        ops[label] = entry
    head = runner.model.lm_head
    for name in ("prepare", "embed", "rotary", "final_norm", "final_norm_warm", "lm_head", "sample"):
        ops[name] = {"calls": 1, **summary(parts[name])}
    if isinstance(head, GgufLinear):
        ops["lm_head"].update(types=type_label(head), weight_bytes=head.num_weight_bytes,
                              gb_s=round(head.num_weight_bytes / ops["lm_head"]["us"] / 1e3, 2),
                              share_of_stream=round(head.num_weight_bytes / ops["lm_head"]["us"] / 1e3 / rate, 3))
    # The stack's time outside its marks, step by step (medians do not add up): mostly the end of
    # the pool's OpenMP region, where the master waits for its helper to leave.
    timed = stack.sum(dim=(1, 2)).tolist()  # [steps] seconds inside the stack's marks
    untimed = [total - inside for total, inside in zip(parts["stack"], timed)]
    ops["stack_region"] = {"calls": 1, **summary(untimed)}
    step = summary(parts["step"])
    weight_bytes = sum(m.num_weight_bytes for m in runner.model.modules() if isinstance(m, GgufLinear))
    types = {t for m in runner.model.modules() if isinstance(m, GgufLinear) for t in m.type_names}
    report = {
        "model": str(args.model), "context": args.context, "steps": args.steps, "threads": args.threads,
        "prefetch": args.prefetch,
        "stream": stream, "step": step, "tok_s": round(1e6 / step["us"], 1),
        "weight_bytes": weight_bytes,
        "weight_gb_s": round(weight_bytes / step["us"] / 1e3, 2),
        "share_of_stream": round(weight_bytes / step["us"] / 1e3 / rate, 3),
        "ops": ops, "fixed_us": fixed_costs(types, args.threads), "machine": machine_info(),
    }
    log_table(report)
    return report


def log_table(report: dict) -> None:
    step_us = report["step"]["us"]
    logger.info("step %.0f us (%.1f tok/s), weights %.2f GB/s = %.0f%% of the stream rate %.1f GB/s", step_us,
                report["tok_s"], report["weight_gb_s"], 100 * report["share_of_stream"],
                report["stream"]["slice_gb_s"])
    for label, entry in sorted(report["ops"].items(), key=lambda item: -item[1]["us"]):
        rate = f"{entry['gb_s']:6.1f} GB/s {entry['share_of_stream']:4.0%}" if "gb_s" in entry else ""
        logger.info("%-24s %3d calls %8.1f us %4.0f%%  %s", label, entry["calls"], entry["us"],
                    100 * entry["us"] / step_us, rate)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .gguf file (or anything --model takes)")
    parser.add_argument("--context", type=int, default=256, help="tokens of context at each step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prefetch", choices=("on", "off"), default="on",
                        help="one-token calls' software prefetch (engine/cpu/prefetch_tuner.py picks it when serving)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
