#!/usr/bin/env bash
# Build llama.cpp's HTTP server (`llama-server`, CPU only) from the source
# that PyPI's `llama-cpp-python` sdist vendors: the rollout engine the
# engine tests and examples/engine_llamacpp.rhai drive.
#
#   scripts/build-llama-server.sh            # prints the server's path
#
# Everything lands in .llama-server/ (or $ACTGUIDE_LLAMA_DIR): the sdist,
# cmake from PyPI in a venv, the build tree and bin/llama-server. A second
# call only prints the path. Pinned to one release, whose API the client in
# src/engine/ was written against. Needs a C/C++ compiler and the package
# registry (nothing else is downloaded).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${ACTGUIDE_LLAMA_DIR:-$here/.llama-server}"
ver=0.3.36
bin="$dir/bin/llama-server"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
mkdir -p "$dir"
if [ ! -x "$dir/venv/bin/cmake" ]; then
    python3 -m venv "$dir/venv" >&2
    "$dir/venv/bin/pip" install -q --disable-pip-version-check cmake >&2
fi
src="$dir/llama_cpp_python-$ver"
if [ ! -d "$src/vendor/llama.cpp" ]; then
    tarball="$dir/llama_cpp_python-$ver.tar.gz"
    if [ ! -f "$tarball" ]; then
        # The source package alone, from the registry's simple index (PEP
        # 691, what pip reads), checked against its sha256. (`pip download`
        # would prepare it with its build backend first.)
        "$dir/venv/bin/python" - "$ver" "$tarball" <<'EOF'
import hashlib, json, sys, urllib.request
ver, out = sys.argv[1], sys.argv[2]
req = urllib.request.Request(
    "https://pypi.org/simple/llama-cpp-python/",
    headers={"Accept": "application/vnd.pypi.simple.v1+json"},
)
with urllib.request.urlopen(req, timeout=60) as r:
    files = json.load(r)["files"]
f = [f for f in files if f["filename"] == f"llama_cpp_python-{ver}.tar.gz"][0]
urllib.request.urlretrieve(f["url"], out + ".part")
digest = hashlib.sha256(open(out + ".part", "rb").read()).hexdigest()
if digest != f["hashes"]["sha256"]:
    sys.exit(f"sha256 mismatch for {f['filename']}")
import os; os.replace(out + ".part", out)
EOF
    fi
    tar -xzf "$tarball" -C "$dir"
fi
start=$(date +%s)
"$dir/venv/bin/cmake" -S "$src/vendor/llama.cpp" -B "$dir/build" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
"$dir/venv/bin/cmake" --build "$dir/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$dir/bin"
cp "$dir/build/bin/llama-server" "$bin"
echo "built llama-server in $(( $(date +%s) - start )) s" >&2
echo "$bin"
