#!/usr/bin/env python3
"""The `actguide dev bench-model` measurement with HF transformers (PyTorch, CPU).

    .hf-venv/bin/python scripts/bench_transformers.py \\
        models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --batches 1,8,32 --prompt-len 64 --new-tokens 32 --train-len 128 [--json]

(scripts/compare-hf.sh sets up the venv — torch, transformers, accelerate,
gguf from PyPI — and runs this beside `actguide dev bench-model`.)

MODEL is a .gguf file (transformers dequantises it to float32 through the
`gguf` package) or a HF model folder. Everything runs in float32 on the CPU
with `--attn` attention (default "sdpa"; "eager" also works) and
`torch.set_num_threads(--threads)`, where --threads defaults to
RAYON_NUM_THREADS (the variable that sets actguide's thread count), else the
number of CPUs.

Per batch size B, on random token ids (ids in lo..vocab-1, lo = one past the
config's largest bos/eos/pad id when that is below vocab/2 — the same rule as
actguide; the ids themselves differ, the lengths are the same):
- decode: `model.generate(ids, attention_mask, max_new_tokens=N,
  min_new_tokens=N, do_sample=False, use_cache=True)`: greedy, eos masked
  for N tokens so every sequence decodes exactly N (actguide gets the same
  workload by passing an eos id that greedy decoding never picks).
  decode_tok_s = B*N / seconds of the whole call (prefill included);
  prefill_s is a max_new_tokens=1 call; decode_only_tok_s =
  B*(N-1) / (generate_s - prefill_s).
- train: forward on (B, L), log_softmax of the logits at positions 0..L-2
  gathered at the next tokens, loss = -mean, backward, torch.optim.AdamW step
  (lr 1e-6, no weight decay), zero_grad; train_tok_s = B*L / seconds
  (forward + backward + optimiser; optimizer_s is the step alone).

With --autocast, generate and the train step's forward run under
`torch.autocast("cpu", dtype=torch.bfloat16)`: PyTorch's CPU mixed precision
(bf16 matmuls through oneDNN, AMX where the CPU has it; f32 weights, loss and
optimiser), the peer of actguide's `model.mixed_precision`.

Each measurement runs once untimed (warm-up), then --repeats times; rows
hold the fastest run (as actguide's dev bench-model: other processes only add
time) and the JSON keeps the per-run times.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count() or 1),
    )
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument(
        "--autocast",
        action="store_true",
        help="run generate and the train step's forward under torch.autocast('cpu', bfloat16) "
        "(mixed precision: f32 weights and optimiser, bf16 matmuls)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.batches = [int(x) for x in a.batches.split(",") if x]
    if not a.batches or min(a.batches) < 1:
        ap.error("batch sizes must be >= 1")
    if a.prompt_len < 1 or a.new_tokens < 1 or a.train_len < 2 or a.repeats < 1:
        ap.error("need prompt-len >= 1, new-tokens >= 1, train-len >= 2, repeats >= 1")
    return a


def load(path, attn):
    kw = dict(dtype=torch.float32, attn_implementation=attn)
    if path.lower().endswith(".gguf"):
        d, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, **kw)
    return AutoModelForCausalLM.from_pretrained(path, **kw)


def token_range(cfg):
    vocab = cfg.vocab_size
    ids = [getattr(cfg, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    flat = []
    for i in ids:
        flat.extend(i if isinstance(i, (list, tuple)) else [i])
    flat = [i for i in flat if i is not None]
    top = max(flat) + 1 if flat else 0
    lo = top if top < vocab // 2 else 0
    return lo, max(vocab - 1, lo + 1)


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def main():
    a = parse()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    model = load(a.model, a.attn)
    load_s = time.perf_counter() - t0
    cfg = model.config
    lo, hi = token_range(cfg)
    # Whatever eos the generation config has, it is masked for N tokens.
    pad = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(a.seed)

    def amp():
        if a.autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def generate(ids, n):
        model.eval()
        with amp():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=pad,
            )
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def train_step(ids):
        model.train()
        with amp():
            logits = model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None]).mean()
        nll.backward()
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return nll.item(), time.perf_counter() - t

    rows = []
    for b in a.batches:
        prompts = torch.randint(lo, hi, (b, a.prompt_len), generator=gen)
        train_ids = torch.randint(lo, hi, (b, a.train_len), generator=gen)
        generate(prompts, a.new_tokens)
        prefill, gens, generated = [], [], 0
        for _ in range(a.repeats):
            t = time.perf_counter()
            generate(prompts, 1)
            prefill.append(time.perf_counter() - t)
            t = time.perf_counter()
            generated = generate(prompts, a.new_tokens)
            gens.append(time.perf_counter() - t)
        train_step(train_ids)
        train, optim, losses = [], [], []
        for _ in range(a.repeats):
            t = time.perf_counter()
            loss, o = train_step(train_ids)
            train.append(time.perf_counter() - t)
            optim.append(o)
            losses.append(loss)
        prefill_s, generate_s, train_s = min(prefill), min(gens), min(train)
        dec_only = generate_s - prefill_s
        rows.append(
            dict(
                batch=b,
                prompt_len=a.prompt_len,
                new_tokens=a.new_tokens,
                decode_tok_s=generated / max(generate_s, 1e-12),
                prefill_s=prefill_s,
                generate_s=generate_s,
                decode_only_tok_s=(
                    (generated - b) / dec_only if a.new_tokens > 1 and dec_only > 0 else 0.0
                ),
                generated_tokens=generated,
                train_len=a.train_len,
                train_tok_s=b * a.train_len / max(train_s, 1e-12),
                train_s=train_s,
                optimizer_s=mean(optim),
                prefill_s_runs=prefill,
                generate_s_runs=gens,
                train_s_runs=train,
                train_loss=mean(losses),
            )
        )
        print(
            f"batch {b}: generate {gens} s, prefill {prefill} s, train {train} s",
            file=sys.stderr,
            flush=True,
        )

    report = dict(
        implementation=(
            f"HF transformers {transformers.__version__} (torch {torch.__version__}, "
            f"{'bf16 autocast' if a.autocast else 'f32'}, CPU, {a.attn} attention)"
        ),
        model=a.model,
        params=sum(p.numel() for p in model.parameters()),
        vocab_size=cfg.vocab_size,
        threads=torch.get_num_threads(),
        repeats=a.repeats,
        load_s=load_s,
        rows=rows,
    )
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"implementation {report['implementation']}")
    print(f"model          {report['model']}")
    print(f"parameters     {report['params']} (vocab {report['vocab_size']})")
    print(f"threads        {report['threads']}")
    print(f"repeats        {report['repeats']} (after one warm-up)")
    print(
        f"{'batch':>5} {'prompt':>6} {'new':>4} {'decode/s':>10} {'dec-only/s':>10} "
        f"{'prefill_s':>9} {'gen_s':>9} {'train':>6} {'train/s':>10} {'train_s':>9} "
        f"{'optim_s':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['prompt_len']:>6} {r['new_tokens']:>4} "
            f"{r['decode_tok_s']:>10.1f} {r['decode_only_tok_s']:>10.1f} "
            f"{r['prefill_s']:>9.3f} {r['generate_s']:>9.3f} {r['train_len']:>6} "
            f"{r['train_tok_s']:>10.1f} {r['train_s']:>9.3f} {r['optimizer_s']:>9.3f}"
        )


if __name__ == "__main__":
    main()
