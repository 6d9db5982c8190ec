"""Tests for ipc.text.output_processor's IncrementalDetokenizer and ipc.text.stop_checker.

Two tiny tokenizers are trained here so the tests run anywhere: a GPT-2 style
byte-level BPE (splits CJK and emoji bytes across tokens) and a Llama style one
(Metaspace "▁" spaces, byte fallback, a decoder that strips the leading space).
The SmolLM2 tokenizer is added when its cached folder exists.
"""

import json
import random

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ipc.text.output_processor import IncrementalDetokenizer
from ipc.text.stop_checker import StopChecker
from tests.helpers.models import cached_default_model

CORPUS = [
    "Hello world, this is a test.", "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。", "我们一起学习机器学习。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇯🇵 🇺🇸 ❤️", "Line one\nLine two\n\n  indented",
] * 3
CHINESE = "你好，世界！今天天气很好。我们一起学习机器学习，日本語も少し。"
EMOJI = "Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇺🇸🇩🇪 rainbow 🏳️‍🌈 heart ❤️ 𝔘"
MIXED = "Hello\n\n  world\t中文 mixed 😀end \n  Ünïcödé ñ  double  spaces\n"


def _byte_level_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary keeps most CJK/emoji characters split over byte tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _llama_like_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([s for s in CORPUS if s.isascii()], trainer)
    # Rebuild as Llama's tokenizer.json: <0xXX> byte tokens for characters outside
    # the vocabulary and a decoder that strips one leading space.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


_TOKENIZERS = {}


def _get_tokenizer(name):
    if name not in _TOKENIZERS:
        if name == "smollm2":
            _TOKENIZERS[name] = AutoTokenizer.from_pretrained(cached_default_model())
        else:
            _TOKENIZERS[name] = {"byte_level": _byte_level_tokenizer,
                                 "llama_like": _llama_like_tokenizer}[name]()
    return _TOKENIZERS[name]


@pytest.fixture(params=["byte_level", "llama_like", "smollm2"])
def tokenizer(request):
    return _get_tokenizer(request.param)


def _stream(tokenizer, ids, chunk_sizes=None, skip_special_tokens=True, prompt=None):
    """Feed `ids` in chunks; return (deltas, flushed text)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add_tokens(ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def _has_byte_fallback(tokenizer):
    return bool(json.loads(tokenizer.backend_tokenizer.to_str())["model"].get("byte_fallback"))


def _random_chunks(rng, n):
    return [rng.randint(1, 4) for _ in range(n)]


@pytest.mark.parametrize("text", [CHINESE, EMOJI, MIXED, "", " leading space", "a\n b"])
def test_stream_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for chunk_sizes in [None] + [_random_chunks(rng, len(ids)) for _ in range(5)]:
        deltas, flushed = _stream(tokenizer, ids, chunk_sizes)
        assert "".join(deltas) + flushed == expected
        assert not any("\ufffd" in d for d in deltas + [flushed])


def test_multibyte_chars_really_split_across_tokens():
    # Guards the test above: it must exercise characters spread over tokens.
    tok = _get_tokenizer("byte_level")
    for text in (CHINESE, EMOJI):
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_incomplete_char_held_then_flushed(tokenizer):
    ids = tokenizer.encode("ab 你好", add_special_tokens=False)
    for cut in range(1, len(ids)):
        partial = tokenizer.decode(ids[:cut])
        deltas, flushed = _stream(tokenizer, ids[:cut])
        assert not any("\ufffd" in d for d in deltas)
        # A sequence cut mid-character ends before that character, never in U+FFFD (as in vLLM).
        assert "\ufffd" not in flushed
        if _has_byte_fallback(tokenizer) and partial.endswith("\ufffd"):
            # ByteFallback turns a whole run of <0xXX> tokens into U+FFFDs once the
            # run ends incomplete, garbling characters already complete (and sent).
            assert ("".join(deltas) + flushed).startswith("ab ")
        else:
            assert "".join(deltas) + flushed == partial.rstrip("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, skip_special_tokens):
    special_ids = [tokenizer.eos_token_id] * 2
    ids = (tokenizer.encode("Hello", add_special_tokens=False) + special_ids
           + tokenizer.encode(" world 你好", add_special_tokens=False)[1:] + special_ids[:1])
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, flushed = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + flushed == expected
    assert (tokenizer.eos_token in expected) != skip_special_tokens


def test_prompt_gives_context_for_first_token(tokenizer):
    ids = tokenizer.encode("Hello world 你好 there", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    full, prompt_text = tokenizer.decode(ids), tokenizer.decode(prompt)
    deltas, flushed = _stream(tokenizer, output, prompt=prompt)
    assert "".join(deltas) + flushed == full[len(prompt_text):]


def test_cost_per_token_is_bounded():
    tok = _get_tokenizer("byte_level")
    window_sizes = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            window_sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode((CHINESE + MIXED) * 10, add_special_tokens=False)
    deltas, flushed = _stream(CountingTokenizer(), ids)
    assert "".join(deltas) + flushed == tok.decode(ids)
    assert len(ids) > 500 and max(window_sizes) <= 8


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.sampled_from(list("ab \n中文字😀👍🏽🇯🇵\u200d")), max_size=30),
       seed=st.integers(0, 2**16))
def test_random_text_random_chunks(text, seed):
    tok = _get_tokenizer("byte_level")
    ids = tok.encode(text, add_special_tokens=False)
    deltas, flushed = _stream(tok, ids, _random_chunks(random.Random(seed), len(ids)))
    assert "".join(deltas) + flushed == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas + [flushed])


# ---- StopChecker ----

def _run_stop(deltas, stop, include=False):
    checker = StopChecker(stop, include_stop_str_in_output=include)
    out = []
    for delta in deltas:
        text, is_hit = checker.process(delta)
        out.append(text)
        if is_hit:
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def test_stop_inside_one_delta():
    assert _run_stop(["Hello STOP world"], ["STOP"]) == ("Hello ", True)


def test_stop_split_across_deltas_is_never_streamed():
    checker = StopChecker(["<|end|>"])
    assert checker.process("Hi <|e") == ("Hi ", False)
    assert checker.process("nd") == ("", False)
    assert checker.process("|> more") == ("", True)
    assert checker.process("x") == ("", True) and checker.flush() == ""


def test_stop_at_start_and_include():
    assert _run_stop(["STOP", " rest"], ["STOP"]) == ("", True)
    assert _run_stop(["ab", "cSTO", "P rest"], ["STOP"], include=True) == ("abcSTOP", True)


def test_multiple_stop_strings_earliest_wins():
    assert _run_stop(["x END y STOP"], ["STOP", "END"]) == ("x ", True)
    assert _run_stop(["x STO", "P y END"], ["END", "STOP"]) == ("x ", True)


def test_no_stop_strings_pass_through():
    checker = StopChecker([])
    assert checker.process("STOP <|") == ("STOP <|", False)
    assert checker.flush() == ""


def test_held_back_text_released_by_flush():
    checker = StopChecker(["STOP"])
    assert checker.process("the ST") == ("the ", False)
    assert checker.process("ORM S") == ("STORM ", False)
    assert checker.flush() == "S"


def _reference_stop(text, stop, include):
    """Cut at the stop occurrence that ends first (ties: the one starting first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stop if s and s in text]
    if not found:
        return text, False
    end, start, _ = min(found)
    return text[:end if include else start], True


@settings(max_examples=300, deadline=None)
@given(text=st.text("abcx", max_size=30), stop=st.lists(st.text("abc", min_size=1, max_size=4),
       max_size=3), include=st.booleans(), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_property(text, stop, include, cuts):
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _run_stop(deltas, stop, include) == _reference_stop(text, stop, include)
