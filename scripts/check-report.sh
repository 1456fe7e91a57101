#!/usr/bin/env bash
# Render an `actguide report` page in headless Chromium and fail if the
# browser reports any problem or the page lacks its figures or table.
#
#   scripts/check-report.sh REPORT_HTML [SCREENSHOT_PNG]
#
# Fails (exit 1) when Chromium logs a console message (the page runs no
# script, so any message is a script error, a CSP violation or a failed
# load), an uncaught exception or a failed resource; or when the rendered
# DOM has fewer <svg> elements than the page's `actguide-figures` meta tag
# announces (override with EXPECT_SVGS=N) or no summary table. Exit 2:
# usage or no Chromium. Set CHROMIUM to pick the binary.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 REPORT_HTML [SCREENSHOT_PNG]" >&2
  exit 2
fi
html=$1
png=${2:-}
[[ -f "$html" ]] || { echo "check-report: no such file: $html" >&2; exit 2; }

chrome=${CHROMIUM:-}
if [[ -z "$chrome" ]]; then
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null; then chrome=$(command -v "$c"); break; fi
  done
fi
[[ -n "$chrome" ]] || { echo "check-report: no chromium on PATH (apt-get install chromium)" >&2; exit 2; }

url="file://$(realpath "$html")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A fresh profile per run: no first-run state, no leftovers between checks.
flags=(--headless --no-sandbox --disable-gpu --enable-logging=stderr --v=0
       --no-first-run --no-default-browser-check --disable-extensions
       --disable-background-networking --user-data-dir="$tmp/profile")

status=0
timeout 120 "$chrome" "${flags[@]}" --dump-dom "$url" >"$tmp/dom.html" 2>"$tmp/dom.log" || status=$?
if [[ $status -ne 0 ]]; then
  echo "check-report: chromium --dump-dom exited $status" >&2
  cat "$tmp/dom.log" >&2
  exit 1
fi
logs=("$tmp/dom.log")
if [[ -n "$png" ]]; then
  mkdir -p "$(dirname "$png")"
  rm -f "$png"
  timeout 120 "$chrome" "${flags[@]}" --hide-scrollbars --window-size=1400,3000 \
    --screenshot="$(realpath -m "$png")" "$url" >"$tmp/shot.out" 2>"$tmp/shot.log" || status=$?
  if [[ $status -ne 0 || ! -s "$png" ]]; then
    echo "check-report: screenshot failed (exit $status)" >&2
    cat "$tmp/shot.log" >&2
    exit 1
  fi
  logs+=("$tmp/shot.log")
fi

fail=0
# Chromium's own start-up noise (D-Bus, GPU probing) is not about the page;
# these patterns only match what the page caused.
if grep -hE 'CONSOLE|Uncaught|Failed to load resource|net::ERR_|Refused to (load|apply|execute|connect)|Content Security Policy' "${logs[@]}" >"$tmp/errors"; then
  echo "check-report: the browser reported problems with the page:" >&2
  cat "$tmp/errors" >&2
  fail=1
fi

# Headless Chromium does not log every failed load (a missing local image
# passes silently), so also refuse any reference to an outside resource in
# the rendered DOM: the page must be self-contained.
if grep -oiE '<(link|iframe|object|embed)[ >]|<script[^>]* src=|<(img|image|source|video|audio|use)[^>]* (src|href|xlink:href)="[^#"][^"]*"|@import[^;]*|url\([^#)][^)]*\)' "$tmp/dom.html" >"$tmp/refs"; then
  echo "check-report: the page references outside resources:" >&2
  sort -u "$tmp/refs" >&2
  fail=1
fi

expect=${EXPECT_SVGS:-$(grep -o '<meta name="actguide-figures" content="[0-9]*"' "$html" | grep -o '[0-9]*' || true)}
if [[ -z "$expect" ]]; then
  echo "check-report: no actguide-figures meta tag and no EXPECT_SVGS" >&2
  fail=1
fi
svgs=$(grep -o '<svg' "$tmp/dom.html" | wc -l)
if [[ -n "$expect" && "$svgs" -lt "$expect" ]]; then
  echo "check-report: rendered DOM has $svgs <svg> elements, expected $expect" >&2
  fail=1
fi
if ! grep -q '<table class="summary"' "$tmp/dom.html"; then
  echo "check-report: rendered DOM has no summary table" >&2
  fail=1
fi
rows=$(grep -o '<tr>' "$tmp/dom.html" | wc -l)
if [[ "$rows" -lt 2 ]]; then
  echo "check-report: summary table has no run rows" >&2
  fail=1
fi

if [[ $fail -ne 0 ]]; then
  exit 1
fi
echo "check-report: ok: $svgs figures, $((rows - 1)) run rows${png:+, screenshot $png}"
