"""Qwen2.5-VL through a real server: an OpenAI chat image_url part answers with transformers' greedy
tokens (M-RoPE, dynamic resolution), and the hostile image cases are 400s naming the part, with the
core's pid unchanged, as on SmolVLM (tests/server/test_server_vision.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from scripts.lib.qwen_vl_model import hf_image_processor, make_tiny_qwen2_5_vl
from tests.helpers.server import real_server
from tests.server.test_server_vision import BAD, chat, data_url, engine_pid, image_url_part, png_bytes

NUM_TOKENS = 6
QUESTION = "What is this?"
PICTURE = Image.fromarray(np.random.default_rng(4).integers(0, 256, (100, 150, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-vl-server")
    path, hf_model = make_tiny_qwen2_5_vl(root)
    media = root / "media"
    media.mkdir()
    (root / "secret.png").write_bytes(png_bytes(PICTURE))
    with real_server(path, "--dtype", "float32", "--allowed-local-media-path", str(media),
                     "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000",
                     "--max-num-batched-tokens", "16") as server:
        yield server, hf_model, media, root, path


def test_openai_chat_with_an_image_answers_as_transformers(qwen_server):
    server, hf_model, _, _, path = qwen_server
    response = requests_chat(server)
    assert response.status_code == 200, response.text
    body = response.json()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + QUESTION
              + "<|im_end|>\n<|im_start|>assistant\n")
    grid = hf_image_processor()(images=[PICTURE], return_tensors="pt")
    num_image_tokens = int(grid["image_grid_thw"].prod()) // 4
    input_ids = torch.tensor([tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * num_image_tokens))
                              ["input_ids"]])
    assert body["usage"]["prompt_tokens"] == input_ids.shape[1]
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids, pixel_values=grid["pixel_values"],
                                image_grid_thw=grid["image_grid_thw"],
                                mm_token_type_ids=(input_ids == hf_model.config.image_token_id).int(),
                                max_new_tokens=NUM_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == expected


def requests_chat(server):
    return chat(server, [image_url_part(data_url(png_bytes(PICTURE))), {"type": "text", "text": QUESTION}])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s_naming_the_part(qwen_server, case):
    server, _, media, root, _ = qwen_server
    pid = engine_pid(server)
    make_part, message = BAD[case]
    response = chat(server, [{"type": "text", "text": QUESTION}, make_part(media, root)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]["message"]
    assert "messages[0].content[1]" in error and message in error, error
    assert engine_pid(server) == pid
    assert requests_chat(server).status_code == 200  # and the core still answers


def test_responses_and_anthropic_routes_answer_as_chat(qwen_server):
    import base64

    import requests

    server = qwen_server[0]
    expected = requests_chat(server).json()["choices"][0]["message"]["content"]
    response = requests.post(f"{server.url}/v1/responses", timeout=120, json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(png_bytes(PICTURE))},
                                               {"type": "input_text", "text": QUESTION}]}],
        "max_output_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == expected
    response = requests.post(f"{server.url}/v1/messages", timeout=120, json={
        "model": "smollm2", "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(PICTURE)).decode()}},
            {"type": "text", "text": QUESTION}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == expected
