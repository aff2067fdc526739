#!/usr/bin/env bash
# The browser the report and web-planner tests drive: Debian's or Ubuntu's Chromium (Playwright's own browser
# download is often unreachable, and a distribution build is what CI has). `make test` and `make screenshots` call
# this; it installs Chromium with apt-get when it is missing (through sudo when not root), says so, and fails with
# one line saying why when it cannot. TUNECAST_CHROMIUM names a binary to use instead.
set -uo pipefail

found() {
  if [ -n "${TUNECAST_CHROMIUM:-}" ]; then
    [ -x "$TUNECAST_CHROMIUM" ]
    return
  fi
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1
}

fail() {
  echo "ensure_chromium: $*" >&2
  exit 1
}

if found; then
  exit 0
fi
if [ -n "${TUNECAST_CHROMIUM:-}" ]; then
  fail "TUNECAST_CHROMIUM=$TUNECAST_CHROMIUM is not an executable file; point it at a Chromium binary or unset it"
fi
command -v apt-get >/dev/null 2>&1 \
  || fail "no Chromium for the browser tests and no apt-get to install it: install Chromium, or set TUNECAST_CHROMIUM to its binary, then rerun"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  fail "no Chromium for the browser tests, and installing it needs root: run 'apt-get install chromium' as root (or install sudo), then rerun"
fi
log=$(mktemp -t tunecast-chromium.XXXXXX.log)
echo "installing Chromium for the browser tests: ${SUDO[*]:+${SUDO[*]} }apt-get install chromium (log: $log)"
if ! { "${SUDO[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq chromium; } >"$log" 2>&1; then
  fail "apt-get could not install chromium ($(grep -E '^(E|W):' "$log" | tail -n 1 || true)); see $log"
fi
found || fail "apt-get installed the chromium package but no chromium binary is on PATH (an Ubuntu snap stub?); install Chromium or set TUNECAST_CHROMIUM, see $log"
echo "installed $(command -v chromium || command -v chromium-browser)"
