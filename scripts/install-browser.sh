#!/usr/bin/env bash
# Installs what tests/e2e/test_browser.py drives: Debian's chromium (a no-op when /usr/bin/chromium exists).
# Why Debian's and not `playwright install`: that downloads a browser build from outside the package registries,
# which fails on closed networks (CI here); Playwright (PyPI, the `dev` extra) drives any recent Chromium through
# executable_path instead. Needs root (CI runs as root); elsewhere it stops and prints the sudo command, so that
# `make test` never skips the browser test silently.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "[install-browser] $(/usr/bin/chromium --version 2>/dev/null | head -1)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[install-browser] the browser test needs Debian's chromium: run  sudo bash scripts/install-browser.sh  then make test" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
echo "[install-browser] installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
