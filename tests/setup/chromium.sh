#!/usr/bin/env bash
# Debian's Chromium and its driver for tests/test_browser_ui.py; idempotent, quiet when already installed.
# Playwright drives /usr/bin/chromium directly and never downloads a browser of its own.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "tests/setup/chromium.sh: cannot install chromium (needs root and apt-get); the browser test will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
