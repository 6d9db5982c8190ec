"""LoRA adapters through the real server (frontend/serving_lora.py): `model` picks an adapter on
completions, chat, responses and messages; /v1/models lists adapters with their parent; adapters
load and unload at run time under --allow-runtime-lora-updating; every bad input gets a 4xx naming
the field, and the core's pid stays the same."""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from tests.helpers.lora import make_peft_adapter
from tests.helpers.server import real_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_path):
    import torch
    import transformers

    tmp_path = tmp_path_factory.mktemp("lora-server")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    made = {
        "sql": make_peft_adapter(hf_model, tmp_path / "sql", r=8, lora_alpha=16, seed=1, std=0.05)[0],
        "poem": make_peft_adapter(hf_model, tmp_path / "poem", r=16, lora_alpha=8, seed=2, std=0.05)[0],
        "big": make_peft_adapter(hf_model, tmp_path / "big", r=32, lora_alpha=32, seed=3, std=0.05)[0],
    }
    return made, tmp_path


@pytest.fixture(scope="module")
def lora_server(adapters, default_model_path):
    made, _ = adapters
    module = json.dumps({"name": "poem", "path": made["poem"], "base_model_name": "smollm2"})
    with real_server(default_model_path, "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
                     "--lora-modules", f"sql={made['sql']}", module) as server:
        yield server


def complete(url: str, model: str, **extra) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                        "temperature": 0, **extra}, timeout=120)


def test_model_picks_the_adapter_on_every_generating_route(lora_server):
    url = lora_server.url
    texts = {model: complete(url, model).json()["choices"][0]["text"] for model in ("smollm2", "sql", "poem")}
    assert len(set(texts.values())) == 3, texts  # each adapter answers in its own way
    assert complete(url, "sql").json()["choices"][0]["text"] == texts["sql"]  # and the same way again
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    chats = {m: requests.post(f"{url}/v1/chat/completions", json={**chat, "model": m}, timeout=120).json()
             for m in ("smollm2", "sql")}
    assert chats["smollm2"]["choices"][0]["message"]["content"] != chats["sql"]["choices"][0]["message"]["content"]
    responses = requests.post(f"{url}/v1/responses", json={"model": "sql", "input": "Name a color.",
                                                           "max_output_tokens": 8, "temperature": 0}, timeout=120)
    assert responses.status_code == 200, responses.text
    messages = requests.post(f"{url}/v1/messages", json={"model": "sql", "max_tokens": 8, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "Name a color."}]},
                             timeout=120)
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == chats["sql"]["choices"][0]["message"]["content"]


def test_models_lists_the_adapters_with_their_parent(lora_server):
    cards = {c["id"]: c for c in requests.get(f"{lora_server.url}/v1/models", timeout=10).json()["data"]}
    assert set(cards) >= {"smollm2", "sql", "poem"}
    assert cards["sql"]["parent"] == "smollm2" and cards["poem"]["parent"] == "smollm2"


def test_load_and_unload_at_run_time(lora_server, adapters):
    made, _ = adapters
    url = lora_server.url
    load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poem2", "lora_path": made["poem"]},
                         timeout=30)
    assert load.status_code == 200, load.text
    assert complete(url, "poem2").json()["choices"][0]["text"] == complete(url, "poem").json()["choices"][0]["text"]
    assert "poem2" in {c["id"] for c in requests.get(f"{url}/v1/models", timeout=10).json()["data"]}
    unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem2"}, timeout=30)
    assert unload.status_code == 200, unload.text
    gone = complete(url, "poem2")
    assert gone.status_code == 404 and gone.json()["error"]["message"].startswith("The model `poem2` does not exist")


def test_bad_inputs_get_4xx_naming_the_field_and_the_core_lives_on(lora_server, adapters, tmp_path):
    made, _ = adapters
    url = lora_server.url
    core_pids = lora_server.child_pids()
    (tmp_path / "file").write_text("not a folder")

    def load(body):
        return requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)

    cases = [
        (complete(url, "nope"), 404, "The model `nope` does not exist"),
        (load({"lora_name": "big", "lora_path": made["big"]}), 400, "lora_path: adapter_config.json: r = 32 is above"),
        (load({"lora_name": "sql", "lora_path": made["poem"]}), 400, "lora_name 'sql' is already served"),
        (load({"lora_name": "x", "lora_path": str(tmp_path / "file")}), 400, "lora_path: lora_path"),
        (load({"lora_name": "x", "lora_path": str(tmp_path / "missing")}), 400, "is not a folder"),
        (load({"lora_name": "x"}), 400, "lora_path"),
        (load({"lora_name": "", "lora_path": made["sql"]}), 400, "lora_name must be"),
        (requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never"}, timeout=30), 404,
         "lora_name: the LoRA adapter `never` is not loaded"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in response.json()["error"]["message"], response.text
    # A NaN in the data passes the header's check: the core's read (off its loop) finds it, and fails the request.
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(made["sql"], nan)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    tensors[next(k for k in sorted(tensors) if "lora_B" in k)][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    assert load({"lora_name": "nan", "lora_path": str(nan)}).status_code == 200
    response = complete(url, "nan")
    assert response.status_code == 400 and "holds inf or NaN" in response.json()["error"]["message"], response.text
    assert complete(url, "sql").status_code == 200
    assert lora_server.child_pids() == core_pids


def test_runtime_loading_is_refused_while_it_is_off(adapters, default_model_path):
    made, _ = adapters
    with real_server(default_model_path, "--enable-lora", "--lora-modules", f"sql={made['sql']}") as server:
        response = requests.post(f"{server.url}/v1/load_lora_adapter",
                                 json={"lora_name": "poem", "lora_path": made["poem"]}, timeout=30)
        assert response.status_code == 400 and "--allow-runtime-lora-updating" in response.json()["error"]["message"]
        assert complete(server.url, "sql").status_code == 200


def test_unloading_lets_running_requests_finish_on_the_adapter(lora_server, adapters):
    made, _ = adapters
    url = lora_server.url
    load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poem3", "lora_path": made["poem"]},
                         timeout=30)
    assert load.status_code == 200, load.text
    want = complete(url, "poem", max_tokens=48).json()["choices"][0]["text"]
    body = {"model": "poem3", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    texts = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if len(texts) == 1:  # mid-stream: the name goes, the request goes on
                unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem3"}, timeout=30)
                assert unload.status_code == 200
                assert complete(url, "poem3").status_code == 404
    assert "".join(texts) == want
