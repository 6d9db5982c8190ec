"""scripts/bench/probes/dot_peaks: the register-only rates it reports are real measurements of this CPU."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.cpu.host import detect_cpu_features
from scripts.bench.probes import dot_peaks

CPU = detect_cpu_features()


@pytest.mark.skipif(not (CPU.has_avx512_vnni and CPU.has_avx512_bf16), reason="needs AVX512_VNNI and AVX512_BF16")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_reports_every_rate_and_the_ratio(tmp_path):
    out = tmp_path / "peaks.json"
    dot_peaks.main(["--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    best = report["best"]
    assert set(best) == {"vpdpbusd", "vdpbf16ps", "int8_loop_no_epilogue", "int8_loop_add", "int8_loop_scales"}
    # Billions of 512-bit instructions a second on one core: a real clock gives 0.1-10.
    assert all(0.1 < rate < 10 for rate in best.values()), best
    assert report["int8_ops_vs_bf16_flops"] == pytest.approx(2 * best["vpdpbusd"] / best["vdpbf16ps"])
    assert 0 < report["int8_loop_scales_share_of_peak"] < 2
