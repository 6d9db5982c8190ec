"""Deeply nested JSON on every route that parses JSON a client sends (issue #54, point 2): in a
string (tool call arguments, guided_json), as a value in the body (schemas, a tool_use input),
and the body itself. Each is a 400 in its route's error shape, naming the nesting, on a live
frontend with a fake core; the cases are the hostile script's (scripts/hostile/nesting.py)."""

from __future__ import annotations

import json

import pytest
import requests

from scripts.hostile.nesting import CASES
from scripts.lib.fake_engine import FrontendServer
from tests.helpers.server import fake_core

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.002")) as server:
        yield server


@pytest.mark.parametrize(("route", "name", "body"), CASES, ids=[f"{route} {name}" for route, name, _ in CASES])
def test_nested_json_is_a_400_in_the_routes_shape(server, route, name, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(server.url + route, data=data, headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text[:300]
    answer = reply.json()
    if route == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    else:
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == 400, answer
    message = answer["error"]["message"]
    if name == "body":
        assert "not valid JSON" in message and "recursion limit" in message, message
    elif route != "/v1/embeddings":  # an embedding input is no JSON text: its own 400 says what input must be
        assert "levels deep, over the limit of 128" in message, message
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
