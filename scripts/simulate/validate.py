"""The simulator against measured runs, in one session on this machine.

    python -m scripts.simulate.validate                  # about 6 minutes on a quiet machine
    python -m scripts.simulate.validate --skip-calibrate # reuse OUT/calibrated.json
    python -m scripts.simulate.validate --repeats 3      # each measured figure the mean of 3 runs

1. calibrates this machine's profile (scripts/simulate/run.py --calibrate, its own workload),
2. measures scripts/bench/offline.py's reference and long-tailed workloads, continuous and static,
   and one scripts/bench/serving.py run (docs/performance.md's serving arguments, our server started by it),
3. simulates each with the calibrated profile and the run's own settings,
4. writes OUT/simulator_validation.json (predicted, measured, error % for each figure)
   and OUT/*_occupancy.png (measured and simulated steps side by side).

The measured runs are noisy where others share the CPU (5-7% between runs of the same
workload here): `machine.load_average_1m` in each bench JSON says how busy it was, and
`--repeats N` measures each workload N times and compares the simulation with the mean,
giving each run's own figure beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

OFFLINE = {  # name: bench_offline arguments beyond --modes continuous,static
    "reference": [],
    "long_tail": ["--distribution", "long_tail"],
}
SERVING = ["--num-requests", "64", "--request-rate", "2", "--input-len", "16", "256", "--output-len", "16", "128"]
STATIC_BATCH_SIZE, MAX_NUM_SEQS = "16", "64"  # bench_offline's and the server's defaults


def run(command: list[str], log: Path) -> None:
    print("+", " ".join(command), flush=True)
    with log.open("w") as f:
        subprocess.run(command, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def suffix(repeat: int) -> str:
    """The first run keeps the plain file names (the plots compare against it)."""
    return "" if repeat == 0 else f"_{repeat + 1}"


def compare(figures: dict[str, tuple[float, list[float]]]) -> dict:
    """Each figure's prediction against the mean of its measured runs (each run's own value beside it)."""
    report = {}
    for name, (predicted, runs) in figures.items():
        measured = sum(runs) / len(runs)
        report[name] = {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured),
                        "measured_runs": runs}
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/simulator_validation")
    p.add_argument("--skip-calibrate", action="store_true")
    p.add_argument("--skip-measure", action="store_true", help="reuse OUT's bench JSONs")
    p.add_argument("--repeats", type=int, default=1, help="measured runs of each workload, compared by their mean")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    profile = out / "calibrated.json"
    if not args.skip_calibrate:
        run([python, "-m", "scripts.simulate.run", "--calibrate", "--profile-out", str(profile)], out / "calibrate.log")
    repeats = range(args.repeats)
    if not args.skip_measure:
        for i in repeats:
            for name, extra in OFFLINE.items():
                run([python, "-m", "scripts.bench.offline", "--modes", "continuous,static", *extra,
                     "--json", str(out / f"bench_{name}{suffix(i)}.json")], out / f"bench_{name}{suffix(i)}.log")
            run([python, "-m", "scripts.bench.serving", *SERVING, "--prefix-caching", "on", "--no-progress",
                 "--json", str(out / f"bench_serving{suffix(i)}.json")], out / f"bench_serving{suffix(i)}.log")

    from scripts.simulate.run import main as simulate

    report = {"profile": json.loads(profile.read_text()), "repeats": args.repeats, "offline": {}, "serving": {}}
    for name, extra in OFFLINE.items():
        benches = [json.loads((out / f"bench_{name}{suffix(i)}.json").read_text()) for i in repeats]
        for mode, seqs in (("continuous", MAX_NUM_SEQS), ("static", STATIC_BATCH_SIZE)):
            measured = [bench["results"][mode] for bench in benches]
            predicted = simulate(["--hardware", str(profile), *extra, "--batching", mode, "--max-num-seqs", seqs,
                                  "--json", str(out / f"sim_{name}_{mode}.json"), "--plot", str(out / f"{name}_{mode}"),
                                  "--compare", str(out / f"bench_{name}.json")])
            report["offline"][f"{name}_{mode}"] = {
                **compare({key: (predicted[key], [m[key] for m in measured]) for key in
                           ("total_tokens_per_s", "elapsed_s", "mean_ttft_s", "median_ttft_s")}),
                "num_steps": {"predicted": predicted["num_steps"], "measured": measured[0]["num_steps"]},
                "load_average_1m": [bench["machine"]["load_average_1m"] for bench in benches],
            }
    servings = [json.loads((out / f"bench_serving{suffix(i)}.json").read_text())["summary"] for i in repeats]
    predicted = simulate(["--hardware", str(profile), *SERVING, "--max-num-seqs", MAX_NUM_SEQS,
                          "--json", str(out / "sim_serving.json")])
    report["serving"] = compare({
        "total_token_throughput": (predicted["total_token_throughput"],
                                   [s["total_token_throughput"] for s in servings]),
        "ttft_p50_s": (predicted["ttft_s"]["median"], [s["ttft_s"]["median"] for s in servings]),
        "ttft_p99_s": (predicted["ttft_s"]["p99"], [s["ttft_s"]["p99"] for s in servings]),
        "tpot_p50_s": (predicted["tpot_s"]["median"], [s["tpot_s"]["median"] for s in servings]),
        "itl_p50_s": (predicted["itl_s"]["median"], [s["itl_s"]["median"] for s in servings]),
    })
    required = [report["offline"][k]["total_tokens_per_s"]["error_pct"] for k in report["offline"]]
    required += [report["serving"][k]["error_pct"] for k in ("ttft_p50_s", "tpot_p50_s")]
    report["max_abs_error_pct_required"] = max(abs(e) for e in required)
    report["load_average_1m_now"] = os.getloadavg()[0]
    path = Path("results/simulator_validation.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    for name, figures in {**report["offline"], "serving": report["serving"]}.items():
        print(name, {k: f"{v['error_pct']:+.1f}%" for k, v in figures.items()
                     if isinstance(v, dict) and "error_pct" in v})
    print(f"largest required error: {report['max_abs_error_pct_required']:.1f}% (wrote {path})")
    return report


if __name__ == "__main__":
    main()
