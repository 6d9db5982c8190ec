"""A torch-free tokenizer: HF `tokenizer.json` plus the chat template, for server and offline API.

transformers' AutoTokenizer would do, but importing it pulls torch in whenever torch
is installed (transformers 5 checks for torch at import time and loads it), and the
frontend must never import torch. The offline `LLM` uses this one too, so both paths
encode prompts and render chat templates with the same code. AutoTokenizer's fast tokenizers run on the
`tokenizers` library anyway, so we load `tokenizer.json` with it directly and render
the chat template with jinja2 the way transformers does (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`).

The API is the subset of PreTrainedTokenizerFast both paths use: `encode`,
`decode` (all the incremental detokenizer needs), `convert_ids_to_tokens`,
`apply_chat_template`, `all_special_ids`, `eos_token_id`.

Reference: transformers/utils/chat_template_utils.py (_compile_jinja_template).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as RustTokenizer

# Special-token names a chat template may refer to, as in transformers.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt"})


class TemplateError(ValueError):
    """The chat template rejected the messages (its `raise_exception`) or is missing."""


class Tokenizer:
    """Text <-> token ids for one model folder, plus its chat template."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        self.folder = folder
        self._tokenizer = RustTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        self.special_tokens = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = _read_chat_template(folder, config)
        added = self._tokenizer.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, token in added.items() if token.special)
        eos = self.special_tokens["eos_token"]
        self.eos_token_id = self._tokenizer.token_to_id(eos) if eos else None
        self._template: jinja2.Template | None = None
        # The most UTF-8 bytes one token can stand for (an upper bound: byte-level BPE writes
        # a byte as a 1-2 byte character): max_model_len of them bound any prompt that fits.
        self.max_token_bytes = max(len(token.encode("utf-8")) for token in self._tokenizer.get_vocab(True))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it works (`encode` holds it), so a
        # tokenizing thread leaves the event loop free.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in token_ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render the conversation as prompt text (encode it with add_special_tokens=False).

        `tools`: JSON-schema tool definitions, handed to the template as `tools` (None when
        absent), as transformers does. `template_kwargs`: more template variables (vLLM's
        `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); they may not replace the
        conversation, the tools, the generation prompt or the special tokens."""
        template_kwargs = template_kwargs or {}
        reserved = sorted(set(template_kwargs) & (RESERVED_TEMPLATE_NAMES | set(self.special_tokens)))
        if reserved:
            raise TemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if self._template is None:
            if not self.chat_template:
                raise TemplateError(f"the model at {self.folder} has no chat template (a base model?): "
                                    "send its prompt as text to /v1/completions or /generate")
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                **template_kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        # Like transformers' apply_chat_template(tokenize=True): the template already
        # writes the special tokens, so the post-processor must not add a second BOS.
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_chat_template(folder: Path, config: dict) -> str | None:
    template_file = folder / "chat_template.jinja"  # transformers >= 4.50 saves it beside the config
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
