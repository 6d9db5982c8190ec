"""A LoRA adapter's folder checked before it is served (ipc/lora_adapter.py, engine/lora/adapter_files.py):
each bad adapter is refused with a ValueError naming the field or file, and the engine goes on."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, LoRARequest, SamplingParams
from ipc.lora_adapter import ModelShape, check_adapter
from tests.helpers.lora import make_peft_adapter
from tests.helpers.models import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lora-files")
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    adapter, _ = make_peft_adapter(hf_model, tmp_path / "good", r=16, lora_alpha=32)
    return path, adapter, hf_model, tmp_path


def edited_copy(adapter: str, tmp_path, name: str, **config_changes) -> str:
    target = tmp_path / name
    shutil.copytree(adapter, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(config_changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return str(target)


def test_a_good_adapter_is_read_with_its_scale(model_and_adapter):
    path, adapter, _, _ = model_and_adapter
    spec = check_adapter(adapter, ModelShape.from_folder(path), 16)
    assert spec.rank == 16 and spec.scale == 2.0
    assert len(spec.tensors) == 2 * 7 * 2  # A and B, seven projections, two layers
    rslora = check_adapter(edited_copy(adapter, model_and_adapter[3], "rs", use_rslora=True),
                           ModelShape.from_folder(path), 16)
    assert rslora.scale == 32 / 4


@pytest.mark.parametrize("change, message", [
    (dict(r=32), "r = 32 is above max_lora_rank 16"),
    (dict(use_dora=True), "use_dora: DoRA adapters are not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "qkv_proj"]), "target_modules ['qkv_proj'] are not modules of this model"),
    (dict(peft_type="PREFIX_TUNING"), "peft_type"),
    (dict(bias="all"), "bias"),
    (dict(lora_alpha="big"), "lora_alpha must be a number"),
])
def test_bad_configs_are_refused_naming_the_field(model_and_adapter, change, message):
    path, adapter, _, tmp_path = model_and_adapter
    bad = edited_copy(adapter, tmp_path, "bad-" + next(iter(change)) + str(len(message)), **change)
    with pytest.raises(ValueError) as info:
        check_adapter(bad, ModelShape.from_folder(path), 16)
    assert message in str(info.value)


def test_missing_corrupt_and_misplaced_files_are_refused(model_and_adapter, tmp_path):
    path, adapter, _, _ = model_and_adapter
    shape = ModelShape.from_folder(path)
    cases = {}
    no_config = tmp_path / "no-config"
    shutil.copytree(adapter, no_config)
    (no_config / "adapter_config.json").unlink()
    cases[str(no_config)] = "has no adapter_config.json"
    not_json = tmp_path / "not-json"
    shutil.copytree(adapter, not_json)
    (not_json / "adapter_config.json").write_text("{r: 8")
    cases[str(not_json)] = "adapter_config.json is not valid JSON"
    no_weights = tmp_path / "no-weights"
    shutil.copytree(adapter, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    cases[str(no_weights)] = "has no adapter_model.safetensors"
    truncated = tmp_path / "truncated"
    shutil.copytree(adapter, truncated)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases[str(truncated)] = "adapter_model.safetensors is corrupt"
    garbage = tmp_path / "garbage"
    shutil.copytree(adapter, garbage)
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    cases[str(garbage)] = "adapter_model.safetensors is corrupt"
    cases[str(garbage / "adapter_config.json")] = "is not a folder"
    cases[str(tmp_path / "nowhere")] = "is not a folder (no such path)"
    for bad, message in cases.items():
        with pytest.raises(ValueError) as info:
            check_adapter(bad, shape, 16)
        assert message in str(info.value), bad


def test_an_adapter_of_another_model_is_refused_by_its_shapes(model_and_adapter, tmp_path):
    _, adapter, _, _ = model_and_adapter
    other, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **{**SMALL, "hidden_size": 128})
    wrong_shape = r"down_proj.lora_B.weight has shape \[64, 16\], this model needs \[128, 16\] \(an adapter made for"
    with pytest.raises(ValueError, match=wrong_shape):
        check_adapter(adapter, ModelShape.from_folder(other), 16)
    phi3, _ = make_tiny_model(tmp_path, "Phi3ForCausalLM", **SMALL)  # a Llama adapter's q_proj on fused qkv
    with pytest.raises(ValueError, match=r"target_modules .* are not modules of this model \(Phi3ForCausalLM\)"):
        check_adapter(adapter, ModelShape.from_folder(phi3), 16)


def test_the_engine_refuses_a_bad_adapter_and_serves_on(model_and_adapter, tmp_path):
    path, adapter, _, _ = model_and_adapter
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="r = 16 is above max_lora_rank 8"):
        llm.generate([[1, 2, 3]], greedy, use_tqdm=False, lora_request=LoRARequest("big", 1, adapter))
    with pytest.raises(ValueError, match="is not a folder"):
        llm.generate([[1, 2, 3]], greedy, use_tqdm=False, lora_request=LoRARequest("none", 2, str(tmp_path / "x")))
    assert len(llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].token_ids) == 4
    off = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"LoRA adapters are off \(enable_lora\)"):
        off.generate([[1, 2, 3]], greedy, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LLM(path, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=12)
