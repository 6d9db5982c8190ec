"""The screenshots of docs/web-pages.md: the chat page after a question, the dashboard during a load,
and `scripts/bench/offline.py --live` after a run, by headless Chromium.

    python -m scripts.web_screenshots [--out docs/images] [--num-requests 48] [--pages chat,live]

Starts the real server on the default model (as `make serve` does), asks the chat page
one question, then sends a burst of chat requests of mixed lengths and photographs the
dashboard while they run (`chat`: chat_page.png and dashboard.png). `live` runs the
offline benchmark's reference workload (cut to --live-requests, continuous at 16 sequences like the static batches) through continuous,
static and static-padded batching with --live, and photographs the page once the three
strips are full (live_view.png).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

import requests

from scripts.lib.fake_engine import FrontendServer
from scripts.lib.headless_browser import HeadlessChromium

REPO_ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger(__name__)


def wait_for_answer(driver, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if driver.execute_script("const a = document.querySelectorAll('.message.assistant');"
                                 "return a.length > 0 && a[a.length - 1].dataset.finish !== undefined"):
            return
        time.sleep(0.2)
    raise TimeoutError("no answer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "images")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--pages", default="chat,live", help="chat (the chat page and the dashboard), live, or both")
    parser.add_argument("--live-requests", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    pages = set(args.pages.split(","))
    if "live" in pages:
        take_live_screenshot(args)
    if "chat" not in pages:
        return
    from engine.loader.model_files import DEFAULT_MODEL, resolve_model

    server = FrontendServer(Path(resolve_model(DEFAULT_MODEL)), "--engine-command", f"{sys.executable} -m engine.loop.core_process",
                            "--max-num-seqs", "64", "--served-model-name", "smollm2")
    # start() rather than `with server`, whose __enter__ starts with the default 60 s wait;
    # `with server.start(...)` would start a second server and leave the first one running.
    server.start(timeout_s=300)
    try:
        take_screenshots(server, args)
    finally:
        server.stop()


def take_screenshots(server, args) -> None:
    with HeadlessChromium() as browser:
        driver = browser.driver
        driver.get(server.url + "/")
        driver.find_element("id", "temperature").clear()
        driver.find_element("id", "temperature").send_keys("0")
        driver.find_element("id", "prompt").send_keys("What is the capital of France?")
        driver.find_element("id", "send").click()
        wait_for_answer(driver)
        browser.screenshot(args.out / "chat_page.png")

        driver.get(server.url + "/dashboard")
        time.sleep(1.0)
        questions = ["Count from one to thirty in words.", "Tell me about the sea.", "Name five fruits.",
                     "Write a short poem about rain."]

        def post(i: int) -> None:
            time.sleep(0.05 * i)  # a staggered burst: requests join and leave the batch step by step
            body = {"messages": [{"role": "user", "content": questions[i % len(questions)]}],
                    "max_tokens": 32 + 24 * (i % 5), "temperature": 0}
            requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(args.num_requests)]
        for thread in threads:
            thread.start()
        time.sleep(6.0)
        browser.screenshot(args.out / "dashboard.png")
        for thread in threads:
            thread.join()


def take_live_screenshot(args) -> None:
    from scripts.bench import offline as bench_offline
    from scripts.lib.fake_engine import free_port

    port = free_port()
    # Continuous as wide as the static batches (16), so its strip shows the refilling.
    argv = ["--modes", "continuous,static,static-padded", "--num-requests", str(args.live_requests), "--max-num-seqs", "16",
            "--live", "--live-port", str(port), "--live-linger", "30"]
    run = threading.Thread(target=bench_offline.main, args=(argv,), daemon=True)
    run.start()
    url = f"http://127.0.0.1:{port}/live"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            requests.get(url, timeout=5)
            break
        except requests.ConnectionError:
            time.sleep(0.2)
    with HeadlessChromium(window_size=(1280, 820)) as browser:
        browser.driver.get(url)
        while browser.driver.find_element("id", "feed-status").text != "run finished":
            if time.monotonic() > deadline + 600:
                raise TimeoutError("the offline run did not finish")
            time.sleep(0.5)
        browser.screenshot(args.out / "live_view.png")
    run.join()


if __name__ == "__main__":
    main()
