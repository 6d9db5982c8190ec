"""What an open dashboard costs the serving benchmark: TPOT with no watcher, the feed alone, and a browser.

    python -m scripts.bench.probes.dashboard --json results/bench_dashboard.json [--repeats 3]

One server on the default model (as `make serve` starts it). Each round runs
bench_serving's workload (48 requests, 128 prompt and 64 output tokens, 2 requests/s)
three ways, in an order that rotates from round to round:
  none      nobody watches
  feed      a client reads `GET /dashboard/events` (the server's side of the cost alone)
  browser   headless Chromium shows /dashboard (the feed plus the page's drawing, which on
            a 2-core machine shares the cores with the engine, as a laptop's browser would)
The report gives each way's per-round TPOT medians, their median, the ratio to `none`,
and the spread of the `none` rounds: a ratio inside that spread is noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from contextlib import contextmanager

import requests

from scripts.bench import serving as bench_serving
from scripts.lib.bench_report import write_report
from scripts.lib.local_server import start_server, stop_server


WAYS = ("none", "feed", "browser")


@contextmanager
def watcher(way: str, url: str):
    """Yields a dict of what the watcher saw: feed events, or the page's state and strip at the end."""
    seen = {"num_events": 0}
    if way == "none":
        yield seen
    elif way == "feed":
        stop = threading.Event()

        def follow() -> None:
            with requests.get(url + "/dashboard/events", stream=True, timeout=30) as feed:
                for line in feed.iter_lines():
                    if line.startswith(b"data: "):
                        seen["num_events"] += 1
                    if stop.is_set():
                        return

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join(timeout=5)
    else:
        from scripts.lib.headless_browser import HeadlessChromium

        with HeadlessChromium() as browser:
            browser.driver.get(url + "/dashboard")
            yield seen
            seen["feed_status"] = browser.driver.find_element("id", "feed-status").text
            seen["num_strip_columns"] = browser.driver.execute_script("return strips.length ? strips[0].columns.length : 0")
            seen["console_errors"] = browser.console_errors()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    serving_argv = ["--num-requests", str(args.num_requests), "--input-len", "128", "128", "--output-len", "64", "64",
                    "--request-rate", str(args.request_rate), "--no-progress"]
    process, url, log_path = start_server("smollm2", log_name="bench-dashboard")
    rounds: list[dict] = []
    try:
        for r in range(args.repeats):
            order = ways[r % len(ways):] + ways[:r % len(ways)]
            for way in order:
                with watcher(way, url) as seen:
                    summary = bench_serving.main([*serving_argv, "--base-url", url])["summary"]
                assert summary["num_failed"] == 0, summary
                rounds.append({"round": r, "way": way, "tpot_p50_ms": summary["tpot_s"]["median"] * 1000,
                               "ttft_p50_ms": summary["ttft_s"]["median"] * 1000,
                               "output_throughput": summary["output_throughput"], **seen})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        stop_server(process)
    by_way = {w: [x["tpot_p50_ms"] for x in rounds if x["way"] == w] for w in ways}
    base = statistics.median(by_way["none"]) if by_way.get("none") else None
    report = {
        "config": vars(args),
        "server_log": str(log_path),
        "rounds": rounds,
        "tpot_p50_ms": {w: {"rounds": v, "median": statistics.median(v),
                            "vs_none": statistics.median(v) / base if base else None} for w, v in by_way.items()},
        "none_spread": (min(by_way["none"]) / base, max(by_way["none"]) / base) if base else None,
    }
    print(json.dumps({k: report[k] for k in ("tpot_p50_ms", "none_spread")}, indent=1))
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
