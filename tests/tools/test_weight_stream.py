"""scripts/lib/weight_stream.py and single_user.py's weight rates (issue #59's bar: one user's
decode reads its weights at a share of the stream rate the benchmark measures itself)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from engine.cpu.gguf_linear import kernel_types
from scripts.bench import single_user
from scripts.lib.local_server import Server
from scripts.lib.weight_stream import StreamProbe, decode_weight_bytes, weight_rates


def write_gguf(path: Path, tensors: dict[str, np.ndarray], raw_dtypes: dict[str, GGMLQuantizationType]) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, array in tensors.items():
        if name in raw_dtypes:
            writer.add_tensor(name, array, raw_dtype=raw_dtypes[name])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensors(tied: bool) -> tuple[dict[str, np.ndarray], dict[str, GGMLQuantizationType]]:
    rng = np.random.default_rng(0)
    embedding = quantize(rng.standard_normal((64, 256)).astype(np.float32), GGMLQuantizationType.Q8_0)
    found = {"token_embd.weight": embedding,  # 64 rows x 8 blocks x 34 bytes
             "blk.0.attn_norm.weight": np.ones(256, dtype=np.float32),  # 1024 bytes
             "blk.0.ffn_down.weight": rng.standard_normal((32, 256)).astype(np.float32)}  # 32768 bytes
    raw = {"token_embd.weight": GGMLQuantizationType.Q8_0}
    if not tied:
        found["output.weight"] = quantize(rng.standard_normal((64, 256)).astype(np.float32), GGMLQuantizationType.Q8_0)
        raw["output.weight"] = GGMLQuantizationType.Q8_0
    return found, raw


def test_a_tied_file_reads_its_embedding_as_the_head_and_an_untied_one_does_not(tmp_path: Path):
    embedding_bytes, layer_bytes = 64 * 8 * 34, 1024 + 32 * 256 * 4
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    write_gguf(tied, *tensors(tied=True))
    write_gguf(untied, *tensors(tied=False))
    assert decode_weight_bytes(tied) == embedding_bytes + layer_bytes
    assert decode_weight_bytes(untied) == layer_bytes + embedding_bytes  # output.weight, not token_embd
    (tmp_path / "folder").mkdir()
    assert decode_weight_bytes(tmp_path / "folder") is None
    assert decode_weight_bytes(tmp_path / "missing.gguf") is None


@pytest.mark.skipif(not kernel_types(), reason="the gguf kernels need AVX2, FMA and F16C")
def test_the_stream_probe_reads_its_buffer_and_gives_torch_its_threads_back():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probe = StreamProbe(num_bytes=64 << 20, threads=2)
        rate = probe.measure(trials=2)
        assert math.isfinite(rate) and rate > 0.1  # GB/s: any machine reads 64 MB faster than in 0.6 s
        assert torch.get_num_threads() == 1 and probe.threads == 2
    finally:
        torch.set_num_threads(before)  # later tests in this process keep their threads


def test_each_run_is_held_to_its_own_rounds_stream_rate():
    server = Server("ours-bf16", [], {})
    server.runs = [{"round": 0, "ttft_s": 1.0, "decode_tok_s": 30.0, "num_prompt_tokens": 128, "other_cpu_share": 0.0},
                   {"round": 1, "ttft_s": 1.2, "decode_tok_s": 20.0, "num_prompt_tokens": 128, "other_cpu_share": 0.01}]
    summary = single_user.summarize(server, 800_000_000, [30.0, 20.0])
    assert summary["share_of_stream_runs"] == pytest.approx([0.8, 0.8])  # 24 of 30 GB/s, 16 of 20
    assert summary["median_weight_gb_s"] == pytest.approx(20.0)
    assert weight_rates(30.0, 800_000_000, 30.0) == pytest.approx({"weight_gb_s": 24.0, "share_of_stream": 0.8})
    plain = single_user.summarize(server, None, [30.0, 20.0])
    assert "median_share_of_stream" not in plain and plain["median_decode_tok_s"] == 25.0
    assert "| 20.0 (0.80) |" in single_user.markdown_table({"ours-bf16": summary}, None)


def test_the_served_gguf_is_the_file_whose_blocks_a_server_runs(tmp_path: Path):
    args = argparse.Namespace(model=str(tmp_path / "m.gguf"), llama_gguf=tmp_path / "l.gguf", gguf_dir=tmp_path)
    assert single_user.served_gguf("ours-bf16", args) == tmp_path / "m.gguf"
    assert single_user.served_gguf("llama-file", args) == tmp_path / "l.gguf"
    assert single_user.served_gguf("ours-int4-q4_1", args) == tmp_path / "smollm2-q4_1.gguf"
    assert single_user.served_gguf("ours-int4", args) is None  # requantized: not the file's bytes
    args.model = "smollm2"
    assert single_user.served_gguf("ours-bf16", args) is None
