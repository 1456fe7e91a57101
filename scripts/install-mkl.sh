#!/usr/bin/env bash
# Install Intel MKL's runtime (the BLAS actguide opens at run time for its
# CPU matrix products, src/model/ops/blas.rs) from PyPI's `mkl` wheel.
#
#   scripts/install-mkl.sh        # prints the library's path
#
# The libraries land in .mkl/lib/ (or $ACTGUIDE_MKL_DIR/lib), where a binary
# built from this tree looks first; elsewhere point ACTGUIDE_BLAS at
# libmkl_rt.so.3. Only the single-threaded runtime and the CPU-specific
# kernels are kept (~440 MB of the wheel's 720). Pinned to one release,
# sha256-checked; nothing but the package registry is contacted. Without it
# actguide runs on candle's pure-Rust gemm.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${ACTGUIDE_MKL_DIR:-$here/.mkl}"
ver=2026.2.1
lib="$dir/lib/libmkl_rt.so.3"
if [ -f "$lib" ]; then
    echo "$lib"
    exit 0
fi
mkdir -p "$dir/lib"
python3 - "$ver" "$dir" <<'PY'
import hashlib, json, os, sys, urllib.request, zipfile
ver, out = sys.argv[1], sys.argv[2]
name = f"mkl-{ver}-py2.py3-none-manylinux_2_28_x86_64.whl"
req = urllib.request.Request(
    "https://pypi.org/simple/mkl/",
    headers={"Accept": "application/vnd.pypi.simple.v1+json"},
)
with urllib.request.urlopen(req, timeout=60) as r:
    f = [f for f in json.load(r)["files"] if f["filename"] == name][0]
whl = os.path.join(out, name)
urllib.request.urlretrieve(f["url"], whl + ".part")
h = hashlib.sha256()
with open(whl + ".part", "rb") as fh:
    for chunk in iter(lambda: fh.read(1 << 20), b""):
        h.update(chunk)
if h.hexdigest() != f["hashes"]["sha256"]:
    sys.exit(f"sha256 mismatch for {name}")
keep = ["rt", "core", "sequential", "intel_lp64", "def", "mc3", "avx2", "avx512", "avx10"]
with zipfile.ZipFile(whl + ".part") as z:
    for k in keep:
        member = f"mkl-{ver}.data/data/lib/libmkl_{k}.so.3"
        with z.open(member) as src, open(os.path.join(out, "lib", f"libmkl_{k}.so.3"), "wb") as dst:
            dst.write(src.read())
os.remove(whl + ".part")
PY
echo "$lib"
