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
        # The source package alone, named by the registry's JSON API (pip
        # would prepare it with its build backend, which builds the Python
        # bindings too).
        url="$("$dir/venv/bin/python" - "$ver" <<'EOF'
import json, sys, urllib.parse, urllib.request
base = "https://pypi.org/pypi/llama-cpp-python/" + sys.argv[1] + "/json"
with urllib.request.urlopen(base, timeout=60) as r:
    meta = json.load(r)
sd = [u for u in meta["urls"] if u["packagetype"] == "sdist"][0]
print(urllib.parse.urljoin(base, sd["url"]))
EOF
)"
        "$dir/venv/bin/python" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tarball"
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
