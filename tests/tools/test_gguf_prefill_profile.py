"""scripts/bench/gguf_prefill_profile.py on a tiny Q4_K_M-mix GGUF written here: every layer's
matmuls are timed, grouped by role and type, and with `other` they make up the forward."""

from __future__ import annotations

import json

from scripts.bench import gguf_prefill_profile
from scripts.lib.gguf_writer import q4_k_m_types, write_random_llama_gguf
from tests.models.test_gguf_files import write_tiny_llama

NUM_LAYERS = 2  # layer 0's down projection Q4_K, layer 1's Q6_K (q4_k_m_types)


def test_profile_groups_every_matmul_by_role_and_type(tmp_path):
    folder, _ = write_tiny_llama(tmp_path / "tokenizer")
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    path = write_random_llama_gguf(tmp_path / "tiny.gguf", folder, vocab_size=vocab_size, hidden_size=256,
                                   intermediate_size=512, num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2,
                                   types=q4_k_m_types(NUM_LAYERS))
    args = gguf_prefill_profile.parse_args(["--model", str(path), "--prompt-len", "40", "--repeats", "1"])
    report = gguf_prefill_profile.run(args)
    ops = report["ops"]
    assert ops["gate_up_proj Q4_K"]["calls"] == NUM_LAYERS and ops["o_proj Q4_K"]["calls"] == NUM_LAYERS
    assert ops["down_proj Q4_K"]["calls"] == 1 and ops["down_proj Q6_K"]["calls"] == 1
    assert sum(entry.get("calls", 0) for entry in ops.values()) == 4 * NUM_LAYERS  # qkv, o, gate_up, down
    assert not any("lm_head" in label for label in ops)  # a prompt's forward has no head
    assert all(entry["ms"] >= 0 for entry in ops.values()) and all(e["gops"] > 0 for e in ops.values() if "gops" in e)
    assert abs(sum(entry["share"] for entry in ops.values()) - 1) < 0.01
    assert report["prompt_len"] == 40 and report["prefill_tok_s"] > 0
