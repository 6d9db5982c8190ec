"""The chat page and the dashboard in a real browser: headless Chromium (Debian's) driven by selenium.

The chat and dashboard tests run the real server on the default model, as a user
would after `make serve`; the API-key flow runs on the fake core (scripts/lib/fake_engine.py),
since what it checks is the page's handling of the key, not the model. Without
Chromium the tests skip, except under CI, where `make test` installs it
(scripts/install_chromium.sh) and a missing browser is a failure.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests

from scripts.lib.fake_engine import FrontendServer
from scripts.lib.headless_browser import HeadlessChromium, missing_browser_reason
from tests.helpers.server import fake_core, metric, wait_for

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--max-num-seqs", "64")
KEY = "browser-test-key"


@pytest.fixture(scope="module")
def browser():
    reason = missing_browser_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"no browser under CI: {reason}")
        pytest.skip(reason)
    with HeadlessChromium() as chromium:
        yield chromium


def element(browser, element_id: str):
    from selenium.webdriver.common.by import By

    return browser.driver.find_element(By.ID, element_id)


def set_field(browser, element_id: str, value: str) -> None:
    field = element(browser, element_id)
    field.clear()
    field.send_keys(value)


def watch_answers(browser) -> None:
    """Record, in the page, every length the latest answer's text goes through (streaming shows several)."""
    browser.driver.execute_script("""
        window.answerLengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .text');
            if (answers.length) window.answerLengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)


def last_answer(browser) -> tuple[str, str | None]:
    """The latest answer's text and its finish (None while it streams)."""
    return browser.driver.execute_script("""
        const answers = document.querySelectorAll('.message.assistant');
        if (!answers.length) return ['', null];
        const answer = answers[answers.length - 1];
        return [answer.querySelector('.text').textContent, answer.dataset.finish === undefined ? null : answer.dataset.finish];
    """)


def ask(browser, question: str, temperature: str = "0", max_tokens: str = "64") -> None:
    set_field(browser, "temperature", temperature)
    set_field(browser, "max-tokens", max_tokens)
    set_field(browser, "prompt", question)
    element(browser, "send").click()


def test_chat_page_loads_without_console_errors(browser, server):
    browser.driver.get(server.url + "/")
    assert browser.driver.title == "tokenloom chat"
    assert element(browser, "model-name").text == "smollm2"
    assert not element(browser, "key-form").is_displayed()  # no --api-key: no key asked for
    time.sleep(0.5)  # let any late script error show
    assert browser.console_errors() == []


def test_question_gets_a_streamed_answer_with_paris(browser, server):
    browser.driver.get(server.url + "/")
    watch_answers(browser)
    ask(browser, "What is the capital of France?")
    text, finish = wait_for(lambda: (a := last_answer(browser))[1] is not None and a, what="the answer")
    assert "Paris" in text and finish == "stop"
    lengths = browser.driver.execute_script("return window.answerLengths")
    assert len({n for n in lengths if 0 < n < len(text)}) >= 2, lengths  # it grew piece by piece
    assert "tokens/s" in element(browser, "status").text
    # The conversation stays in the page: a second turn sees the first.
    ask(browser, "Repeat the name of that city, one word.")
    text, finish = wait_for(lambda: (a := last_answer(browser))[1] is not None and a, what="the second answer")
    assert "Paris" in text
    assert len(browser.driver.find_elements("css selector", ".message.user")) == 2
    assert browser.console_errors() == []


def test_stop_button_ends_a_long_answer_early(browser, server):
    browser.driver.get(server.url + "/")
    num_aborted = metric(server.url, "requests_finished_total", 'finish_reason="abort"')
    ask(browser, "Write a very long story about a dragon who learns to bake bread.", max_tokens="1000")
    wait_for(lambda: len(last_answer(browser)[0]) > 40, what="the story's first words")
    assert element(browser, "stop").is_enabled()
    element(browser, "stop").click()
    text, finish = wait_for(lambda: (a := last_answer(browser))[1] is not None and a, timeout_s=5, what="the stop")
    assert finish == "stopped"
    time.sleep(1.0)
    assert last_answer(browser)[0] == text  # nothing more arrives
    assert len(text) < 1500  # far from 1000 tokens
    assert element(browser, "send").is_enabled() and not element(browser, "stop").is_enabled()
    # The server saw the browser hang up and aborted the request in the core.
    wait_for(lambda: metric(server.url, "requests_finished_total", 'finish_reason="abort"') > num_aborted,
             timeout_s=10, what="the abort")
    assert browser.console_errors() == []


def dashboard_counters(browser) -> dict[str, int]:
    ids = ("num-running", "num-waiting", "kv-used", "tokens-in", "tokens-out")
    return browser.driver.execute_script(
        "return Object.fromEntries(arguments[0].map(id => [id, parseInt(document.getElementById(id).textContent, 10)]))",
        list(ids))


def painted_cells(browser, canvas_id: str = "strip-0") -> int:
    """Pixels an occupancy strip (the dashboard's engine 0 by default) has painted."""
    return browser.driver.execute_script("""
        const canvas = document.getElementById(arguments[0]);
        if (!canvas) return 0;
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 3; i < data.length; i += 4) if (data[i]) n++;
        return n;
    """, canvas_id)


def test_dashboard_counters_move_under_load_and_return_to_zero(browser, server):
    browser.driver.get(server.url + "/dashboard")
    wait_for(lambda: element(browser, "feed-status").text == "live", timeout_s=10, what="the feed")
    body = {"messages": [{"role": "user", "content": "Count from one to twenty in words."}],
            "max_tokens": 48, "temperature": 0}
    threads = [threading.Thread(target=requests.post, args=(server.url + "/v1/chat/completions",),
                                kwargs={"json": body, "timeout": 120}) for _ in range(6)]
    for thread in threads:
        thread.start()
    busiest = wait_for(lambda: (c := dashboard_counters(browser))["num-running"] > 0 and c["tokens-out"] > 0 and c,
                       timeout_s=60, interval_s=0.05, what="requests on the dashboard")
    assert busiest["kv-used"] > 0
    for thread in threads:
        thread.join()
    assert painted_cells(browser) > 0
    idle = wait_for(lambda: (c := dashboard_counters(browser))["tokens-out"] == 0 and c["tokens-in"] == 0 and c,
                    timeout_s=10, what="the dashboard going idle")
    assert idle == {"num-running": 0, "num-waiting": 0, "kv-used": 0, "tokens-in": 0, "tokens-out": 0}
    assert browser.console_errors() == []


@pytest.fixture(scope="module")
def keyed_server(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01"), "--api-key", KEY) as s:
        yield s


def test_pages_behind_an_api_key_ask_for_it_and_send_it(browser, keyed_server):
    browser.driver.get(keyed_server.url + "/")
    browser.driver.execute_script("localStorage.clear()")
    browser.driver.get(keyed_server.url + "/")
    assert element(browser, "key-form").is_displayed()  # asked before any call could get a 401
    set_field(browser, "api-key", KEY)
    element(browser, "key-save").click()
    assert not element(browser, "key-form").is_displayed()
    ask(browser, "hello", max_tokens="8")
    text, finish = wait_for(lambda: (a := last_answer(browser))[1] is not None and a, what="the answer")
    assert text and finish == "length"
    # The dashboard on the same origin finds the saved key and its feed accepts it.
    browser.driver.get(keyed_server.url + "/dashboard")
    assert not element(browser, "key-form").is_displayed()
    wait_for(lambda: element(browser, "feed-status").text == "live", timeout_s=10, what="the keyed feed")
    assert browser.console_errors() == []
    # A wrong key: the page says so and asks again.
    browser.driver.execute_script("localStorage.setItem('tokenloom-api-key', 'wrong')")
    browser.driver.get(keyed_server.url + "/")
    ask(browser, "hello", max_tokens="8")
    wait_for(lambda: element(browser, "key-form").is_displayed(), timeout_s=10, what="the key form")
    assert "401" in element(browser, "status").text
    browser.console_errors()  # Chromium logs that 401 itself; drop it so no later test sees it


def test_offline_live_view_draws_a_strip_per_mode(browser, tmp_path):
    from tests.tools.test_live_view import MODES, connect, start_live_run

    thread, url, _, errors = start_live_run(tmp_path, linger_s=20)
    connect(url, errors).close()
    browser.driver.get(url)
    wait_for(lambda: element(browser, "feed-status").text == "run finished", timeout_s=120, what="the run's end")
    assert not errors, errors
    for mode in MODES:
        assert painted_cells(browser, f"strip-{mode}") > 0
        label = browser.driver.execute_script(
            "return document.getElementById(arguments[0]).previousElementSibling.textContent", f"strip-{mode}")
        assert label.startswith(f"{mode}: done,") and "tokens/s" in label
    assert browser.console_errors() == []
