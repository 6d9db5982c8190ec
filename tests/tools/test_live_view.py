"""`scripts/bench/offline.py --live`: the live page's feed shows exactly the steps the benchmark records.

The run is the real one (the default model, `--quick`), continuous next to
static-padded; a client follows `GET /live/events` while it runs, as the page does.
The browser's view of the same page is in tests/server/test_browser.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from scripts.lib.fake_engine import free_port


pytestmark = pytest.mark.slow

MODES = ("continuous", "static-padded")


def start_live_run(tmp_path: Path, linger_s: float) -> tuple[threading.Thread, str, Path, list]:
    """bench_offline.main with --live on a thread; returns it, the page's URL, the report path and its errors."""
    from scripts.bench import offline as bench_offline

    port, report, errors = free_port(), tmp_path / "offline.json", []

    def run() -> None:
        try:
            bench_offline.main(["--quick", "--modes", ",".join(MODES), "--live", "--live-port", str(port),
                                "--live-linger", str(linger_s), "--json", str(report)])
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, f"http://127.0.0.1:{port}/live", report, errors


def connect(url: str, errors: list, timeout_s: float = 120.0) -> requests.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not errors, errors
        try:
            return requests.get(url, stream=True, timeout=30)
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f"no live view at {url}")


def test_feed_carries_every_recorded_step_of_each_mode(tmp_path):
    thread, url, report, errors = start_live_run(tmp_path, linger_s=0)
    page = connect(url, errors)
    assert page.status_code == 200 and "/static/live.js" in page.text
    for asset in ("style.css", "common.js", "strip.js", "live.js"):
        assert requests.get(url.replace("/live", f"/static/{asset}"), timeout=10).status_code == 200
    assert requests.get(url.replace("/live", "/static/chat.js"), timeout=10).status_code == 404  # nothing else

    columns = {mode: [] for mode in MODES}
    states, snapshots = {}, 0
    with connect(url + "/events", errors) as feed:
        for line in feed.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            snapshot = json.loads(line.removeprefix("data: "))
            snapshots += 1
            for run in snapshot["runs"]:
                assert run["num_steps_dropped"] == 0
                columns[run["name"]] += run["steps"]
                states.setdefault(run["name"], []).append(run["state"])
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors

    results = json.loads(report.read_text())["results"]
    assert snapshots >= 2 and states[MODES[-1]][0] != "done"  # it was followed live, not read afterwards
    for mode in MODES:
        assert states[mode][-1] == "done"
        recorded = results[mode]["step_stats"]
        # One column per recorded step, each as tall as that step's batch.
        assert [prefill + decode for prefill, decode, _ in columns[mode]] == recorded["num_seqs"]
        assert [padding for _, _, padding in columns[mode]] == recorded["num_finished_row_tokens"]
    # Static-padded keeps finished rows decoding pads; continuous never has any.
    assert sum(padding for _, _, padding in columns["static-padded"]) > 0
    assert all(padding == 0 for _, _, padding in columns["continuous"])
    assert any(prefill > 0 for prefill, _, _ in columns["continuous"])
