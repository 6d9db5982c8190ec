"""LoRA adapters behind the real server at --tensor-parallel-size 2 (gloo on the CPU): an adapter
named at start and one loaded at run time give transformers + peft's greedy text, the base its
own, and a bad adapter gets its 400 with the core and its worker alive. The model is a tiny random
Llama carrying SmolLM2's tokenizer (as tests/server/test_tp_server.py), so each step stays fast."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import requests

from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.lora import make_peft_adapter
from tests.helpers.models import cached_default_model, make_tiny_model
from tests.helpers.server import real_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
NUM_TOKENS = 12


def test_adapters_at_tp2_through_the_server_equal_peft(tmp_path):
    import transformers

    tokenizer_folder = cached_default_model()
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", vocab_size=49152, hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, Path(path) / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.encode(PROMPT)
    sql, sql_model = make_peft_adapter(hf_model, tmp_path / "sql", r=8, lora_alpha=16, seed=1)
    poem, poem_model = make_peft_adapter(hf_model, tmp_path / "poem", r=16, lora_alpha=8, use_rslora=True, seed=2)
    want = {name: tokenizer.decode(hf_greedy(model, prompt, NUM_TOKENS))
            for name, model in (("smollm2", hf_model), ("sql", sql_model), ("poem", poem_model))}
    assert len(set(want.values())) == 3

    with real_server(path, "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "256",
                     "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
                     "--lora-modules", f"sql={sql}") as server:
        url = server.url

        def complete(model: str) -> requests.Response:
            return requests.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True},
                timeout=120)

        assert complete("sql").json()["choices"][0]["text"] == want["sql"]
        load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": poem}, timeout=60)
        assert load.status_code == 200, load.text
        pids = server.child_pids()
        assert complete("poem").json()["choices"][0]["text"] == want["poem"]
        assert complete("smollm2").json()["choices"][0]["text"] == want["smollm2"]
        (tmp_path / "broken").mkdir()
        bad = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "broken",
                                                                 "lora_path": str(tmp_path / "broken")}, timeout=60)
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"], bad.text
        assert complete("sql").json()["choices"][0]["text"] == want["sql"]
        assert server.child_pids() == pids
