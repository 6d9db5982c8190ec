"""The Responses API's stored responses and cut answers on a live frontend with a fake core (issue #54,
points 3 and 4): `metadata` is bounded as OpenAI bounds it, the store's bound holds in the frontend's
real memory (VmRSS), and an answer cut by max_output_tokens says "incomplete" on its items too."""

from __future__ import annotations

import json

import pytest
import requests

from scripts.lib.fake_engine import FrontendServer
from tests.helpers.server import fake_core, rss_mb

pytestmark = pytest.mark.timeout(300)
MAX_METADATA = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}  # 16 pairs, keys of 64, values of 512
NUM_STORED = 50
MAX_RSS_GROWTH_MB = 100


@pytest.fixture(scope="module")
def server(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.002")) as server:
        yield server


def post(server, body: dict | bytes) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return requests.post(f"{server.url}/v1/responses", data=data, headers={"content-type": "application/json"},
                         timeout=120)


@pytest.mark.parametrize(("metadata", "words"), [
    ({f"k{i}": "v" for i in range(17)}, "17 pairs"),
    ({"k" * 65: "v"}, "65 characters"),
    ({"k": "v" * 513}, "513 characters"),
    ({"k": ["v"]}, "must be a string"),
    ({"k": 5}, "must be a string"),
    (["k", "v"], "must be an object"),
    ({"k": [[]] * 330_000}, "must be a string"),  # the body: 990 KB of empty lists
])
def test_metadata_is_bounded_as_openai_bounds_it(server, metadata, words):
    reply = post(server, {"input": "Hi", "max_output_tokens": 2, "metadata": metadata})
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "metadata" in error["message"] and words in error["message"]


def test_metadata_at_the_limits_is_stored_and_echoed(server):
    reply = post(server, {"input": "Hi", "max_output_tokens": 2, "metadata": MAX_METADATA})
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["metadata"] == MAX_METADATA
    stored = requests.get(f"{server.url}/v1/responses/{reply.json()['id']}", timeout=30)
    assert stored.status_code == 200 and stored.json() == reply.json()


def test_an_answer_cut_by_max_output_tokens_is_incomplete_down_to_its_items(server):
    response = post(server, {"input": "Hi", "max_output_tokens": 3}).json()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in response["output"]] == ["incomplete"]
    stored = requests.get(f"{server.url}/v1/responses/{response['id']}", timeout=30).json()
    assert [item["status"] for item in stored["output"]] == ["incomplete"]
    with requests.post(f"{server.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "stream": True},
                       stream=True, timeout=60) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith(b"data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["incomplete"]
    assert events[-1]["type"] == "response.incomplete"
    assert [item["status"] for item in events[-1]["response"]["output"]] == ["incomplete"]


def maximal_body(index: int) -> bytes:
    """A body near the 1 MiB limit that the server keeps whole: the most metadata allowed, and a tool
    whose unknown key holds empty lists (echoed in the response's `tools`, never in the prompt)."""
    head = {"input": f"Hi {index}", "max_output_tokens": 1, "store": True, "tool_choice": "none",
            "metadata": MAX_METADATA}
    prefix = json.dumps(head)[:-1] + ', "tools": [{"type": "function", "name": "f", "junk": ['
    num_lists = ((1 << 20) - len(prefix) - 1024) // 3
    return (prefix + ",".join(["[]"] * num_lists) + "]}]}").encode()


def test_fifty_maximal_stored_responses_stay_under_100_mb_of_rss(server):
    before = rss_mb(server.process.pid)
    ids = []
    for index in range(NUM_STORED):
        body = maximal_body(index)
        assert len(body) <= 1 << 20
        reply = post(server, body)
        assert reply.status_code == 200, reply.text[:300]
        ids.append(reply.json()["id"])
    grown = rss_mb(server.process.pid) - before
    assert grown <= MAX_RSS_GROWTH_MB, f"frontend RSS grew {grown:.0f} MB for {NUM_STORED} stored responses"
    # They are all kept (50 MB of JSON is under the store's 64 MiB) and read back whole.
    first = requests.get(f"{server.url}/v1/responses/{ids[0]}", timeout=60)
    assert first.status_code == 200 and len(first.json()["tools"][0]["junk"]) > 300_000
