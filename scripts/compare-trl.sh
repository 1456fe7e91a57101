#!/usr/bin/env bash
# Seconds per single-turn GRPO step, actguide against TRL's GRPOTrainer, back
# to back on the same model, prompts, lengths, LoRA and threads: prints the
# table of docs/THROUGHPUT.md#against-trl, with ratios.
#
#   scripts/compare-trl.sh [MODEL] [--steps 3] [--threads 2]
#
# MODEL defaults to SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh).
# Sets up, once: the venv of scripts/compare-hf.sh plus TRL, PEFT and
# datasets from PyPI, MKL's runtime and the release build. Then runs, one
# after the other: TRL in f32 and with bf16=True (scripts/bench_trl.py,
# which also writes the prompts' token ids), actguide in f32 (`--f32`) and on
# the path it picks by itself (`dev bench-grpo`). Workload: 8 prompts × 8
# completions × 32 new tokens, LoRA r8 on every projection, AdamW, one
# update per step. JSON lands in runs/compare-trl/. Run it on a quiet machine.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
model="models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then model="$1"; shift; fi
steps=3
threads="${RAYON_NUM_THREADS:-2}"
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) steps="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -f "$model" ] || [ -d "$model" ] || { echo "no model at $model (scripts/fetch-smollm2.sh)" >&2; exit 1; }
venv="${ACTGUIDE_HF_VENV:-$here/.hf-venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, transformers, gguf, accelerate, trl, peft, datasets" 2>/dev/null; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check \
        torch==2.15.0 transformers==5.24.0 accelerate gguf numpy safetensors tokenizers \
        trl peft datasets >&2
fi
scripts/install-mkl.sh >&2
cargo build --release -q
out="runs/compare-trl"
mkdir -p "$out"
export RAYON_NUM_THREADS="$threads"
echo "TRL f32 ..." >&2
"$venv/bin/python" scripts/bench_trl.py "$model" --prompt-ids "$out/prompts.json" --steps "$steps" --threads "$threads" --json > "$out/trl.json"
echo "TRL bf16 ..." >&2
"$venv/bin/python" scripts/bench_trl.py "$model" --prompt-ids "$out/prompts.json" --steps "$steps" --threads "$threads" --bf16 --json > "$out/trl-bf16.json"
echo "actguide f32 ..." >&2
target/release/actguide dev bench-grpo "$model" --prompt-file "$out/prompts.json" --steps "$steps" --f32 --json > "$out/actguide-f32.json"
echo "actguide default path ..." >&2
target/release/actguide dev bench-grpo "$model" --prompt-file "$out/prompts.json" --steps "$steps" --json > "$out/actguide-default.json"
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, sys
out = sys.argv[1]
sides = [(n, json.load(open(f"{out}/{f}.json"))) for n, f in
         [("TRL f32", "trl"), ("TRL bf16", "trl-bf16"), ("actguide f32", "actguide-f32"), ("actguide default", "actguide-default")]]
for n, r in sides:
    print(f"- {n}: {r['implementation']}")
print(f"- CPU and kernels: {sides[3][1]['kernels']}")
r0 = sides[0][1]
print(f"- {r0['prompts']} prompts × {r0['group']} completions × {r0['new_tokens']} new tokens; prompt tokens {r0['prompt_tokens']}; "
      f"trainable parameters TRL {r0['trainable_params']}, actguide {sides[2][1]['trainable_params']}; threads {r0['threads']}; "
      f"fastest of {len(r0['steps'])} steps after a warm-up\n")
print("| side | s/step | generate s | update s | step ×TRL f32 | step ×TRL bf16 |")
print("|---|---:|---:|---:|---:|---:|")
t32, tbf = sides[0][1]["fastest"]["step_s"], sides[1][1]["fastest"]["step_s"]
for n, r in sides:
    f = r["fastest"]
    print(f"| {n} | {f['step_s']:.2f} | {f['generate_s']:.2f} | {f['update_s']:.2f} | {t32 / f['step_s']:.2f}× | {tbf / f['step_s']:.2f}× |")
PY
