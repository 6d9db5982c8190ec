"""OpenAI's `prediction` field and speculative decoding's counts through the frontend, on the fake core.

The fake core checks each step's token against the prediction's token at that position
(accepted when equal, rejected when not), so every count here is known exactly; the real
engine's drafting is tested with the default model in test_prediction_openai.py.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from frontend.metrics import FrontendMetrics
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.serving_utils import Usage
from frontend.spec_decode_metrics import spec_decode_summary, subtract_spec_decode, sum_spec_decode
from ipc.messages import RequestOutput, SchedulerStats, SpecDecodeStats, SpecMethod
from ipc.sampling_params import SamplingParams, check_request
from ipc.text.output_processor import RequestDelta
from scripts.lib.fake_engine import SCRIPT, FrontendServer, expected_text
from scripts.lib.local_server import parse_metrics, spec_decode_delta
from tests.helpers.server import metric

pytestmark = pytest.mark.timeout(120)
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def server(model_folder):
    with FrontendServer(model_folder, "--served-model-name", "fake") as server:
        yield server


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")


def details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


# ---------------------------------------------------------------- without a server


def test_prediction_body_takes_text_or_text_parts():
    assert CompletionRequest(prompt="x", prediction={"type": "content", "content": "abc"}).prediction_text == "abc"
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 prediction={"type": "content", "content": parts})
    assert body.prediction_text == "abc"
    assert CompletionRequest(prompt="x").prediction_text is None


def test_check_request_refuses_a_prediction_over_the_context_or_with_n():
    params = SamplingParams(max_tokens=4, prediction_token_ids=[1] * 101)
    with pytest.raises(ValueError, match="prediction is 101 tokens long, more than .* 100 tokens"):
        check_request([1, 2], params, vocab_size=50, max_model_len=100)
    with pytest.raises(ValueError, match="prediction cannot be used with n > 1"):
        check_request([1, 2], SamplingParams(max_tokens=4, prediction_token_ids=[1]), vocab_size=50,
                      max_model_len=100, n=2)
    with pytest.raises(ValueError, match=r"prediction must hold token ids in \[0, 50\)"):
        check_request([1, 2], SamplingParams(max_tokens=4, prediction_token_ids=[50]), vocab_size=50,
                      max_model_len=100)
    check_request([1, 2], SamplingParams(max_tokens=4, prediction_token_ids=[1] * 100), vocab_size=50,
                  max_model_len=100)


def test_usage_sums_the_step_deltas_and_bills_rejected_tokens():
    usage = Usage(n=1)
    for accepted, rejected, num_output in ((0, 0, 1), (3, 1, 5), (0, 2, 6)):
        output = RequestOutput("r", [7], num_accepted_prediction_tokens=accepted,
                               num_rejected_prediction_tokens=rejected)
        usage.add(RequestDelta(0, "", [7], None, None, 10, num_output, output=output))
    u = usage.to_dict()
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 3}
    assert u["completion_tokens"] == 6 + 3 and u["total_tokens"] == 10 + 9


def test_spec_decode_stats_sum_over_cores_and_subtract_over_a_run():
    ngram, prediction = SpecMethod.NGRAM, SpecMethod.PREDICTION
    core0 = [SpecDecodeStats(prediction, 2, 8, 6, 8), SpecDecodeStats(ngram, 1, 4, 1, 2)]
    core1 = [SpecDecodeStats(ngram, 3, 12, 9, 12)]
    total = sum_spec_decode([core0, core1])
    assert [s.method for s in total] == [ngram, prediction]
    assert total[0] == SpecDecodeStats(ngram, 4, 16, 10, 14)
    run = subtract_spec_decode(total, [SpecDecodeStats(ngram, 1, 4, 1, 2)])
    summary = spec_decode_summary(run)
    assert summary["ngram"] == {"num_drafts": 3, "num_proposed_tokens": 12, "num_accepted_tokens": 9,
                                "num_emitted_tokens": 12, "acceptance_rate": 0.75, "tokens_per_draft": 4.0}
    assert summary["prediction"]["acceptance_rate"] == 0.75
    assert spec_decode_summary([SpecDecodeStats(ngram)]) == {}  # nothing drafted: nothing to show


def test_metrics_list_every_method():
    stats = SchedulerStats(spec_decode=[SpecDecodeStats(SpecMethod.NGRAM, 3, 12, 9, 12)])
    text = FrontendMetrics("m").render(stats, is_healthy=True)
    assert 'tokenloom_spec_decode_proposed_tokens_total{model_name="m",method="ngram"} 12' in text
    assert 'tokenloom_spec_decode_accepted_tokens_total{model_name="m",method="ngram"} 9' in text
    assert 'tokenloom_spec_decode_emitted_tokens_total{model_name="m",method="ngram"} 12' in text
    assert 'tokenloom_spec_decode_acceptance_rate{model_name="m",method="ngram"} 0.75' in text
    assert 'tokenloom_spec_decode_proposed_tokens_total{model_name="m",method="draft"} 0' in text
    assert 'tokenloom_spec_decode_acceptance_rate{model_name="m",method="prediction"} 0' in text
    # What the benchmarks read of it: per method, over a run.
    before = parse_metrics(FrontendMetrics("m").render(SchedulerStats(), is_healthy=True))
    assert spec_decode_delta(before, parse_metrics(text)) == {"ngram": {
        "num_drafts": 3, "num_proposed_tokens": 12, "num_accepted_tokens": 9, "num_emitted_tokens": 12,
        "acceptance_rate": 0.75, "tokens_per_draft": 4.0}}


# ---------------------------------------------------------------- through the server


def test_prediction_counts_reach_usage(oai, model_folder):
    answer = expected_text(model_folder, 20)
    # The answer's first 12 tokens' text, then a word that is not the script's: it diverges there.
    prediction = expected_text(model_folder, 12) + " zebra zebra"
    plain = oai.completions.create(model="fake", prompt=PROMPT, max_tokens=20, temperature=0)
    full = oai.completions.create(model="fake", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": prediction}})
    assert full.choices[0].text == plain.choices[0].text == answer
    accepted, rejected = details(full.usage)
    assert accepted >= 12 and rejected >= 1 and accepted + rejected <= 20
    # accepted + rejected + the rest = completion_tokens, the rest being the written tokens no prediction gave
    assert full.usage.completion_tokens == 20 + rejected
    assert details(plain.usage) == (0, 0) and plain.usage.completion_tokens == 20


def test_prediction_on_chat_streamed_with_usage(oai, model_folder):
    kwargs = dict(model="fake", messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0)
    prediction = [{"type": "text", "text": expected_text(model_folder, 8)},
                  {"type": "text", "text": expected_text(model_folder, 16)[len(expected_text(model_folder, 8)):]}]
    full = oai.chat.completions.create(**kwargs, prediction={"type": "content", "content": prediction})
    chunks = list(oai.chat.completions.create(**kwargs, prediction={"type": "content", "content": prediction},
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == expected_text(model_folder, 16)
    assert details(chunks[-1].usage) == details(full.usage) == (16, 0)
    assert chunks[-1].usage.completion_tokens == 16


@pytest.mark.parametrize("prediction, n, match", [
    ({"type": "text", "content": "x"}, 1, "prediction.type"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, 1, "prediction.content"),
    ({"type": "content", "content": 5}, 1, "prediction.content"),
    ("abc", 1, "prediction"),
    ({"type": "content", "content": "abc"}, 2, "prediction cannot be used with n > 1"),
    ({"type": "content", "content": " ".join(SCRIPT.split()) * 100}, 1, "prediction"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_predictions_are_400s_naming_the_field(server, route, prediction, n, match):
    body = {"model": "fake", "max_tokens": 4, "n": n, "prediction": prediction}
    body.update({"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    response = requests.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]


def test_metrics_and_dashboard_show_the_prediction_method(server, oai, model_folder):
    oai.completions.create(model="fake", prompt=PROMPT, max_tokens=8, temperature=0,
                           extra_body={"prediction": {"type": "content", "content": expected_text(model_folder, 8)}})
    assert metric(server.url, "spec_decode_proposed_tokens_total", 'method="prediction"') >= 8
    assert metric(server.url, "spec_decode_accepted_tokens_total", 'method="prediction"') >= 8
    assert 0 < metric(server.url, "spec_decode_acceptance_rate", 'method="prediction"') <= 1
    assert metric(server.url, "spec_decode_proposed_tokens_total", 'method="ngram"') == 0
    with requests.get(f"{server.url}/dashboard/events", stream=True, timeout=30) as response:
        line = next(line for line in response.iter_lines() if line.startswith(b"data: "))
    summary = json.loads(line[len(b"data: "):])["totals"]["spec_decode"]
    assert summary["prediction"]["num_accepted_tokens"] >= 8

