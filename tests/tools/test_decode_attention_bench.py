"""scripts/bench/probes/decode_attention: one layer's decode attention timed, with the bytes it reads."""

from __future__ import annotations

import json

import pytest

from scripts.bench.probes import decode_attention


@pytest.mark.parametrize("dtype, element_size", [("bfloat16", 2), ("float32", 4)])
def test_reports_the_kv_read_of_the_shape_it_ran(tmp_path, dtype, element_size):
    out = tmp_path / "attention.json"
    decode_attention.main(["--num-seqs", "3", "--context", "40", "--num-layers", "2", "--calls", "4",
                           "--repeats", "2", "--dtype", dtype, "--json", str(out)])
    report = json.loads(out.read_text())
    [result] = report["results"]
    # 3 sequences x 40 tokens x 3 KV heads x 64 x (K and V)
    assert result["kv_bytes_per_call"] == 3 * 40 * 3 * 64 * 2 * element_size
    assert result["call_us"] > 0
    assert result["kv_gb_s"] == pytest.approx(result["kv_bytes_per_call"] / (result["call_us"] / 1e6) / 1e9)
    assert report["config"]["dtype"] == dtype


def test_one_row_per_context_with_the_cache_evicted(tmp_path):
    out = tmp_path / "attention.json"
    decode_attention.main(["--num-seqs", "1", "--num-heads", "8", "--num-kv-heads", "2", "--context", "17", "33",
                           "--evict-mb", "1", "--calls", "20", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [row["context"] for row in rows] == [17, 33]
    assert [row["kv_bytes_per_call"] for row in rows] == [17 * 2 * 64 * 2 * 2, 33 * 2 * 64 * 2 * 2]
    assert all(row["call_us"] > 0 for row in rows)
