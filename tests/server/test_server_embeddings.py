"""`POST /v1/embeddings` through the real two-process server on the default model, in fp32,
with the `openai` package: the vectors equal transformers' (the final hidden states after the
final norm, last-token pooled and normalized), float and base64 alike; bad input is a 400 in
OpenAI's error shape that never reaches the core; `--runner pooling` serves embeddings only."""

from __future__ import annotations

import base64
import struct

import pytest
import requests
import torch

from tests.helpers.server import real_server

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--dtype", "float32")
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hello"]


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def hf_reference(default_model_path):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(default_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)

    def embed(text: str, mean: bool = False) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model(ids).last_hidden_state[0]  # [num_tokens, hidden_size], after the final norm
        return torch.nn.functional.normalize(hidden.mean(0) if mean else hidden[-1], dim=0)

    return embed


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.as_tensor(b, dtype=torch.float64), dim=0).item()


def test_openai_embeddings_equal_transformers_float_and_base64(oai, server, hf_reference):
    as_floats = oai.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    as_base64 = oai.embeddings.create(model="smollm2", input=TEXTS)  # the client asks for base64 and decodes it
    assert as_floats.model == "smollm2" and [d.index for d in as_floats.data] == [0, 1, 2]
    num_tokens = sum(len(requests.post(f"{server.url}/tokenize", json={"prompt": t}).json()["tokens"]) for t in TEXTS)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == num_tokens
    for text, floats, packed in zip(TEXTS, as_floats.data, as_base64.data):
        assert len(floats.embedding) == 576
        assert torch.allclose(torch.tensor(packed.embedding), torch.tensor(floats.embedding), atol=1e-7)
        assert cosine(floats.embedding, hf_reference(text)) > 1 - 1e-4
    mean = requests.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[0], "pooling_type": "mean"}).json()
    assert cosine(mean["data"][0]["embedding"], hf_reference(TEXTS[0], mean=True)) > 1 - 1e-4


def test_base64_is_little_endian_float32_and_token_ids_are_accepted(server):
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_text = requests.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[1]}).json()
    by_ids = requests.post(f"{server.url}/v1/embeddings",
                           json={"input": [ids, ids], "encoding_format": "base64", "dimensions": 576}).json()
    raw = base64.b64decode(by_ids["data"][1]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(vector) == 576 and by_ids["usage"]["prompt_tokens"] == 2 * len(ids)
    assert cosine(vector, by_text["data"][0]["embedding"]) > 1 - 1e-6


def test_generation_and_embeddings_share_the_server(server):
    completion = requests.post(f"{server.url}/v1/completions",
                               json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
    assert requests.post(f"{server.url}/v1/embeddings", json={"input": "x"}).status_code == 200


BAD_BODIES = {
    "empty list": ({"input": []}, "empty"),
    "empty string": ({"input": ""}, "empty"),
    "empty token list": ({"input": [[]]}, "empty"),
    "over the context": ({"input": "hello " * 9000}, "context"),
    "token ids over the context": ({"input": [1] * 9000}, "context"),
    "10,000 inputs": ({"input": ["a"] * 10_000}, "at most 2048"),
    "a number among strings": ({"input": ["a", 5]}, "input[1]"),
    "an object": ({"input": [{"text": "a"}]}, "input[0]"),
    "no input": ({}, "input"),
    "a token id outside the vocabulary": ({"input": [[1, 10**6]]}, "token ids"),
    "dimensions": ({"input": "a", "dimensions": 256}, "dimensions"),
    "encoding_format": ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    "an unknown model": ({"input": "a", "model": "gpt-4"}, "does not exist"),
}


@pytest.mark.parametrize("body, expected", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_input_is_a_400_and_the_core_lives_on(server, body, expected):
    (core_pid,) = server.child_pids()
    response = requests.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if "model" in body else 400), response.text
    error = response.json()["error"]
    assert expected in error["message"] and error["type"]
    assert server.child_pids() == [core_pid]
    assert requests.post(f"{server.url}/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_an_input_as_long_as_the_context_is_embedded_one_more_token_is_a_400(default_model_path):
    # A short context: a prefill of the default 8192 tokens takes minutes on a CPU.
    with real_server(default_model_path, "--max-model-len", "256", "--dtype", "float32") as short_server:
        url = short_server.url
        assert requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 256
        response = requests.post(f"{url}/v1/embeddings", json={"input": [5] * 256}, timeout=300)
        assert response.status_code == 200, response.text[:300]
        assert response.json()["usage"]["prompt_tokens"] == 256
        response = requests.post(f"{url}/v1/embeddings", json={"input": [5] * 257}, timeout=60)
        assert response.status_code == 400 and "the input is 257 tokens" in response.text, response.text
        response = requests.post(f"{url}/v1/completions", json={"prompt": [5] * 256, "max_tokens": 1}, timeout=60)
        assert response.status_code == 400 and "256 in the prompt, 1 for the completion" in response.text


def test_pooling_runner_refuses_generation_and_serves_embeddings(default_model_path, hf_reference):
    with real_server(default_model_path, "--runner", "pooling", "--dtype", "float32") as pooling_server:
        url = pooling_server.url
        for route, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            response = requests.post(f"{url}{route}", json=body, timeout=60)
            assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]
        vector = requests.post(f"{url}/v1/embeddings", json={"input": TEXTS[0]}).json()["data"][0]["embedding"]
        assert cosine(vector, hf_reference(TEXTS[0])) > 1 - 1e-4
