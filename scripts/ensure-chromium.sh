#!/usr/bin/env bash
# The browser tests drive the system's Chromium (Playwright's own browser download is not
# used). Installs Debian's chromium when running as root with apt-get; otherwise says how.
set -euo pipefail
if [ -n "${CHROMIUM:-}" ] && [ -x "$CHROMIUM" ]; then exit 0; fi
for candidate in chromium chromium-browser google-chrome; do
  if command -v "$candidate" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> installing chromium for the browser tests"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
  exit 0
fi
echo "error: the browser tests need Chromium: install it (Debian: apt-get install chromium)" \
     "or set CHROMIUM=/path/to/chromium" >&2
exit 1
