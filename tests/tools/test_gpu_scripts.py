"""The GPU check's helpers on the CPU: model shapes, the bandwidth arithmetic, a tiny decode bench.

scripts/gpu_check.sh runs these scripts on a lent GPU machine, where there is no
time to find a typo; these tests catch those here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from scripts.bench import decode as bench_decode
from scripts.lib import make_model_config
from tests.helpers import REPO_ROOT


def count_params(model_config) -> int:
    """Build the model on the meta device (no memory) and count its parameters."""
    import torch

    from engine.models import MODEL_CLASSES

    with torch.device("meta"):
        model = MODEL_CLASSES[model_config.architecture](model_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", sorted(make_model_config.SHAPES))
def test_every_shape_loads(shape, tmp_path):
    from engine.models.config import ModelConfig

    folder = make_model_config.write_model_config(shape, tmp_path / shape)
    config = ModelConfig.from_folder(str(folder))
    shape_config = make_model_config.model_config(shape)
    # head_dim is the config's own where it says one (Qwen3-0.6B: 128 for 16 heads of a 1,024 hidden)
    assert config.head_dim == shape_config.get("head_dim", config.hidden_size // config.num_heads)
    assert config.num_heads % config.num_kv_heads == 0
    assert config.eos_token_ids == [shape_config["eos_token_id"]]
    assert config.tie_word_embeddings == shape_config["tie_word_embeddings"]


def test_mistral_7b_shape(tmp_path):
    from engine.models.config import ModelConfig

    folder = make_model_config.write_model_config("mistral-7b", tmp_path)
    config = ModelConfig.from_folder(str(folder))
    assert config.architecture == "MistralForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        32, 4096, 32, 8, 128)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (14336, 32000, 32768)
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-5
    assert not config.tie_word_embeddings and not config.attention_bias
    assert count_params(config) == 7_241_732_096  # Mistral-7B-v0.2's published count


def test_smollm2_shape_matches_the_default_model(tmp_path):
    from engine.models.config import ModelConfig

    config = ModelConfig.from_folder(str(make_model_config.write_model_config("smollm2", tmp_path)))
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert count_params(config) == 134_515_008  # SmolLM2-135M's count (embeddings tied)


def test_unknown_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        make_model_config.write_model_config("llama-405b", tmp_path)


def test_bandwidth_arithmetic_on_hand_numbers():
    # Mistral-7B in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    assert bench_decode.kv_bytes_per_token(32, 8, 128, 2) == 131072
    # 1 GB of weights + 1000 tokens x 1 MB = 2 GB read in 1 ms = 2000 GB/s, half of 4000 GB/s.
    num_bytes = bench_decode.decode_step_bytes(10**9, 1000, 10**6)
    assert num_bytes == 2 * 10**9
    assert bench_decode.bandwidth_share(num_bytes, 1e-3, 4000.0) == pytest.approx(0.5)


def test_summarize_keeps_pure_decode_steps_only():
    def step(duration, num_seqs, num_decode_tokens):
        return SimpleNamespace(start_time=0.0, end_time=duration, num_seqs=num_seqs,
                               num_decode_tokens=num_decode_tokens)

    steps = [
        step(5e-3, 2, 0),  # prefill of both: left out
        step(1e-3, 2, 2),
        step(2e-3, 2, 2),
        step(4e-3, 2, 1),  # one prefill chunk beside one decode: left out
        step(3e-3, 2, 2),
    ]
    context_tokens = [64, 66, 68, 70, 72]
    # Each decode step reads 1000 bytes of weights + 10 bytes per context token.
    summary = bench_decode.summarize(steps, context_tokens, weight_bytes=1000, kv_bytes=10, peak_bandwidth_gbs=1e-6)
    assert summary["num_decode_steps"] == 3
    assert summary["decode_step_time_median_s"] == pytest.approx(2e-3)
    assert summary["decode_context_tokens_median"] == 68
    assert summary["decode_bytes_median"] == 1680
    # Per-step shares over 1000 B/s peak: 1660/1e-3, 1680/2e-3, 1720/3e-3 (B/s) / 1000.
    assert summary["decode_bandwidth_share_median"] == pytest.approx(1680 / 2e-3 / 1000)
    assert bench_decode.summarize(steps[:1], context_tokens[:1], 1000, 10, 1.0) == {"num_decode_steps": 0}


def test_bench_decode_smoke_on_tiny_model(tmp_path):
    folder = make_model_config.write_model_config("tiny", tmp_path / "tiny")
    out = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "scripts.bench.decode", "--model", str(folder), "--load-format", "dummy",
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--num-threads", "1",
        "--batch-size", "4", "--input-len", "32", "--output-len", "8", "--json", str(out),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parameters" in result.stdout
    report = json.loads(out.read_text())
    assert report["num_params"] == 1_692_928
    assert report["weight_bytes"] == 4 * report["num_params"]
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4
    assert report["num_output_tokens"] == 4 * 8
    # One step prefills all four prompts; the other seven decode all four sequences.
    assert report["num_steps"] == 8
    assert report["num_decode_steps"] == 7
    assert report["decode_batch_size_median"] == 4
    assert report["decode_context_tokens_median"] == 4 * (32 + 4)
    for key in ("total_tokens_per_s", "output_tokens_per_s", "decode_step_time_median_s",
                "decode_bandwidth_share_median", "decode_bandwidth_gbs_median"):
        assert report[key] > 0, key
