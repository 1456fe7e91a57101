#!/usr/bin/env python3
# PyTorch bf16 per-token costs on this GPU for Qwen2.5-1.5B and -7B shapes
# (random weights): train (forward+backward, AdamW step excluded) tokens/s
# at batch 8 x 512, decode tokens/s at batch 64 with the KV cache, and
# device-to-host bandwidth (what a weight sync to an engine reads).
# Usage (a CUDA GPU, torch and transformers): python3 scripts/torch-token-costs.py
# The figures are the per-token costs of docs/DISTRIBUTED.md's scaling note.
import json, time, torch
from transformers import Qwen2Config, AutoModelForCausalLM
res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
shapes = {
  "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
  "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
}
def timed(f, n=3):
    f(); torch.cuda.synchronize(); best = 1e9
    for _ in range(n):
        t = time.time(); f(); torch.cuda.synchronize(); best = min(best, time.time() - t)
    return best
for name, kw in shapes.items():
    cfg = Qwen2Config(vocab_size=151936, tie_word_embeddings=(name == "1.5B"), **kw)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    m.gradient_checkpointing_enable() if name == "7B" else None
    B, L = 8, 512
    x = torch.randint(0, 151936, (B, L), device="cuda")
    def train():
        out = m(input_ids=x, labels=x); out.loss.backward(); m.zero_grad(set_to_none=True)
    m.train(); tt = timed(train)
    m.eval()
    Bd, P, T = 64, 256, 64
    p = torch.randint(0, 151936, (Bd, P), device="cuda")
    def dec():
        with torch.no_grad():
            m.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=T, min_new_tokens=T, do_sample=False, pad_token_id=0)
    td = timed(dec, 2)
    r = {"params": n, "train_tok_s": B * L / tt, "train_s": tt, "train_tflops": 6 * n * B * L / tt / 1e12,
         "decode_tok_s": Bd * T / td, "decode_s": td, "grad_ckpt": name == "7B"}
    buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    t = timed(lambda: host.copy_(buf, non_blocking=False), 2)
    r["d2h_GB_s"] = 2 * n / t / 1e9
    res[name] = r
    print(name, json.dumps(r), flush=True)
    del m, buf, host; torch.cuda.empty_cache()
print(json.dumps(res))
