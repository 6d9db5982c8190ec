"""scripts/bench/probes/ipc.py runs end to end and reports what it promises, as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO_ROOT


def test_bench_ipc_reports_json():
    result = subprocess.run([sys.executable, "-m", "scripts.bench.probes.ipc", "--num-requests", "200", "--concurrency", "16",
                             "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for layer in ("raw", "client"):
        numbers = report[layer]
        assert numbers["num_requests"] == 200
        assert 0 < numbers["round_trip_p50_us"] <= numbers["round_trip_p99_us"]
        assert numbers["requests_per_s"] > 0 and numbers["messages_per_s"] >= numbers["requests_per_s"]
