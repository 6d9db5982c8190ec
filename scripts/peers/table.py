"""The table of scripts/peers/bench.sh: each engine and configuration, offline and serving, in one view.

    .venv/bin/python -m scripts.peers.table results/peers --configs defaults fp32-eager --rates 2 inf \
        --workloads random shared_prefix

Reads {engine}_offline_{config}.json (the random reference workload; ours: scripts/bench/offline.py,
vLLM: scripts/peers/vllm_offline.py), {engine}_offline_{workload}_{config}.json for the other
workloads (shared_prefix: each engine with its prefix caching on; ours also off, as
`continuous_no_prefix_caching`) and {engine}_serving_{config}_rate{R}_rep{K}.json (vLLM's
`bench serve` result format, for both servers; K = 1, 2, ...: the repeats peers/bench.sh
runs alternately against the two servers; a file without _rep{K} is a single run), prints
one row per engine and configuration, and writes the rows to summary.json beside them.
Serving figures are the median over the repeats, each repeat's values beside them in
`*_runs`; our rows also get `*_vs_vllm`, the ratio of the medians. Columns of a workload
other than random start with its name: shared_prefix_offline_total_tok_s,
shared_prefix_hit_rate (cached prompt tokens / prompt tokens), and for ours
shared_prefix_offline_total_tok_s_caching_off and shared_prefix_caching_on_vs_off.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

ENGINES = ("ours", "vllm")
SERVING_KEYS = (("ttft_p50_ms", "median_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms"), ("tpot_p50_ms", "median_tpot_ms"),
                ("out_tok_s", "output_throughput"), ("failed", "failed"))


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def offline_row(report: dict | None) -> dict:
    if report is None:
        return {}
    results = report.get("results", {})
    summary = results.get("continuous") or results.get("vllm") or report.get("summary") or {}
    return {"offline_total_tok_s": summary.get("total_tokens_per_s"),
            "dtype": summary.get("dtype_used") or summary.get("dtype") or report.get("config", {}).get("dtype")}


def workload_row(report: dict | None, workload: str) -> dict:
    """A prefix-sharing workload's offline figures, keys prefixed with its name."""
    if report is None:
        return {}
    results = report.get("results", {})
    on = results.get("continuous") or results.get("vllm") or {}
    off = results.get("continuous_no_prefix_caching")
    row = {f"{workload}_offline_total_tok_s": on.get("total_tokens_per_s"),
           f"{workload}_hit_rate": on.get("prefix_cache_hit_rate")}
    if off:
        row[f"{workload}_offline_total_tok_s_caching_off"] = off.get("total_tokens_per_s")
        if on.get("total_tokens_per_s") and off.get("total_tokens_per_s"):
            row[f"{workload}_caching_on_vs_off"] = on["total_tokens_per_s"] / off["total_tokens_per_s"]
    return row


def serving_reports(folder: Path, engine: str, config: str, rate: str) -> list[dict]:
    """The repeats of one serving run, in repeat order (a single unnumbered run counts as one)."""
    stem = f"{engine}_serving_{config}_rate{rate}"
    pattern = re.compile(rf"{re.escape(stem)}_rep(\d+)\.json")
    numbered = sorted((int(m.group(1)), path) for path in folder.iterdir() if (m := pattern.fullmatch(path.name)))
    if numbered:
        return [json.loads(path.read_text()) for _, path in numbered]
    single = load(folder / f"{stem}.json")
    return [single] if single else []


def serving_row(reports: list[dict], rate: str) -> dict:
    """Each figure's median over the repeats, and the repeats' values in `*_runs`."""
    row = {}
    for key, name in SERVING_KEYS if reports else ():
        values = [report.get(name) for report in reports]
        present = [v for v in values if v is not None]
        row[f"rate{rate}_{key}"] = statistics.median(present) if present else None
        if len(reports) > 1:
            row[f"rate{rate}_{key}_runs"] = values
    return row


def add_ratios_to_vllm(rows: list[dict], rates: list[str]) -> None:
    """Ours over vLLM's, per configuration, in our rows: offline throughput per workload, and
    the serving medians (TTFT, TPOT, output throughput) per rate."""
    vllm_rows = {row["config"]: row for row in rows if row["engine"] == "vllm"}
    serving = [f"rate{rate}_{key}" for rate in rates for key, _ in SERVING_KEYS if key != "failed"]
    for row in rows:
        theirs = vllm_rows.get(row["config"]) if row["engine"] == "ours" else None
        for key in [k for k in row if k.endswith("offline_total_tok_s")] if theirs else []:
            if row[key] and theirs.get(key):
                row[key.removesuffix("_total_tok_s") + "_vs_vllm"] = row[key] / theirs[key]
        for key in serving if theirs else []:
            if row.get(key) and theirs.get(key):
                row[key + "_vs_vllm"] = row[key] / theirs[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--configs", nargs="+", default=["defaults", "fp32-eager"])
    parser.add_argument("--rates", nargs="*", default=["2", "inf"])
    parser.add_argument("--workloads", nargs="*", default=["random", "shared_prefix"])
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        for engine in ENGINES:
            row = {"engine": engine, "config": config}
            if "random" in args.workloads:
                row.update(offline_row(load(args.folder / f"{engine}_offline_{config}.json")))
            for workload in args.workloads:
                if workload != "random":
                    row.update(workload_row(load(args.folder / f"{engine}_offline_{workload}_{config}.json"), workload))
            for rate in args.rates:
                row.update(serving_row(serving_reports(args.folder, engine, config, rate), rate))
            if len(row) > 2:
                rows.append(row)
    add_ratios_to_vllm(rows, args.rates)
    (args.folder / "summary.json").write_text(json.dumps(rows, indent=2))
    # The table shows the medians; the repeats' values are in summary.json.
    columns = sorted({key for row in rows for key in row if not key.endswith("_runs")},
                     key=lambda k: (k not in ("engine", "config", "dtype"), k))
    cells = [columns] + [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    main()
