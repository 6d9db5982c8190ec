"""How much faster continuous batching can be than static batching on this machine, for any engine.

    python -m scripts.bench.probes.bound --bench results/bench_offline.json --json results/bench_bound.json

Refilling the batch saves steps, so it saves what a step costs regardless of its size,
and nothing of the work each token brings. How much that is worth depends on the
machine's balance of memory bandwidth and arithmetic, not only on the scheduler. This
script measures that balance here and prices each mode of a `scripts/bench/offline.py` run as
an ideal engine would run it: the same steps with the same token counts (read from the
run's per-step stats), each costing only its weight read (every weight once, at the
measured bandwidth) and its matmul FLOPs (at the measured rate), either overlapped,

    step time = max(read, matmul)      ("ideal")
    step time = read + matmul          ("ideal, no overlap")

with no other overhead (attention and element-wise work cost nothing). It prints the
measured machine numbers, each mode's ideal and measured seconds, and the ideal and
measured ratios as JSON. A measured ratio above the ideal one means steps carry
overhead that the ideal engine does not have, which the mode with more steps pays more.
Faster memory (relative to arithmetic) makes the fixed part of a step smaller and so
lowers the ideal ratio; each rate is the best of several timings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The arithmetic and the measurements are the capacity simulator's (engine/simulator/).
from engine.simulator.calibration import MachineBalance, measure_machine
from engine.simulator.model_shape import ModelCost, model_cost
from scripts.lib.bench_report import write_report


def ideal_step_s(num_tokens: int, num_seqs: int, cost: ModelCost, machine: MachineBalance, overlap: bool = True) -> float:
    """Time of one step for an engine with no overhead; every sequence samples at most one token."""
    flops = num_tokens * cost.body_flops_per_token + num_seqs * cost.head_flops_per_token
    read_s, matmul_s = cost.weight_bytes / machine.read_bytes_per_s, flops / machine.matmul_flops_per_s
    return max(read_s, matmul_s) if overlap else read_s + matmul_s


def ideal_run_s(step_stats: dict, cost: ModelCost, machine: MachineBalance, overlap: bool = True) -> float:
    steps = zip(step_stats["num_tokens"], step_stats["num_seqs"])
    return sum(ideal_step_s(t, s, cost, machine, overlap) for t, s in steps)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="a scripts/bench/offline.py --json output with continuous and static")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    import torch

    from engine.loader.model_files import resolve_model
    from engine.models.config import ModelConfig

    bench = json.loads(Path(args.bench).read_text())
    modes = [m for m in ("continuous", "static") if m in bench["results"]]
    if len(modes) < 2:
        p.error(f"{args.bench} needs both continuous and static results")
    config = ModelConfig.from_folder(resolve_model(bench["config"]["model"]))
    device = "cuda" if bench["machine"].get("cuda") else "cpu"
    # The dtype the run actually used ("auto" resolved); older JSON has only the configured one.
    dtype_name = bench["results"]["continuous"].get("dtype") or bench["config"].get("dtype") or "float32"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    cost = model_cost(config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
                      config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings,
                      torch.tensor([], dtype=dtype).element_size())
    machine = measure_machine(cost.weight_bytes, config.hidden_size, config.intermediate_size, dtype, device)
    result = {
        "bench": args.bench,
        "device": device,
        "dtype": dtype_name,
        "machine": {"read_gb_per_s": machine.read_bytes_per_s / 1e9, "matmul_gflop_per_s": machine.matmul_flops_per_s / 1e9},
        "model": {"weight_mb": cost.weight_bytes / 2**20, "gflop_per_token": cost.body_flops_per_token / 1e9},
        "modes": {},
    }
    for mode in modes:
        stats = bench["results"][mode]["step_stats"]
        result["modes"][mode] = {
            "num_steps": len(stats["num_tokens"]),
            "ideal_s": ideal_run_s(stats, cost, machine),
            "ideal_no_overlap_s": ideal_run_s(stats, cost, machine, overlap=False),
            "measured_s": bench["results"][mode]["elapsed_s"],
        }
    cont, static = result["modes"]["continuous"], result["modes"]["static"]
    result["ideal_ratio"] = static["ideal_s"] / cont["ideal_s"]
    result["ideal_ratio_no_overlap"] = static["ideal_no_overlap_s"] / cont["ideal_no_overlap_s"]
    result["measured_ratio"] = static["measured_s"] / cont["measured_s"]
    print(json.dumps(result, indent=2))
    write_report(args.json, result, indent=2)
    return result


if __name__ == "__main__":
    main()
