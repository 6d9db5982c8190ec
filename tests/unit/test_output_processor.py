"""ipc.text.output_processor: engine outputs in, text deltas and the ids to abort out.

Built from hand-made `RequestOutput`s over the fake model's real tiny tokenizer: no
engine, no torch. The end-to-end agreement of the server and the offline LLM, which
both go through this processor, is tests/server/test_offline_vs_server.py.
"""

from __future__ import annotations

import pytest

from ipc.messages import FinishReason, RequestOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams
from ipc.text.output_processor import OutputProcessor
from ipc.text.tokenizer import Tokenizer
from scripts.lib.fake_engine import SCRIPT, write_fake_model

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_fake_model(tmp_path_factory.mktemp("fake-model")))


def stream(request_id: str, token_ids: list[int], last: FinishReason | None = None, **fields) -> list[RequestOutput]:
    """One output per token, as the engine sends them; `last` finishes the final one."""
    return [RequestOutput(request_id, [t], last if i == len(token_ids) - 1 else None, **fields)
            for i, t in enumerate(token_ids)]


def run(processor: OutputProcessor, outputs: list[RequestOutput]):
    """Process one output per step; return (text per request, finish reasons, ids to abort, deltas)."""
    texts, reasons, to_abort, deltas = {}, {}, [], []
    for output in outputs:
        processed = processor.process_outputs([output])
        to_abort += processed.request_ids_to_abort
        for delta in processed.deltas:
            deltas.append(delta)
            texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason
    return texts, reasons, to_abort, deltas


def test_text_and_counts_match_a_plain_decode(tokenizer):
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", PROMPT, SamplingParams(), index=5)
    texts, reasons, to_abort, deltas = run(processor, stream("a", ids, FinishReason.LENGTH, num_cached_tokens=2))
    assert texts == {"a": tokenizer.decode(ids)} and reasons == {"a": FinishReason.LENGTH} and not to_abort
    last = deltas[-1]
    assert (last.index, last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == \
        (5, len(PROMPT), len(ids), 2)
    assert not processor.has_request("a") and processor.num_requests == 0


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_finishes_the_request_and_asks_for_an_abort(tokenizer, include):
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("s", PROMPT, SamplingParams(stop=["fox"], include_stop_str_in_output=include))
    processor.add_request("plain", PROMPT, SamplingParams())
    outputs = [o for pair in zip(stream("s", ids), stream("plain", ids, FinishReason.LENGTH)) for o in pair]
    texts, reasons, to_abort, _ = run(processor, outputs)
    assert texts["s"] == "The quick brown " + ("fox" if include else "")
    assert reasons == {"s": FinishReason.STOP, "plain": FinishReason.LENGTH}
    assert texts["plain"] == tokenizer.decode(ids)
    assert to_abort == ["s"]  # once: its later outputs are dropped


def test_a_stop_string_in_the_engines_last_output_needs_no_abort(tokenizer):
    ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("s", PROMPT, SamplingParams(stop=["fox"]))
    texts, reasons, to_abort, _ = run(processor, stream("s", ids, FinishReason.LENGTH))
    assert texts == {"s": "The quick brown "} and reasons == {"s": FinishReason.STOP} and not to_abort


def test_a_stop_token_is_not_text(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    processor = OutputProcessor(tokenizer)
    processor.add_request("e", PROMPT, SamplingParams(skip_special_tokens=False))
    texts, _, _, deltas = run(processor, stream("e", ids, FinishReason.STOP, stop_token_id=tokenizer.eos_token_id))
    assert texts == {"e": "Hello world"}
    assert deltas[-1].output.stop_token_id == tokenizer.eos_token_id  # the output itself rides along


def test_removed_and_unknown_requests_are_dropped(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("gone", PROMPT, SamplingParams())
    processor.remove_requests(["gone", "never-added"])
    assert processor.process_outputs([RequestOutput("gone", [5]), RequestOutput("other", [5])]).deltas == []
    processor.add_request("gone", PROMPT, SamplingParams())  # the id is free again
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request("gone", PROMPT, SamplingParams())


def test_token_ids_only_without_a_tokenizer():
    processor = OutputProcessor(None)
    logprobs = [TokenLogprobs(7, -0.5)]
    processor.add_request("t", PROMPT, SamplingParams(logprobs=0))
    [delta] = processor.process_outputs([RequestOutput("t", [7], FinishReason.LENGTH, logprobs)]).deltas
    assert (delta.text, delta.token_ids, delta.logprobs, delta.finish_reason) == ("", [7], logprobs,
                                                                                  FinishReason.LENGTH)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        processor.add_request("u", PROMPT, SamplingParams(stop=["x"]))


def test_a_detokenizer_failure_fails_that_request_alone(tokenizer):
    class Broken:
        def decode(self, token_ids, skip_special_tokens=True):
            if 666 in token_ids:
                raise RuntimeError("boom")
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    processor = OutputProcessor(Broken())
    processor.add_request("bad", PROMPT, SamplingParams())
    processor.add_request("good", PROMPT, SamplingParams())
    processed = processor.process_outputs([RequestOutput("bad", [666]), RequestOutput("good", [5])])
    assert processed.failed_request_ids == ["bad"] and processed.request_ids_to_abort == ["bad"]
    assert [d.request_id for d in processed.deltas] == ["good"] and not processor.has_request("bad")
