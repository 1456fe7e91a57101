#!/usr/bin/env python3
"""The comparison table from scripts/compare-hf.sh's JSON files.

    python3 scripts/compare_hf.py HF.json ACTGUIDE_F32.json [ACTGUIDE_BF16.json]

Ratios are actguide / HF for throughput (decode and train tokens/s: higher
is better) and actguide / HF for prefill seconds (lower is better). Each
figure is the fastest of the side's timed runs (both benchmarks report it);
the runs' spread is printed under the table.
"""
import json
import sys


def rows(path):
    r = json.load(open(path))
    return r, {row["batch"]: row for row in r["rows"]}


def main():
    hf, hfr = rows(sys.argv[1])
    f32, f32r = rows(sys.argv[2])
    bf = rows(sys.argv[3]) if len(sys.argv) > 3 else None
    print(f"- HF: {hf['implementation']}")
    print(f"- actguide: {f32['implementation']}")
    if bf:
        print(f"- actguide bf16: {bf[0]['implementation']}")
    print(f"- threads {f32['threads']}; fastest of {f32['repeats']} runs each, after a warm-up; model {f32['model']}\n")
    head = "| batch | decode tok/s HF | actguide f32 (×HF) |"
    sep = "|---:|---:|---:|"
    if bf:
        head += " bf16 rollout (×HF) |"
        sep += "---:|"
    head += " prefill s HF | actguide f32 (×HF) |"
    sep += "---:|---:|"
    if bf:
        head += " bf16 rollout (×HF) |"
        sep += "---:|"
    head += " train tok/s HF | actguide (×HF) |"
    sep += "---:|---:|"
    print(head)
    print(sep)
    for b in sorted(hfr):
        h, a = hfr[b], f32r.get(b)
        if a is None:
            continue
        c = bf[1].get(b) if bf else None
        line = f"| {b} | {h['decode_tok_s']:.1f} | {a['decode_tok_s']:.1f} ({a['decode_tok_s'] / h['decode_tok_s']:.2f}×) |"
        if bf:
            line += f" {c['decode_tok_s']:.1f} ({c['decode_tok_s'] / h['decode_tok_s']:.2f}×) |"
        line += f" {h['prefill_s']:.3f} | {a['prefill_s']:.3f} ({a['prefill_s'] / h['prefill_s']:.2f}×) |"
        if bf:
            line += f" {c['prefill_s']:.3f} ({c['prefill_s'] / h['prefill_s']:.2f}×) |"
        line += f" {h['train_tok_s']:.1f} | {a['train_tok_s']:.1f} ({a['train_tok_s'] / h['train_tok_s']:.2f}×) |"
        print(line)
    spread = []
    for name, side in [("HF", hfr), ("actguide f32", f32r)] + ([("bf16 rollout", bf[1])] if bf else []):
        worst = max(
            (max(row[k]) / min(row[k]) for row in side.values() for k in ("prefill_s_runs", "generate_s_runs", "train_s_runs") if row.get(k)),
            default=1.0,
        )
        spread.append(f"{name} {100 * (worst - 1):.0f} %")
    print("\nlargest spread between a measurement's slowest and fastest run: " + ", ".join(spread))
    if bf:
        mm = ", ".join(f"{b}: {r['decode_logp_mismatch']:.4f}" for b, r in sorted(bf[1].items()))
        print(f"\nbf16 rollout weights, mean |Δlogp| of the decoded tokens against f32 scoring, by batch: {mm}")


if __name__ == "__main__":
    main()
