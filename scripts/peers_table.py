"""The table of scripts/bench_peers.sh: each engine and configuration, offline and serving, in one view.

    .venv/bin/python scripts/peers_table.py results/peers --configs defaults fp32-eager --rates 2 inf

Reads {engine}_offline_{config}.json (ours: bench_offline.py; vLLM: bench_vllm_offline.py) and
{engine}_serving_{config}_rate{R}.json (vLLM's `bench serve` result format, for both servers),
prints one row per engine and configuration, and writes the rows to summary.json beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ENGINES = ("ours", "vllm")


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def offline_row(report: dict | None) -> dict:
    if report is None:
        return {}
    results = report.get("results", {})
    summary = results.get("continuous") or results.get("vllm") or report.get("summary") or {}
    return {"offline_total_tok_s": summary.get("total_tokens_per_s"),
            "dtype": summary.get("dtype_used") or summary.get("dtype") or report.get("config", {}).get("dtype")}


def serving_row(report: dict | None, rate: str) -> dict:
    if report is None:
        return {}
    return {f"rate{rate}_{key}": report.get(name) for key, name in (
        ("ttft_p50_ms", "median_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms"), ("tpot_p50_ms", "median_tpot_ms"),
        ("out_tok_s", "output_throughput"), ("failed", "failed"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--configs", nargs="+", default=["defaults", "fp32-eager"])
    parser.add_argument("--rates", nargs="+", default=["2", "inf"])
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        for engine in ENGINES:
            row = {"engine": engine, "config": config, **offline_row(load(args.folder / f"{engine}_offline_{config}.json"))}
            for rate in args.rates:
                row.update(serving_row(load(args.folder / f"{engine}_serving_{config}_rate{rate}.json"), rate))
            if len(row) > 2:
                rows.append(row)
    (args.folder / "summary.json").write_text(json.dumps(rows, indent=2))
    columns = sorted({key for row in rows for key in row}, key=lambda k: (k not in ("engine", "config", "dtype"), k))
    cells = [columns] + [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
