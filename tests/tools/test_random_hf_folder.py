"""scripts/bench/random_hf_folder.py: a Llama shape's random bf16 folder that the engine serves with
--quantization int4 (on AVX2: Q4_1 in 8-row groups)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from scripts.bench.gguf_load import SHAPES
from scripts.bench.random_hf_folder import main


def test_the_tiny_shape_is_written_and_served_with_int4(tmp_path, capsys):
    main(["--shape", "tiny", "--out", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out)
    sizes = SHAPES["tiny"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == \
        (sizes["hidden_size"], sizes["num_layers"], sizes["vocab_size"])
    assert (tmp_path / "tokenizer.json").exists() and summary["params"] > 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in f.keys())

    from engine import LLM, SamplingParams
    from engine.cpu.gguf_linear import GgufLinear, kernel_types
    from engine.cpu.host import detect_cpu_features

    llm = LLM(model=str(tmp_path), quantization="int4", num_kv_blocks=16, block_size=16)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    if not detect_cpu_features().has_avx512_vnni and "Q4_1" in kernel_types():  # this CPU: the AVX2 blocks
        linears = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, GgufLinear)]
        assert linears and all(m.type_names == ["Q4_1"] and m.is_grouped == [True] for m in linears)
