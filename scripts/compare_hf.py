#!/usr/bin/env python3
"""The comparison table from scripts/compare-hf.sh's JSON files.

    python3 scripts/compare_hf.py HF_F32.json HF_AUTOCAST.json ACTGUIDE_F32.json ACTGUIDE_DEFAULT.json

Ratios are actguide / HF for throughput (decode and train tokens/s: higher
is better) and actguide / HF for prefill seconds (lower is better), against
HF in f32 unless the column says autocast. "default" is actguide with no
precision flag: the path it picks on this CPU (its kernel line says which).
Each figure is the fastest of the side's timed runs (both benchmarks report
it); the runs' spread is printed under the table.
"""
import json
import sys


def rows(path):
    r = json.load(open(path))
    return r, {row["batch"]: row for row in r["rows"]}


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    (hf, hfr), (amp, ampr), (f32, f32r), (dft, dftr) = (rows(p) for p in sys.argv[1:5])
    print(f"- HF f32: {hf['implementation']}")
    print(f"- HF autocast: {amp['implementation']}")
    print(f"- actguide f32: {f32['implementation']}")
    print(f"- actguide default: {dft['implementation']}")
    print(f"- CPU and kernels: {dft.get('kernels', '?')}")
    print(f"- threads {f32['threads']}; fastest of {f32['repeats']} runs each, after a warm-up; model {f32['model']}\n")
    print(
        "| batch | decode tok/s HF f32 | HF autocast | actguide f32 (×HF) | actguide default (×HF) "
        "| prefill s HF f32 | HF autocast | actguide f32 (×HF) | actguide default (×HF) "
        "| train tok/s HF f32 | HF autocast | actguide f32 (×HF) | actguide default (×HF f32, ×autocast) |"
    )
    print("|---:|" + "---:|" * 12)
    for b in sorted(hfr):
        h, m, a, d = hfr[b], ampr.get(b), f32r.get(b), dftr.get(b)
        if a is None or d is None or m is None:
            continue

        def tput(key, x):
            return f"{x[key]:.1f} ({x[key] / h[key]:.2f}×)"

        def secs(x):
            return f"{x['prefill_s']:.3f} ({x['prefill_s'] / h['prefill_s']:.2f}×)"

        line = (
            f"| {b} | {h['decode_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {tput('decode_tok_s', a)} | {tput('decode_tok_s', d)} "
            f"| {h['prefill_s']:.3f} | {m['prefill_s']:.3f} | {secs(a)} | {secs(d)} "
            f"| {h['train_tok_s']:.1f} | {m['train_tok_s']:.1f} | {tput('train_tok_s', a)} "
            f"| {d['train_tok_s']:.1f} ({d['train_tok_s'] / h['train_tok_s']:.2f}×, {d['train_tok_s'] / m['train_tok_s']:.2f}×) |"
        )
        print(line)
    spread = []
    for name, side in [("HF f32", hfr), ("HF autocast", ampr), ("actguide f32", f32r), ("actguide default", dftr)]:
        worst = max(
            (max(row[k]) / min(row[k]) for row in side.values() for k in ("prefill_s_runs", "generate_s_runs", "train_s_runs") if row.get(k)),
            default=1.0,
        )
        spread.append(f"{name} {100 * (worst - 1):.0f} %")
    print("\nlargest spread between a measurement's slowest and fastest run: " + ", ".join(spread))
    mm = ", ".join(f"{b}: {r['decode_logp_mismatch']:.4f}" for b, r in sorted(dftr.items()))
    print(f"\nactguide default, mean |Δlogp| of the decoded tokens against f32 scoring, by batch: {mm}")
    loss = ", ".join(
        f"{b}: {dftr[b]['train_loss']:.4f} vs {f32r[b]['train_loss']:.4f}" for b in sorted(dftr) if b in f32r
    )
    print(f"actguide train loss, default vs f32, by batch: {loss}")


if __name__ == "__main__":
    main()
