"""The browser pages and the dashboard feed over real HTTP, on the fake engine core (scripts/lib/fake_engine.py).

The pages themselves are tested in a real browser by tests/server/test_browser.py; here: what
is served with and without the key, and what the feed says while requests run.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from frontend.web_pages import PAGES, render_page
from scripts.lib.fake_engine import FrontendServer
from tests.helpers.server import fake_core

KEY = "sekrit-key"


@pytest.fixture(scope="module")
def server(model_folder):
    # Slow steps, so requests are seen running; a name that needs escaping in HTML.
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.02"), "--api-key", KEY,
                        "--served-model-name", 'fake"<model>') as s:
        yield s


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def read_events(lines, num_events: int) -> list[dict]:
    """The next `num_events` events from one `iter_lines` iterator (a fresh one would lose its buffer)."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
            if len(events) == num_events:
                break
    return events


def test_pages_are_served_without_the_key_and_say_they_need_one(server):
    for path in ("/", "/dashboard"):
        response = requests.get(server.url + path, timeout=10)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert 'data-needs-key="true"' in response.text
        assert 'data-model="fake&quot;&lt;model&gt;"' in response.text  # escaped, never raw
        assert '<model>' not in response.text
    # ...while the API still wants the key.
    assert requests.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert requests.get(server.url + "/v1/models", headers=auth(), timeout=10).status_code == 200


def test_assets_come_from_the_package_and_name_no_other_host(server):
    page = requests.get(server.url + "/", timeout=10).text
    for asset in ("/static/common.js", "/static/chat.js", "/static/dashboard.js", "/static/style.css"):
        response = requests.get(server.url + asset, timeout=10)
        assert response.status_code == 200, asset
        assert "http://" not in response.text and "https://" not in response.text, asset
    assert "http" not in page
    assert requests.get(server.url + "/static/nothing.js", timeout=10).status_code == 404
    assert requests.get(server.url + "/static/../api_server.py", timeout=10).status_code == 404


def test_each_page_is_one_document_in_the_shared_shell():
    for name, (title, _) in PAGES.items():
        page = render_page(name, "smollm2", needs_key=False)
        assert page.count("<head>") == page.count("<body ") == page.count('id="key-form"') == 1, name
        assert f"<title>tokenloom {title}</title>" in page
        assert 'data-needs-key="false"' in page and 'data-model="smollm2"' in page
        assert "__" not in page, "a slot left unfilled"
        assert page.index('id="key-form"') < page.index("common.js") < page.index("</body>")
    assert 'id="feed-status"' in render_page("dashboard.html", "m", True)
    assert 'id="feed-status"' not in render_page("chat.html", "m", True)


def test_feed_wants_the_key(server):
    response = requests.get(server.url + "/dashboard/events", timeout=10)
    assert response.status_code == 401
    assert "API key" in response.json()["error"]["message"]
    wrong = requests.get(server.url + "/dashboard/events", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401


def test_feed_counts_running_requests_and_their_steps_then_falls_back_to_idle(server):
    with requests.get(server.url + "/dashboard/events", headers=auth(), stream=True, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines(decode_unicode=True)
        first = read_events(lines, 1)[0]
        assert first["totals"]["num_running"] == 0 and first["engines"][0]["steps"] == []
        body = {"prompt": "hello", "max_tokens": 60, "temperature": 0}
        threads = [threading.Thread(target=requests.post, args=(server.url + "/v1/completions",),
                                    kwargs={"json": body, "headers": auth(), "timeout": 60}) for _ in range(3)]
        for thread in threads:
            thread.start()
        busy = read_events(lines, 8)
        for thread in threads:
            thread.join()
        assert max(e["totals"]["num_running"] for e in busy) == 3
        assert max(e["generation_tokens_per_s"] for e in busy) > 0
        columns = [column for e in busy for column in e["engines"][0]["steps"]]
        assert len(columns) >= 10
        assert max(prefill + decode for prefill, decode in columns) == 3
        assert any(decode == 3 for _, decode in columns)  # all three decoding in one step
        # The rates look back two seconds; after that, everything reads idle again.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            idle = read_events(lines, 1)[0]
            if idle["generation_tokens_per_s"] == 0 and idle["prompt_tokens_per_s"] == 0:
                break
        assert idle["totals"]["num_running"] == 0 and idle["num_in_flight"] == 0
        assert idle["generation_tokens_per_s"] == 0 and idle["engines"][0]["steps"] == []


def test_feed_snapshots_are_a_few_a_second(server):
    with requests.get(server.url + "/dashboard/events", headers=auth(), stream=True, timeout=10) as response:
        start = time.monotonic()
        read_events(response.iter_lines(decode_unicode=True), 5)
        elapsed = time.monotonic() - start
    assert 0.7 < elapsed < 3.0  # four a second: five take about a second
