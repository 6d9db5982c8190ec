"""What the simulator's step cost (engine/simulator/step_cost.py) says tensor and pipeline
parallelism cost across hosts: one GPU a host, 1, 2, 4 and 8 hosts, over an InfiniBand and an
Ethernet link, for a decode step and a prefill step (docs/scale-out.md).

    python -m scripts.simulate.scale_out --model llama-3-70b --json results/scale_out.json

TP splits every layer across the hosts (2 all-reduces a layer over the link); PP gives each
host consecutive layers and passes (hidden, residual) on once per stage, the stages one after
another (no overlap in engine.parallel.pipeline), so PP's step is the whole model's compute
plus its hand-offs, and TP's is 1/N of it plus its all-reduces. Memory per host: weights / N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from engine.simulator.hardware_profile import load_profile
from engine.simulator.step_cost import StepCostModel, StepShape
from scripts.lib.bench_report import write_report
from scripts.simulate.inputs import model_shape_for

logger = logging.getLogger("scale_out")

# Between hosts: (bandwidth each way in bytes/s, seconds per message). InfiniBand NDR 400 Gb/s
# and 25 Gb/s Ethernet; latencies are typical NCCL small-message figures, not measured here.
LINKS = {"ib-400g": (50e9, 10e-6), "eth-25g": (3.125e9, 50e-6)}
HOSTS = (1, 2, 4, 8)


def steps(num_decode_seqs: int, context_len: int, prefill_len: int) -> dict[str, StepShape]:
    decode = StepShape(num_decode_seqs, num_decode_seqs, num_decode_seqs, num_decode_seqs * (context_len + 1),
                       num_decode_seqs * (context_len + 1))
    prefill = StepShape(1, prefill_len, 1, prefill_len, prefill_len * (prefill_len + 1) // 2)
    return {f"decode ({num_decode_seqs} seqs x {context_len} ctx)": decode, f"prefill ({prefill_len} tokens)": prefill}


def price_all(model: str, hardware: str, dtype: str, step_shapes: dict[str, StepShape]) -> list[dict]:
    shape = model_shape_for(model, dtype)
    base = load_profile(hardware)
    rows = []
    for link, (bandwidth, latency) in LINKS.items():
        profile = dataclasses.replace(base, link_bandwidth_bytes_per_s=bandwidth, link_latency_s=latency)
        for num_hosts in HOSTS:
            for mode in ("tp", "pp"):
                if num_hosts == 1 and mode == "pp":
                    continue
                tp, pp = (num_hosts, 1) if mode == "tp" else (1, num_hosts)
                if pp > shape.num_layers or shape.num_heads % tp:
                    continue
                model_cost = StepCostModel(shape, profile, tp, pp)
                weight_bytes = shape.cost.weight_bytes / num_hosts
                row = {"link": link, "hosts": num_hosts, "mode": mode if num_hosts > 1 else "one host",
                       "weight_gb_per_host": round(weight_bytes / 1e9, 1),
                       "fits_in_memory": weight_bytes < profile.memory_bytes * profile.memory_utilization}
                for name, step in step_shapes.items():
                    cost = model_cost.price(step)
                    row[name] = {"step_ms": round(1e3 * cost.total_s, 2),
                                 "link_ms": round(1e3 * (cost.allreduce_s + cost.pipeline_s), 2)}
                rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-70b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode-seqs", type=int, default=32)
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    step_shapes = steps(args.decode_seqs, args.context_len, args.prefill_len)
    rows = price_all(args.model, args.hardware, args.dtype, step_shapes)
    for row in rows:
        logger.info("%s", json.dumps(row))
    report = {"config": vars(args), "links": {k: {"bytes_per_s": b, "latency_s": l} for k, (b, l) in LINKS.items()},
              "rows": rows}
    write_report(args.json, report, logger=logger)
    return report


if __name__ == "__main__":
    main()
