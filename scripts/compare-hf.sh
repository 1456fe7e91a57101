#!/usr/bin/env bash
# Back-to-back CPU throughput of actguide and HF transformers (PyTorch) on
# the same model, batches, lengths and threads: prints the throughput table
# of docs/THROUGHPUT.md, with ratios.
#
#   scripts/compare-hf.sh [MODEL] [--batches 1,8,32] [--threads 2]
#
# MODEL defaults to SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh).
# Sets up, once: a venv with torch + transformers from PyPI
# (.hf-venv/, or $ACTGUIDE_HF_VENV), MKL's runtime (scripts/install-mkl.sh)
# and the release build. Then runs, one after the other: HF
# (scripts/bench_transformers.py) in f32 and under bf16 autocast, actguide in
# f32 (`--f32`) and on the path it picks by itself on this CPU (no flag: bf16
# rollout weights and mixed-precision training where the CPU has AMX and MKL
# is loaded). JSON lands in runs/compare-hf/.
# Run it on a quiet machine: the three measurements share the CPU in turn.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
model="models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then model="$1"; shift; fi
batches="1,8,32"
threads="${RAYON_NUM_THREADS:-2}"
while [ $# -gt 0 ]; do
    case "$1" in
        --batches) batches="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -f "$model" ] || [ -d "$model" ] || { echo "no model at $model (scripts/fetch-smollm2.sh)" >&2; exit 1; }
venv="${ACTGUIDE_HF_VENV:-$here/.hf-venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, transformers, gguf, accelerate" 2>/dev/null; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check \
        torch==2.15.0 transformers==5.24.0 accelerate gguf numpy safetensors tokenizers >&2
fi
scripts/install-mkl.sh >&2
cargo build --release -q
out="runs/compare-hf"
mkdir -p "$out"
export RAYON_NUM_THREADS="$threads"
echo "HF transformers f32 ..." >&2
"$venv/bin/python" scripts/bench_transformers.py "$model" --batches "$batches" --threads "$threads" --json > "$out/hf.json"
echo "HF transformers bf16 autocast ..." >&2
"$venv/bin/python" scripts/bench_transformers.py "$model" --batches "$batches" --threads "$threads" --autocast --json > "$out/hf-autocast.json"
echo "actguide f32 ..." >&2
target/release/actguide dev bench-model "$model" --batches "$batches" --f32 --json > "$out/actguide-f32.json"
echo "actguide default path ..." >&2
target/release/actguide dev bench-model "$model" --batches "$batches" --json > "$out/actguide-default.json"
python3 scripts/compare_hf.py "$out/hf.json" "$out/hf-autocast.json" "$out/actguide-f32.json" "$out/actguide-default.json" | tee "$out/table.md"
