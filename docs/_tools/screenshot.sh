#!/usr/bin/env bash
# Screenshots of the built site in headless Chromium, the way a reader sees it:
#   docs/_tools/screenshot.sh [SITE_DIR] [OUT_DIR]
# SITE_DIR defaults to build/docs/html (built by .ci/docs), OUT_DIR to build/docs/screenshots. Takes the front
# page and one API page (BaguaStrategy) at 1280x1000, and prints the PNGs' paths. Needs Debian's chromium
# (`apt-get install -y chromium`); tests/docs/test_docs_build.py takes the same screenshots and skips without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=$(realpath "${1:-build/docs/html}")
OUT=${2:-build/docs/screenshots}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROMIUM" ]; then
  echo "screenshot.sh: no chromium on PATH; install it with: apt-get install -y chromium" >&2
  exit 2
fi
if [ ! -f "$SITE/index.html" ]; then
  echo "screenshot.sh: $SITE/index.html does not exist; build the site first with .ci/docs" >&2
  exit 2
fi
PROFILE=$(mktemp -d)
trap 'rm -rf "$PROFILE"' EXIT
for page in index.html api/strategy.html api/torch_api/algorithms.html; do
  png="$OUT/$(echo "${page%.html}" | tr / _).png"
  # --no-sandbox: root in a container has no user namespace for Chromium's sandbox; the pages are our own files.
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$PROFILE" \
    --window-size=1280,1000 --screenshot="$png" "file://$SITE/$page" >/dev/null 2>&1
  echo "$png"
done
