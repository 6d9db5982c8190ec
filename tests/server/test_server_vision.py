"""Images through every chat route of a real server on a tiny SmolVLM-served Idefics3: OpenAI chat
image_url parts, the Responses API's input_image, Anthropic's base64 image blocks, and file:// under
--allowed-local-media-path, each answering what the offline LLM answers; every kind of bad image is a
400 naming the part, and the core's pid stays the same."""

from __future__ import annotations

import base64
import io
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from engine import LLM, SamplingParams
from tests.helpers.server import real_server
from scripts.lib.vision_model import make_tiny_smolvlm

NUM_TOKENS = 6
QUESTION = "What is this?"


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PICTURE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-server")
    path, _ = make_tiny_smolvlm(root)
    media = root / "media"
    media.mkdir()
    (media / "picture.png").write_bytes(png_bytes(PICTURE))
    (root / "secret.png").write_bytes(png_bytes(PICTURE))
    llm = LLM(path, dtype="float32")
    expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": PICTURE},
                                                      {"type": "text", "text": QUESTION}]}],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    llm.shutdown()
    with real_server(path, "--dtype", "float32", "--allowed-local-media-path", str(media),
                     "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000") as server:
        yield server, expected, media, root


def engine_pid(server) -> int:
    return int(Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()[0])


def chat(server, parts: list[dict]) -> requests.Response:
    return requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": parts}], "max_tokens": NUM_TOKENS, "temperature": 0,
        "ignore_eos": True})


def image_url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_chat_with_a_data_url_answers_as_offline(vision_server):
    server, expected, _, _ = vision_server
    response = chat(server, [image_url_part(data_url(png_bytes(PICTURE))), {"type": "text", "text": QUESTION}])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_file_url_under_the_allowed_folder(vision_server):
    server, expected, media, _ = vision_server
    response = chat(server, [image_url_part(f"file://{media}/picture.png"), {"type": "text", "text": QUESTION}])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected.text


def test_responses_input_image(vision_server):
    server, expected, _, _ = vision_server
    response = requests.post(f"{server.url}/v1/responses", timeout=120, json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(png_bytes(PICTURE))},
                                               {"type": "input_text", "text": QUESTION}]}],
        "max_output_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == expected.text


def test_anthropic_base64_image(vision_server):
    server, expected, _, _ = vision_server
    response = requests.post(f"{server.url}/v1/messages", timeout=120, json={
        "model": "smollm2", "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(PICTURE)).decode()}},
            {"type": "text", "text": QUESTION}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == expected.text


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with a tiny (truncated) body: read header-only, never decoded."""
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


BAD = {
    "not an image": (lambda m, r: image_url_part(data_url(b"this is text, not pixels")), "not an image"),
    "truncated png": (lambda m, r: image_url_part(data_url(png_bytes(PICTURE)[:60])), "broken or truncated"),
    "30000 x 30000": (lambda m, r: image_url_part(data_url(bomb_png(30000, 30000))), "more pixels than the limit"),
    "2000 x 2000": (lambda m, r: image_url_part(data_url(bomb_png(2000, 2000))), "2000 x 2000 pixels"),
    "media type": (lambda m, r: image_url_part(data_url(png_bytes(PICTURE), "image/svg+xml")), "not supported"),
    "http url": (lambda m, r: image_url_part("https://example.com/cat.png"), "fetches no URLs"),
    "outside the folder": (lambda m, r: image_url_part(f"file://{r}/secret.png"), "outside the allowed"),
    "dot dot": (lambda m, r: image_url_part(f"file://{m}/../secret.png"), "'..'"),
    "bad base64": (lambda m, r: image_url_part("data:image/png;base64,@@@@"), "base64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s_naming_the_part(vision_server, case):
    server, _, media, root = vision_server
    pid = engine_pid(server)
    make_part, message = BAD[case]
    response = chat(server, [{"type": "text", "text": QUESTION}, make_part(media, root)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]["message"]
    assert "messages[0].content[1]" in error and message in error, error
    assert engine_pid(server) == pid


def test_more_images_than_the_limit_is_a_400(vision_server):
    server, _, _, _ = vision_server
    part = image_url_part(data_url(png_bytes(PICTURE)))
    response = chat(server, [part, part, part, {"type": "text", "text": QUESTION}])
    assert response.status_code == 400
    assert "messages[0].content[2]" in response.json()["error"]["message"]
    assert "limit-mm-per-prompt" in response.json()["error"]["message"]


def test_an_image_to_a_text_only_model_is_a_400(tmp_path):
    from tests.helpers.models import cached_default_model

    with real_server(str(cached_default_model())) as server:
        pid = engine_pid(server)
        response = chat(server, [image_url_part(data_url(png_bytes(PICTURE))), {"type": "text", "text": QUESTION}])
        assert response.status_code == 400
        assert "messages[0].content[0]: this model is text-only" in response.json()["error"]["message"]
        assert engine_pid(server) == pid


@pytest.mark.slow
def test_the_chat_page_sends_an_attached_image(vision_server):
    """A picked file goes with the question as an image_url part: the page's answer is the API's."""
    from selenium.webdriver.common.by import By

    from scripts.lib.headless_browser import HeadlessChromium, missing_browser_reason
    from tests.helpers.server import wait_for

    server, _, media, _ = vision_server
    if missing_browser_reason() is not None:
        pytest.fail(f"no browser: {missing_browser_reason()}")
    expected = chat(server, [image_url_part(data_url((media / "picture.png").read_bytes())),
                             {"type": "text", "text": QUESTION}]).json()["choices"][0]["message"]["content"]
    with HeadlessChromium() as browser:
        driver = browser.driver
        driver.get(server.url + "/")
        picker = driver.find_element(By.ID, "image")
        driver.execute_script("arguments[0].hidden = false", picker)  # selenium types only into visible inputs
        picker.send_keys(str(media / "picture.png"))
        wait_for(lambda: driver.find_element(By.ID, "image-preview").is_displayed(), what="the preview")
        for field, value in (("temperature", "0"), ("max-tokens", str(NUM_TOKENS)), ("prompt", QUESTION)):
            driver.find_element(By.ID, field).clear()
            driver.find_element(By.ID, field).send_keys(value)
        driver.find_element(By.ID, "send").click()
        answer = wait_for(lambda: driver.execute_script(
            "const a = document.querySelector('.message.assistant');"
            "return a && a.dataset.finish !== undefined ? a.querySelector('.text').textContent : null;"),
            what="the answer")
        assert answer == expected
        assert driver.find_elements(By.CSS_SELECTOR, ".message.user img.image-preview")  # the thumbnail
        assert not driver.find_element(By.ID, "image-preview").is_displayed()  # sent: no longer attached
        assert browser.console_errors() == []
