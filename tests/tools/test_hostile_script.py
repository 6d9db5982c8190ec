"""scripts/hostile/run.py --quick against a server it starts itself: every case and final check must pass.

It fails until the server-side fixes for the defects the cases name are merged (OOV ids,
abort races, slowloris, hung cores, ...); the assertion message lists the failing cases.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

TIMEOUT_S = 900  # --quick took 7 min on 2 busy cores with today's failures (core restarts, timeouts); less once fixed


@pytest.mark.slow
def test_hostile_quick_run_passes(tmp_path):
    report_path = tmp_path / "hostile.json"
    run = subprocess.run([sys.executable, "-m", "scripts.hostile.run", "--quick", "--json",
                          str(report_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report_path.exists(), f"no report (exit {run.returncode}): {run.stderr[-3000:]}"
    report = json.loads(report_path.read_text())
    failed = {name: case for name, case in report["cases"].items() if case.get("passed") is False}
    for case in failed.values():  # the fuzzer lists up to 40 problems; five say enough here
        if "problems" in case:
            case["problems"] = case["problems"][:5]
    assert not failed, (f"failed cases {sorted(failed)}, failed final checks {report['failed_final_checks']}:\n"
                        f"{json.dumps(failed, indent=1, default=str)[:8000]}")
    assert not report["skipped_cases"], report["skipped_cases"]
    final = report["final_checks"]
    assert final["health_200"] and final["kv_blocks_used_when_idle"] == 0, final
    assert final["baseline_text_same"] and final["baseline_token_ids_same"], (report["baseline"],
                                                                              report["baseline_end"])
    assert final["core_pid_same_after_fuzz"], report["core_pid"]
    assert report["passed"] and run.returncode == 0, report["failed_final_checks"]
