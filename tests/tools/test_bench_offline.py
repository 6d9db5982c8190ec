"""scripts/bench/offline.py end to end on the default model: its report says what actually ran."""

from __future__ import annotations

import json

import pytest


pytestmark = pytest.mark.slow


def test_report_records_the_resolved_dtype_and_compile_mode(tmp_path):
    from scripts.bench import offline as bench_offline

    from engine.config import EngineConfig
    from engine.worker.device_and_dtype import resolve_device_and_dtype

    out = tmp_path / "offline.json"
    bench_offline.main(["--quick", "--modes", "continuous,hf", "--json", str(out)])  # --dtype auto
    results = json.loads(out.read_text())["results"]
    _, auto = resolve_device_and_dtype(EngineConfig())
    for mode in ("continuous", "hf"):
        assert results[mode]["dtype"] == str(auto).removeprefix("torch.")  # "auto" resolved, the same for both
        assert results[mode]["compile_mode"] == "eager" and results[mode]["startup_s"] > 0

    bench_offline.main(["--quick", "--modes", "continuous", "--dtype", "float32", "--json", str(out)])
    assert json.loads(out.read_text())["results"]["continuous"]["dtype"] == "float32"
