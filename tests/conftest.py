"""Shared test helpers: the default model's folder and a greedy transformers reference."""

from __future__ import annotations

import os

import pytest

# Triton's interpreter must be chosen before triton is first imported anywhere in
# the session; on a machine without CUDA every kernel test runs under it.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tokenizer-only model folder for the fake engine core (tests/fake_engine.py)."""
    from fake_engine import write_fake_model

    return write_fake_model(tmp_path_factory.mktemp("fake-model"))


@pytest.fixture(scope="module")
def event_log(tmp_path_factory):
    """Where the fake core appends its 'add ID' / 'abort ID' lines."""
    return tmp_path_factory.mktemp("events") / "events.log"


def cached_default_model():
    """The default model's converted folder, found where engine.model_files puts it
    ($TOKENLOOM_CACHE included). Missing, it skips the test, except under CI, where
    `make test` converts it first and a missing model is a failure."""
    from engine.model_files import DEFAULT_MODEL, cache_dir, find_known_model

    folder = cache_dir() / "models" / find_known_model(DEFAULT_MODEL).folder_name
    if not (folder / "tokenizer.json").is_file():
        message = f"the default model is not converted at {folder} (make model)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.model_files import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


def hf_greedy(model, prompt_token_ids: list[int], num_new_tokens: int) -> list[int]:
    """Token-by-token greedy decoding with transformers' own forward and KV cache (EOS ignored)."""
    import torch

    input_ids = torch.tensor([prompt_token_ids])
    output_ids = []
    past = None
    with torch.inference_mode():
        for _ in range(num_new_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
            output_ids.append(next_id)
            input_ids = torch.tensor([[next_id]])
    return output_ids
