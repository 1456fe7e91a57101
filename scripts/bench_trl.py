#!/usr/bin/env python3
"""The `actguide dev bench-grpo` workload on TRL's GRPOTrainer (PyTorch, PEFT, CPU).

    .hf-venv/bin/python scripts/bench_trl.py MODEL --prompt-ids OUT.json \\
        [--prompts 8] [--group 8] [--new-tokens 32] [--steps 3] [--bf16] [--json]

(scripts/compare-trl.sh installs TRL and PEFT into the venv of
scripts/compare-hf.sh and runs this beside actguide.)

The workload, the same on both sides: PROMPTS prompts (fixed text, written
to --prompt-ids as the token ids this tokenizer gives them, which actguide
then reads, so both sides see the same prompt tokens) × GROUP sampled
completions (temperature 1, no top-k / top-p) of exactly NEW_TOKENS tokens
(`min_new_tokens`), a reward per completion (the share of its tokens with
an even id), group-normalised advantages, and one optimiser step (AdamW,
lr 1e-5, no weight decay, grad clip 1, PPO clip 0.2 / 0.28, no KL, token
mean) over all 64 completions, on LoRA adapters (rank 8, alpha 16, every
projection of every layer) on a frozen f32 base. TRL's settings:
per_device_train_batch_size = PROMPTS × GROUP, num_generations = GROUP,
gradient_accumulation_steps = 1, num_iterations = 1, beta = 0, generation
by transformers (no vLLM). With --bf16, TRL's `bf16=True` (autocast over the
training forward on the CPU).

Seconds per step come from a TrainerCallback (on_step_begin → on_step_end:
generation, scoring, forward, backward and the optimiser step); generation
alone is timed by wrapping `model.generate`. The first step is a warm-up;
the JSON reports the timed steps, their fastest and their mean.
"""
import argparse
import contextlib
import json
import os
import sys
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", required=True, help="write the prompts' token ids here (JSON)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


PROMPT = (
    "You are in a house. Your task {i}: put a clean mug in the coffee machine, "
    "then turn on the lamp in the living room. Rooms: kitchen, living room, hall, "
    "bedroom. Objects you have seen: mug, lamp, sponge, key, book. "
    "Plan your next actions and answer with one action."
)


def main():
    a = parse()
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    import transformers
    import trl
    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    d, name = os.path.split(os.path.abspath(a.model))
    kw = dict(gguf_file=name) if name.endswith(".gguf") else {}
    src = d if kw else a.model
    tok = AutoTokenizer.from_pretrained(src, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32, **kw)
    # A GGUF file is dequantised to f32 on load, yet transformers still
    # marks the model as quantized and refuses to train it: clear the mark.
    if kw:
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = [PROMPT.format(i=i) for i in range(a.prompts)]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    with open(a.prompt_ids, "w") as f:
        json.dump(ids, f)

    def reward(completions, completion_ids=None, **_):
        if completion_ids is None:
            completion_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
        return [sum(1 for t in c if t % 2 == 0) / max(len(c), 1) for c in completion_ids]

    cfg = trl.GRPOConfig(
        output_dir="runs/compare-trl/trl-out",
        per_device_train_batch_size=a.prompts * a.group,
        gradient_accumulation_steps=1,
        num_generations=a.group,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": a.new_tokens},
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        num_iterations=1,
        loss_type="dapo",
        max_steps=a.steps + 1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=a.bf16,
        dataloader_num_workers=0,
        seed=0,
    )
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    data = Dataset.from_dict({"prompt": prompts * 64})
    steps, gen_s, t = [], [0.0], [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            gen_s[0] = 0.0
            t[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append(dict(step_s=time.perf_counter() - t[0], generate_s=gen_s[0]))

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora,
        callbacks=[Clock()],
    )
    inner = trainer.model
    gen = inner.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = gen(*args, **kwargs)
        gen_s[0] += time.perf_counter() - t0
        return out

    inner.generate = timed_generate
    # The trainer prints its logs to stdout; keep stdout for the report.
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    timed = steps[1:]
    for s in timed:
        s["update_s"] = s["step_s"] - s["generate_s"]
    fastest = min(timed, key=lambda s: s["step_s"])
    report = dict(
        implementation=(
            f"TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__}, "
            f"torch {torch.__version__}, PEFT {peft.__version__}, {'bf16 autocast' if a.bf16 else 'f32'}, CPU)"
        ),
        model=a.model,
        threads=torch.get_num_threads(),
        prompts=a.prompts,
        group=a.group,
        new_tokens=a.new_tokens,
        prompt_tokens=[len(i) for i in ids],
        trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        steps=timed,
        fastest=fastest,
        mean_step_s=sum(s["step_s"] for s in timed) / len(timed),
    )
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for i, s in enumerate(timed):
            print(f"step {i + 1}: {s['step_s']:.3f} s (generate {s['generate_s']:.3f} s)")
        print(f"fastest {fastest['step_s']:.3f} s, mean {report['mean_step_s']:.3f} s")
    print(f"TRL steps: {steps}", file=sys.stderr)


if __name__ == "__main__":
    main()
