"""Bad input gets a clear 4xx and touches nothing else (live frontend, fake core).

Every bad request is followed by a good one that must be served normally. The fuzz
test posts hypothesis-made bodies, built from the field names in /openapi.json, and
asks only that the server never answers 5xx and keeps serving.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.lib.fake_engine import FrontendServer
from scripts.lib.raw_http import exchange
from tests.helpers.server import metric, wait_for

pytestmark = pytest.mark.timeout(300)
MAX_REQUEST_BYTES = 65536
GOOD = {"prompt": "Hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def server(model_folder):
    with FrontendServer(model_folder, "--served-model-name", "fake",
                        "--max-request-bytes", str(MAX_REQUEST_BYTES)) as server:
        yield server


def assert_still_serving(server) -> None:
    response = requests.post(f"{server.url}/v1/completions", json=GOOD, timeout=10)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "Hi"}]
BAD_BODIES = [  # (path, raw body or JSON, what the message must name)
    (C, b'{"prompt": "Hi", ', "not valid JSON"),
    (C, b"", "not valid JSON"),
    (GEN, b"{'prompt': 'single quotes'}", "not valid JSON"),
    (C, b"[1, 2]", "must be a JSON object, got an array"),
    (CHAT, b'"hello"', "must be a JSON object, got a string"),
    (GEN, b"null", "must be a JSON object, got null"),
    (C, b'{"prompt": "caf\xe9"}', "not valid UTF-8"),
    (C, b'{"prompt": "\\ud800"}', "not valid JSON"),  # a lone surrogate: no tokenizer takes it
    (C, b'{"prompt": "Hi", "temperature": NaN}', "not valid JSON: `temperature` is nan"),
    (C, b'{"prompt": "Hi", "logit_bias": {"5": -Infinity}}', "`logit_bias.5` is -inf"),
    (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "tools": [1, Infinity]}', "`tools[1]` is inf"),
    (C, {"max_tokens": 5}, "prompt: Field required"),
    (CHAT, {"max_tokens": 5}, "messages: Field required"),
    (GEN, {"max_tokens": 5}, "prompt: Field required"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    (C, {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "Hi", "stop": 7}, "stop"),
    (CHAT, {"messages": "Hi"}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "role"),
    (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": []}, "prompt is empty"),
    (C, {"prompt": [[]]}, "prompt is empty"),
    (GEN, {"prompt": ""}, "prompt"),
    (CHAT, {"messages": []}, "messages must not be empty"),
    (C, {"prompt": "Hi", "max_tokens": 0}, "max_tokens must be between 1 and"),
    (C, {"prompt": "Hi", "max_tokens": -3}, "max_tokens must be between 1 and"),
    (GEN, {"prompt": "Hi", "max_tokens": 0}, "max_tokens must be between 1 and"),
    (C, {"prompt": "Hi", "max_tokens": 5000}, "maximum context length is 1024"),
    (CHAT, {"messages": USER, "max_completion_tokens": 5000}, "maximum context length is 1024"),
    (C, {"prompt": "fox " * 1500, "max_tokens": 1}, "maximum context length is 1024"),
    (C, {"prompt": [5] * 1024, "max_tokens": 1}, "maximum context length is 1024"),
    (C, {"prompt": [10**6]}, "prompt token ids must be integers"),
    (C, {"prompt": "Hi", "temperature": -0.5}, "temperature must be >= 0"),
    (C, {"prompt": "Hi", "top_p": 0}, "top_p must be in (0, 1]"),
    (C, {"prompt": "Hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    (C, {"prompt": "Hi", "top_k": -2}, "top_k must be -1"),
    (C, {"prompt": "Hi", "min_p": 2}, "min_p"),
    (C, {"prompt": "Hi", "n": 129}, "n must be between 1 and 128"),
    (C, {"prompt": "Hi", "n": 0}, "n must be between 1 and 128"),
    (C, {"prompt": ["Hi"] * 9, "n": 128}, "at most 1024 choices"),
    (C, {"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "at most 16 stop sequences"),
    (C, {"prompt": "Hi", "stop": ["x" * 300]}, "stop sequence"),
    (C, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "Hi", "seed": 2**64}, "seed"),
    (GEN, {"prompt": "Hi", "model": "fake"}, "model"),  # /generate has no model field
    # Values that would index a tensor out of bounds in the core, and counts past any int32.
    (C, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [100000]}, "stop_token_ids must be token ids"),
    (GEN, {"prompt": "Hi", "stop_token_ids": [2**31 - 1]}, "stop_token_ids must be token ids"),
    (CHAT, {"messages": USER, "stop_token_ids": [2**31 - 1]}, "stop_token_ids must be token ids"),
    (C, {"prompt": "Hi", "max_tokens": 2**64}, "max_tokens must be between 1 and"),
    (C, {"prompt": "Hi", "top_k": 2**63}, "top_k must be -1"),
    (C, {"prompt": "Hi", "min_tokens": 2**40}, "min_tokens must be between 0 and"),
]


@pytest.mark.parametrize("path, body, message", BAD_BODIES, ids=[f"{p}:{m}" for p, _, m in BAD_BODIES])
def test_bad_input_gets_400_and_the_next_request_is_served(server, path, body, message):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = requests.post(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert_still_serving(server)


@pytest.mark.parametrize("path, body", [(C, {"prompt": "Hi", "model": "gpt-4"}),
                                        (CHAT, {"messages": USER, "model": "x"})])
def test_unknown_model_gets_404_model_not_found(server, path, body):
    response = requests.post(f"{server.url}{path}", json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and f"`{body['model']}` does not exist" in error["message"]
    assert requests.post(f"{server.url}{path}", json={**body, "model": "fake", "max_tokens": 2}).status_code == 200


def test_body_over_the_limit_gets_413(server):
    # Content-Length over the limit: answered from the headers, no body sent at all.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    status, body = exchange(server.port, head, timeout_s=5)
    assert status == 413 and f"limit of {MAX_REQUEST_BYTES} bytes" in json.loads(body)["error"]["message"]
    # A chunked body with no length: cut off once it passes the limit, long before its end.
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b'{"prompt": "' + b"a" * 30000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] + [b"7530\r\n" + b"a" * 30000 + b"\r\n"] * 100
    status, body = exchange(server.port, head, chunks)
    assert status == 413 and "streamed" in json.loads(body)["error"]["message"]
    # Just under the limit is fine.
    response = requests.post(f"{server.url}/v1/completions", json={**GOOD, "user": "u" * (MAX_REQUEST_BYTES - 100)})
    assert response.status_code == 200
    assert_still_serving(server)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)
PLAUSIBLE = {  # values near the edges of what each field accepts
    "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 500), max_size=5),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                "content": st.text(max_size=20) | st.none()}), max_size=3),
    "max_tokens": st.integers(-2, 40) | st.none(), "max_completion_tokens": st.integers(-2, 40),
    "n": st.integers(-1, 4), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 50), "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-(2**64), 2**64),
    "stop": st.lists(st.text(max_size=5), max_size=20) | st.text(max_size=5), "logprobs": st.integers(-1, 25),
    "stream": st.booleans(), "top_logprobs": st.integers(-1, 25), "min_tokens": st.integers(-1, 50),
}


def body_strategy(required: str, fields: list[str]):
    """Plausible bodies (each field near its edges), half of them with junk in a few fields."""
    plausible = st.fixed_dictionaries({required: PLAUSIBLE[required]}, optional={
        name: PLAUSIBLE[name] for name in fields if name in PLAUSIBLE and name != required})
    junk = st.dictionaries(st.sampled_from(fields), JSON_VALUES, max_size=3)
    return plausible | st.tuples(plausible, junk).map(lambda pair: {**pair[0], **pair[1]})


def test_fuzzed_bodies_never_get_5xx(server):
    schema = requests.get(f"{server.url}/openapi.json").json()
    routes = {}
    for path, required in ((C, "prompt"), (CHAT, "messages"), (GEN, "prompt")):
        body_schema = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        routes[path] = body_strategy(required, sorted(body_schema["properties"]))
    bodies = st.one_of(*(st.tuples(st.just(path), strategy) for path, strategy in routes.items()),
                       st.tuples(st.sampled_from(list(routes)), st.binary(max_size=64)))
    statuses = {}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def post(path_and_body):
        path, body = path_and_body
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = requests.post(f"{server.url}{path}", data=data, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"]
        assert b"internal" not in response.content, (path, body, response.text)

    post()
    assert statuses.get(200) and statuses.get(400), statuses  # both sides were explored
    assert_still_serving(server)
    assert wait_for(lambda: metric(server.url, "num_requests_running") == 0)
