#!/usr/bin/env bash
# Installs what tests/e2e/test_browser.py drives: Debian's chromium (a no-op when /usr/bin/chromium exists).
# Why Debian's and not `playwright install`: that downloads a browser build from outside the package registries,
# which fails on closed networks (CI here); Playwright (PyPI, the `dev` extra) drives any recent Chromium through
# executable_path instead. Needs root (CI runs as root); elsewhere run it with sudo.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "[install-browser] $(/usr/bin/chromium --version 2>/dev/null | head -1)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
echo "[install-browser] installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
