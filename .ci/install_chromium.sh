#!/usr/bin/env bash
# Install Debian's headless Chromium (+ chromedriver) for tests/tuner/test_dashboard_browser.py.
# Never fails the build: without a browser that one test skips with a message saying why.
set -u

have_browser() {
    command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
        || command -v google-chrome >/dev/null 2>&1 || command -v google-chrome-stable >/dev/null 2>&1
}

if have_browser; then
    echo "install_chromium: a Chromium is already installed ($(command -v chromium chromium-browser google-chrome google-chrome-stable 2>/dev/null | head -1)); nothing to do."
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get on this machine; not installing Chromium (the browser test will skip)."
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_chromium: not root and no password-less sudo; not installing Chromium (the browser test will skip)."
        exit 0
    fi
fi

echo "install_chromium: apt-get install chromium chromium-driver ..."
if $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/tmp/install_chromium.log 2>&1 \
    && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >>/tmp/install_chromium.log 2>&1; then
    echo "install_chromium: installed $(chromium --version 2>/dev/null || echo chromium)."
else
    echo "install_chromium: apt-get failed (log: /tmp/install_chromium.log); the browser test will skip."
fi
exit 0
