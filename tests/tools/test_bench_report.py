"""What the benchmarks share (scripts/lib/bench_report.py): the reading of the CPU time a shared VM's
hypervisor took, and the flags passed on to the engine."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ipc.engine_config import EngineConfig
from scripts.bench import decode as bench_decode
from scripts.lib.bench_report import cpu_steal_s, engine_flags, host_cpu_ticks, read_rate_gb_s, steal_share


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat: not Linux")
def test_steal_is_read_from_proc_stat_and_never_goes_back():
    first = cpu_steal_s()
    assert first is not None and first >= 0
    time.sleep(0.05)
    second = cpu_steal_s()
    assert second is not None and second >= first
    # /proc/stat's first line: "cpu user nice system idle iowait irq softirq steal ..."
    ticks = int(Path("/proc/stat").read_text().split()[8])
    assert ticks / os.sysconf("SC_CLK_TCK") >= first
    assert host_cpu_ticks()[7] >= ticks  # the same counter, read again (it never goes back)


def test_steal_share_is_stolen_time_over_wall_time_and_cores():
    cores = os.cpu_count() or 1
    assert steal_share(10.0, 10.0 + 0.5 * cores, 1.0) == pytest.approx(0.5)
    assert steal_share(3.0, 3.0, 2.0) == 0.0
    assert steal_share(None, 1.0, 1.0) is None
    assert steal_share(1.0, None, 1.0) is None
    assert steal_share(1.0, 2.0, 0.0) is None


def test_read_rate_is_a_positive_rate_and_keeps_its_buffer():
    from scripts.lib import bench_report

    rate = read_rate_gb_s(num_bytes=8 << 20, trials=2)
    assert 0.1 < rate < 10_000  # GB/s: any machine's memory, never zero or a division by zero
    buffer = bench_report._READ_PROBE[0]
    read_rate_gb_s(num_bytes=8 << 20, trials=1)
    assert bench_report._READ_PROBE[0] is buffer  # made once, so no probe times its page faults


def test_engine_flags_are_the_parsed_flags_under_the_engine_config_names():
    args = bench_decode.parse_args(["--num-kv-blocks", "7", "--dtype", "float32", "--compile"])
    flags = engine_flags(args, "num_kv_blocks", "dtype", "compile", "device")
    assert flags == {"num_kv_blocks": 7, "dtype": "float32", "compile": True, "device": None}
    assert set(flags) <= set(EngineConfig.__dataclass_fields__)  # what LLM(**flags) passes on
