"""Where one prompt's prefill time goes on a GGUF model, matmul by role and type, JSON out (issue #59).

    flock /tmp/bench.lock python -m scripts.bench.gguf_prefill_profile --model F.gguf --prompt-len 512 \
        --json results/gguf_prefill_profile.json

The engine's own ModelRunner serves the file at its defaults, and one sequence's prompt of
--prompt-len tokens runs as one step's forward (the model's layers; the head's one row and
sampling are a decode step's, scripts/bench/gguf_decode_profile.py). Each GgufLinear call is
timed by hooks around it and grouped by role and the GGUF types of its parts ("gate_up_proj
Q4_K", "down_proj Q6_K"), with its multiply-adds as GOPS (2 x tokens x in x out per second);
`other` is the forward less those calls: attention, the norms, rotary and the KV store, SiLU×up.
Times are the fastest of --repeats forwards, after a warm-up. scripts/bench/gguf_decode_profile.py
covers one-token steps.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import defaultdict

import torch

from engine.config import EngineConfig
from engine.cpu.gguf_linear import GgufLinear
from engine.loader.model_files import resolve_model
from engine.models.config import ModelConfig
from engine.worker.model_runner import ModelRunner
from scripts.bench.gguf_decode_profile import type_label
from scripts.bench.probes.fused import step_inputs
from scripts.lib.bench_report import machine_info, run_and_report

logger = logging.getLogger(__name__)


def timed_linears(model: torch.nn.Module, seconds: dict[str, float]) -> dict[str, list]:
    """Hooks adding each GgufLinear call's seconds to seconds[label]; returns label -> its modules."""
    started: dict[str, float] = {}
    modules = defaultdict(list)
    for name, module in model.named_modules():
        if not isinstance(module, GgufLinear) or name.endswith("lm_head"):
            continue
        label = f"{name.rsplit('.', 1)[-1]} {type_label(module)}"
        modules[label].append(module)

        def before(_module, _inputs, label=label):
            started[label] = time.perf_counter()

        def after(_module, _inputs, _output, label=label):
            seconds[label] += time.perf_counter() - started[label]

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    return modules


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    block_size = 16
    _, positions, metadata, num_blocks = step_inputs([args.prompt_len], [args.prompt_len], block_size)
    model_config = ModelConfig.from_folder(path)
    input_ids = torch.randint(0, model_config.vocab_size, (args.prompt_len,),
                              generator=torch.Generator().manual_seed(0))  # [prompt_len]
    config = EngineConfig(model=path, block_size=block_size, max_num_seqs=1)
    runner = ModelRunner(config, model_config, num_blocks + 1, args.prompt_len + 1)
    seconds: dict[str, float] = defaultdict(float)
    modules = timed_linears(runner.model, seconds)
    best_total, best = float("inf"), {}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # a warm-up first
            seconds.clear()
            start = time.perf_counter()
            runner.backend.prepare(metadata)
            runner.model(input_ids, positions, runner.kv_caches, runner.backend)
            total = time.perf_counter() - start
            if repeat > 0 and total < best_total:
                best_total, best = total, dict(seconds)
    ops = {}
    for label, seconds_spent in sorted(best.items(), key=lambda item: -item[1]):
        macs = sum(args.prompt_len * m.in_features * m.out_features for m in modules[label])
        ops[label] = {"calls": len(modules[label]), "ms": round(seconds_spent * 1e3, 1),
                      "share": round(seconds_spent / best_total, 3), "gops": round(2 * macs / seconds_spent / 1e9, 1)}
    other = best_total - sum(best.values())
    ops["other"] = {"ms": round(other * 1e3, 1), "share": round(other / best_total, 3)}
    report = {"model": str(args.model), "prompt_len": args.prompt_len, "threads": args.threads,
              "forward_ms": round(best_total * 1e3, 1), "prefill_tok_s": round(args.prompt_len / best_total, 1),
              "ops": ops, "machine": machine_info()}
    logger.info("prefill of %d tokens: %.0f ms (%.1f tok/s)", args.prompt_len, best_total * 1e3,
                report["prefill_tok_s"])
    for label, entry in ops.items():
        logger.info("%-26s %7.1f ms %4.0f%%  %s", label, entry["ms"], 100 * entry["share"],
                    f"{entry['gops']:6.1f} GOPS" if "gops" in entry else "")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .gguf file (or anything --model takes)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
