"""The grammar compiler's tokenizer info kept on disk (engine/structured_output/tokenizer_info.py):
a second load reads what the first built, anything it depends on names another file, and a torn
file is built again rather than trusted."""

from __future__ import annotations

import shutil

import pytest

from engine.structured_output import tokenizer_info
from engine.structured_output.tokenizer_info import info_key, load_tokenizer_info

pytestmark = pytest.mark.slow


def test_a_second_load_reads_the_cached_info_and_it_masks_as_a_fresh_one(default_model_path, tmp_path, monkeypatch):
    built = load_tokenizer_info(default_model_path, 49152, [2], tmp_path)
    (cached_file,) = tmp_path.glob("*.json")
    monkeypatch.setattr(tokenizer_info, "build_tokenizer_info", lambda *args: pytest.fail("built, not read"))
    read = load_tokenizer_info(default_model_path, 49152, [2], tmp_path)
    assert read.serialize_json() == built.serialize_json() == cached_file.read_text()
    assert (read.vocab_size, read.stop_token_ids) == (49152, [2])
    import xgrammar

    # What a compile from the read info allows is what one from a freshly built info allows.
    masks = []
    for info in (read, built):
        matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex("[0-9]+ apples"))
        bitmask = xgrammar.allocate_token_bitmask(1, 49152)
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(bitmask)
    assert masks[0].equal(masks[1]) and masks[0].any()


def test_the_key_changes_with_the_vocabulary_the_stop_tokens_and_the_tokenizer(default_model_path, tmp_path):
    key = info_key(default_model_path, 49152, [2])
    assert key == info_key(default_model_path, 49152, [2])
    assert len({key, info_key(default_model_path, 49216, [2]), info_key(default_model_path, 49152, [2, 0]),
                info_key(default_model_path, 49152, [])}) == 4
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_path}/{name}", copy / name)
    assert info_key(copy, 49152, [2]) == key  # files the tokenizer does not read do not count
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert info_key(copy, 49152, [2]) != key


def test_a_torn_cache_file_is_built_again(default_model_path, tmp_path):
    path = tmp_path / f"{info_key(default_model_path, 49152, [2])}.json"
    path.write_text('{"vocab_type": 2, "vocab')
    info = load_tokenizer_info(default_model_path, 49152, [2], tmp_path)
    assert info.vocab_size == 49152 and path.read_text() == info.serialize_json()
