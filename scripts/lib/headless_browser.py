"""Headless Chromium driven by selenium, from Debian's packages: the browser tests and the screenshots of docs/web-pages.md.

`make setup` installs `chromium` and `chromium-driver` (scripts/install_chromium.sh);
nothing is downloaded at run time (selenium is given both paths, so its driver manager
never runs). The network here is closed, so Chromium starts with everything that would
reach out turned off; without those flags it stalls on start-up.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER_PATHS = ("/usr/bin/chromedriver",)
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",  # containers give /dev/shm 64 MB; Chromium then crashes on big pages
)
WINDOW_SIZE = (1280, 800)


def find_binary(candidates: tuple[str, ...]) -> str | None:
    return next((path for path in candidates if os.access(path, os.X_OK)), None)


def missing_browser_reason() -> str | None:
    """Why no browser test can run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements-cpu.txt)"
    if find_binary(CHROMIUM_PATHS) is None or find_binary(CHROMEDRIVER_PATHS) is None:
        return "chromium or chromedriver is missing (make setup installs them: scripts/install_chromium.sh)"
    return None


class HeadlessChromium:
    """A selenium Chrome driver on a fresh profile, with the page's console kept for the tests."""

    def __init__(self, window_size: tuple[int, int] = WINDOW_SIZE):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        reason = missing_browser_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.profile_dir = tempfile.mkdtemp(prefix="tokenloom-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = find_binary(CHROMIUM_PATHS)
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile_dir}")
        options.add_argument(f"--window-size={window_size[0]},{window_size[1]}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = Service(executable_path=find_binary(CHROMEDRIVER_PATHS))
        logger.info("starting %s (profile %s)", options.binary_location, self.profile_dir)
        self.driver = webdriver.Chrome(options=options, service=service)
        self.driver.set_page_load_timeout(30)

    def console_errors(self) -> list[str]:
        """The page's console errors since the last call (Chromium hands each entry out once)."""
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        logger.info("screenshot: %s", path)

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile_dir, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
