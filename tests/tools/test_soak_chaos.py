"""scripts/soak/chaos.py: which answers a killed core may cost, and finding the core among a frontend's children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from scripts.soak.chaos import HttpTally, KillWindow, chaos_report, core_pids, num_fds


def test_a_5xx_counts_against_a_kill_only_when_its_request_overlaps_the_window():
    windows = [KillWindow(100.0, 130.0), KillWindow(200.0, None)]  # the second core never came back
    tally = HttpTally()
    tally.by_status.update({200: 5, 400: 2, 503: 4})
    tally.spans_5xx += [(90.0, 101.0, "/v1/completions"),  # in flight at the kill
                        (129.0, 129.5, "/v1/messages"),  # while the core restarted
                        (150.0, 151.0, "/v1/responses"),  # between windows: a defect
                        (250.0, 251.0, "/v1/embeddings")]  # after a kill with no recovery
    summary = tally.summary(windows)
    assert (summary["answered"], summary["2xx"], summary["4xx"], summary["5xx"]) == (11, 5, 2, 4)
    assert summary["5xx_outside_kill_windows"] == 1
    assert summary["5xx_outside_kill_windows_paths"] == {"/v1/responses": 1}
    report = chaos_report(windows, [("status_503", 120.0, 121.0), ("wrong_token_count", 140.0, 141.0)], 40.0)
    assert report["errors_outside_kill_windows"] == {"wrong_token_count": 1}
    assert report["kills"][0]["at_s"] == 60.0 and report["kills"][1]["back_after_s"] is None


def test_core_pids_finds_the_core_by_its_module_and_skips_other_children():
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "engine.loop.core_process"])
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        assert core_pids(os.getpid()) == [core.pid]
        assert num_fds(os.getpid()) > 0 and num_fds(2**22 + 1) is None
    finally:
        for process in (core, helper):
            process.kill()
            process.wait()
