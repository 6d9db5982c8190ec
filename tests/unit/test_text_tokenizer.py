"""ipc.text.tokenizer (torch-free) must agree with transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipc.text.tokenizer import TemplateError, Tokenizer
from scripts.lib.fake_engine import write_fake_model
from tests.helpers.models import cached_default_model

TEXTS = ["Hello world, how are you today?", "  leading spaces\nand lines\n", "你好，世界 😀 café",
         "<|im_start|>user\nhi<|im_end|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Ok 😀"}],
]


@pytest.fixture(scope="module", params=["fake", "smollm2"])
def folder(request, tmp_path_factory) -> Path:
    if request.param == "fake":
        return write_fake_model(tmp_path_factory.mktemp("fake-model"))
    return cached_default_model()


@pytest.fixture(scope="module")
def pair(folder):
    from transformers import AutoTokenizer  # the reference; the test process may import torch

    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    ours, reference = pair
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, messages, add_generation_prompt):
    ours, reference = pair
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt) == text
    assert ours.encode_chat(messages, add_generation_prompt) == reference.encode(text, add_special_tokens=False)


def test_special_tokens(pair):
    ours, reference = pair
    assert ours.eos_token_id == reference.eos_token_id
    assert set(ours.all_special_ids) >= {reference.eos_token_id}
    assert ours.vocab_size == len(reference)


def test_template_errors(tmp_path):
    folder = write_fake_model(tmp_path / "model")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ raise_exception('only user messages') }}"
    config_path.write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="only user messages"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="no chat template"):
        Tokenizer(folder).encode_chat([{"role": "user", "content": "x"}])


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def folder_with_template(folder: Path, chat_template: str) -> Path:
    """A fake model folder whose tokenizer_config.json carries `chat_template`."""
    write_fake_model(folder)
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": chat_template}))
    return folder


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, café style",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOLS_TEMPLATE = ("{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tools_reach_the_template_as_in_transformers(tmp_path, tools):
    from transformers import AutoTokenizer

    folder = folder_with_template(tmp_path / "model", TOOLS_TEMPLATE)
    messages = CONVERSATIONS[0]
    text = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tools=tools, tokenize=False)
    assert Tokenizer(folder).apply_chat_template(messages, tools=tools) == text
    assert text.startswith("TOOLS [{") == (tools is not None)


# Qwen3's own lines for it: with enable_thinking false the template closes an empty reasoning.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                     "{% endif %}{% endif %}")


@pytest.mark.parametrize("template_kwargs", [None, {}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_template_kwargs_reach_the_template_as_in_transformers(tmp_path, template_kwargs):
    from transformers import AutoTokenizer

    folder = folder_with_template(tmp_path / "model", THINKING_TEMPLATE)
    messages = CONVERSATIONS[0]
    text = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
    ours = Tokenizer(folder)
    assert ours.apply_chat_template(messages, template_kwargs=template_kwargs) == text
    assert text.endswith("</think>\n\n") == (template_kwargs == {"enable_thinking": False})
    assert ours.encode_chat(messages, template_kwargs=template_kwargs) == ours.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "eos_token"])
def test_template_kwargs_may_not_replace_the_conversation_or_special_tokens(tmp_path, name):
    folder = write_fake_model(tmp_path / "model")
    with pytest.raises(TemplateError, match=f"chat_template_kwargs may not set {name}"):
        Tokenizer(folder).apply_chat_template(CONVERSATIONS[0], template_kwargs={name: "x"})
