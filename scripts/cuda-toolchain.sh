#!/usr/bin/env bash
# The CUDA compiler and headers for `cargo build --features cuda`, from
# PyPI wheels (no GPU and no system CUDA needed to build: candle's CUDA
# backend opens the driver, cuBLAS, cuRAND and NCCL at run time; see
# vendor/README.md).
#
#   eval "$(scripts/cuda-toolchain.sh)"     # installs once, prints exports
#   cargo build --release --features cuda
#
# Installs into .cuda-toolchain/ (or $ACTGUIDE_CUDA_DIR) a venv with CUDA
# 13.0's nvcc, nvvm, crt, runtime headers and CCCL, pinned together (nvcc
# emits PTX its own ptxas must accept; a newer nvvm or crt does not fit).
# 13.0 because candle's kernels ship as PTX that the driver compiles at
# load time: a driver accepts PTX only from a CUDA no newer than its own,
# and 13.4's was refused (CUDA_ERROR_UNSUPPORTED_PTX_VERSION) by an H200
# with driver 580 (CUDA 13.0). ACTGUIDE_CUDA_VERSION (and
# ACTGUIDE_CCCL_VERSION) pick another. It prints the environment cargo
# needs: PATH with nvcc, CUDA_ROOT /
# CUDA_PATH / CUDA_HOME for cudarc and candle-kernels, and
# CUDA_COMPUTE_CAP (default 90 = H100/H200; candle-kernels would otherwise
# ask nvidia-smi). cudarc 0.19 knows CUDA up to 13.4.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${ACTGUIDE_CUDA_DIR:-$here/.cuda-toolchain}"
ver="${ACTGUIDE_CUDA_VERSION:-13.0.88}"
if [ ! -x "$dir/venv/bin/python" ]; then
    python3 -m venv "$dir/venv" >&2
fi
if ! "$dir/venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-nvcc') == '$ver'" 2>/dev/null; then
    "$dir/venv/bin/pip" install -q --disable-pip-version-check \
        "nvidia-cuda-nvcc==$ver" "nvidia-nvvm==$ver" "nvidia-cuda-crt==$ver" \
        "nvidia-cuda-runtime==$ver" "nvidia-cuda-cccl==${ACTGUIDE_CCCL_VERSION:-13.0.85}" >&2
fi
root="$("$dir/venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
if [ ! -x "$root/bin/nvcc" ]; then
    echo "no nvcc under $root" >&2
    exit 1
fi
# The wheel ships only libcudart.so.13; linking (candle-kernels' static
# kernels ask for -lcudart) needs the unversioned name. The other CUDA
# libraries are opened at run time (vendor/README.md), not linked.
if [ ! -e "$root/lib/libcudart.so" ]; then
    ln -s libcudart.so.13 "$root/lib/libcudart.so"
fi
# CCCL's headers (cuda/std, cub, thrust) live in include/cccl.
echo "export PATH=\"$root/bin:\$PATH\""
echo "export CUDA_ROOT=\"$root\" CUDA_PATH=\"$root\" CUDA_HOME=\"$root\""
echo "export CPATH=\"$root/include:$root/include/cccl\${CPATH:+:\$CPATH}\""
echo "export LIBRARY_PATH=\"$root/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
