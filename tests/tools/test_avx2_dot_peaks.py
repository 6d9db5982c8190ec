"""scripts/bench/probes/avx2_dot_peaks: the register-only vpmaddubsw rates it reports are real measurements of this CPU."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.cpu.host import cpu_flags
from scripts.bench.probes import avx2_dot_peaks


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="needs AVX2")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_reports_both_loops_on_every_thread_and_their_gops(tmp_path):
    out = tmp_path / "peaks.json"
    avx2_dot_peaks.main(["--threads", "2", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    best = report["best"]
    assert set(best) == {"maddubs_add", "broadcast_maddubs_add"} and report["threads"] == 2
    # Billions of 256-bit instructions a second on two threads: a real clock gives 0.1-40.
    assert all(0.1 < rate < 40 for rate in best.values()), best
    assert report["gops"] == {name: round(64 * rate, 1) for name, rate in best.items()}
