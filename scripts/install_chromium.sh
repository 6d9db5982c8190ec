#!/bin/sh
# Chromium and chromedriver from Debian's packages, for the browser tests (tests/server/test_browser.py)
# and the screenshots of docs/web-pages.md. Idempotent: does nothing when both are there. Elsewhere (no
# apt-get, no root and no sudo) it says so and goes on: the browser tests then skip, except
# under CI, where a missing browser fails them.
set -eu
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get here; install chromium and chromedriver yourself for the browser tests" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install_chromium: not root; run 'apt-get install -y chromium chromium-driver' as root for the browser tests" >&2
    exit 0
fi
# An update first only when the package lists do not know chromium yet (a fresh container).
if ! apt-cache show chromium-driver >/dev/null 2>&1; then
    $SUDO apt-get update -q
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
