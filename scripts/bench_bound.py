"""How much faster continuous batching can be than static batching on this machine, for any engine.

    python scripts/bench_bound.py --bench results/bench_offline.json --json results/bench_bound.json

Refilling the batch saves steps, so it saves what a step costs regardless of its size,
and nothing of the work each token brings. How much that is worth depends on the
machine's balance of memory bandwidth and arithmetic, not only on the scheduler. This
script measures that balance here and prices each mode of a `bench_offline.py` run as
an ideal engine would run it: the same steps with the same token counts (read from the
run's per-step stats), each costing exactly its roofline time,

    step time = max(weights read once at the measured bandwidth,
                    step FLOPs at the measured matmul rate)

with no other overhead (attention and element-wise work cost nothing). It prints the
measured machine numbers, each mode's ideal and measured seconds, and the ideal and
measured ratios as JSON. A measured ratio above the ideal one means steps carry
overhead that the ideal engine does not have, which the mode with more steps pays more.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every weight read once per step
    body_flops_per_token: float  # the decoder layers' matmuls, per token
    head_flops_per_token: float  # the logits matmul, per sampled token


@dataclass(frozen=True)
class MachineBalance:
    read_bytes_per_s: float
    matmul_flops_per_s: float


def model_cost(hidden: int, intermediate: int, num_layers: int, num_heads: int, num_kv_heads: int,
               head_dim: int, vocab_size: int, tied_embeddings: bool, element_size: int) -> ModelCost:
    per_layer = hidden * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden + 3 * hidden * intermediate
    embedding = vocab_size * hidden
    num_params = num_layers * per_layer + embedding * (1 if tied_embeddings else 2)
    return ModelCost(num_params * element_size, 2.0 * num_layers * per_layer, 2.0 * embedding)


def ideal_step_s(num_tokens: int, num_seqs: int, cost: ModelCost, machine: MachineBalance) -> float:
    """Roofline time of one step: every sequence samples at most one token."""
    flops = num_tokens * cost.body_flops_per_token + num_seqs * cost.head_flops_per_token
    return max(cost.weight_bytes / machine.read_bytes_per_s, flops / machine.matmul_flops_per_s)


def ideal_run_s(step_stats: dict, cost: ModelCost, machine: MachineBalance) -> float:
    return sum(ideal_step_s(t, s, cost, machine) for t, s in zip(step_stats["num_tokens"], step_stats["num_seqs"]))


def measure_machine(hidden: int, intermediate: int, dtype, repeats: int = 5) -> MachineBalance:
    """Read bandwidth (summing a buffer far larger than the caches) and the prepacked matmul
    rate at an MLP-shaped matmul of 512 tokens, as the engine runs it on the CPU."""
    import torch

    from engine.models.cpu_packing import PackedLinear, bound_primitive_caches, can_prepack

    bound_primitive_caches()
    buffer = torch.ones(256 * 2**20 // 4, dtype=torch.float32)  # 256 MB
    buffer.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        buffer.sum()
    read_bytes_per_s = repeats * buffer.numel() * 4 / (time.perf_counter() - start)

    weight = torch.randn(2 * intermediate, hidden, dtype=dtype)
    if can_prepack(torch.device("cpu"), dtype):
        linear = PackedLinear(weight, None, batch_size_hint=512)
    else:
        linear = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
    x = torch.randn(512, hidden, dtype=dtype)
    with torch.inference_mode():
        linear(x)
        start = time.perf_counter()
        for _ in range(repeats * 4):
            linear(x)
        elapsed = time.perf_counter() - start
    matmul_flops_per_s = repeats * 4 * 2.0 * x.shape[0] * weight.numel() / elapsed
    return MachineBalance(read_bytes_per_s, matmul_flops_per_s)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="a bench_offline.py --json output with continuous and static")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    import torch

    from engine.model_files import resolve_model
    from engine.models.config import ModelConfig

    bench = json.loads(Path(args.bench).read_text())
    modes = [m for m in ("continuous", "static") if m in bench["results"]]
    if len(modes) < 2:
        p.error(f"{args.bench} needs both continuous and static results")
    config = ModelConfig.from_folder(resolve_model(bench["config"]["model"]))
    dtype = torch.bfloat16 if bench["config"].get("dtype") == "bfloat16" else torch.float32
    cost = model_cost(config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
                      config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings,
                      torch.tensor([], dtype=dtype).element_size())
    machine = measure_machine(config.hidden_size, config.intermediate_size, dtype)
    result = {
        "bench": args.bench,
        "machine": {"read_gb_per_s": machine.read_bytes_per_s / 1e9, "matmul_gflop_per_s": machine.matmul_flops_per_s / 1e9},
        "model": {"weight_mb": cost.weight_bytes / 2**20, "gflop_per_token": cost.body_flops_per_token / 1e9},
        "modes": {},
    }
    for mode in modes:
        stats = bench["results"][mode]["step_stats"]
        result["modes"][mode] = {
            "num_steps": len(stats["num_tokens"]),
            "ideal_s": ideal_run_s(stats, cost, machine),
            "measured_s": bench["results"][mode]["elapsed_s"],
        }
    cont, static = result["modes"]["continuous"], result["modes"]["static"]
    result["ideal_ratio"] = static["ideal_s"] / cont["ideal_s"]
    result["measured_ratio"] = static["measured_s"] / cont["measured_s"]
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
