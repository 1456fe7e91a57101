#!/usr/bin/env python3
"""Check a LoRA run's exports with HF transformers and PEFT.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers peft gguf safetensors
    actguide export runs/smollm2_household --out runs/smollm2-merged
    actguide export runs/smollm2_household --adapter-only --out runs/smollm2-adapter
    /tmp/hf/bin/python scripts/check-lora-export.py runs/smollm2-merged runs/smollm2-adapter \
        models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

1. transformers loads the merged folder (AutoModelForCausalLM, float32,
   eager attention) and its tokenizer (AutoTokenizer: tokenizer.json +
   tokenizer_config.json with the chat template).
2. PEFT attaches the adapter folder to the base model (the GGUF,
   dequantised by transformers) — an independent implementation of the
   adapted forward.
3. On a chat-template prompt, the merged model's logits must equal the
   PEFT model's (max |Δ| <= 1e-3 × logit scale), and differ from the
   base's (the adapters learned something).
4. Prints a greedy completion of the merged model.

Exit 1 on any failure. Not run by CI (needs torch).
"""

import os
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

merged_dir, adapter_dir, gguf = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(merged_dir)
messages = [
    {"role": "system", "content": "You are an agent in a household. Answer with <action>…</action>."},
    {"role": "user", "content": "Your task is to: put a clean apple in fridge.\nYou are in the middle of a room."},
]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
if not torch.is_tensor(ids):  # transformers 5 returns a BatchEncoding
    ids = ids["input_ids"]
print(f"chat prompt: {ids.shape[1]} tokens, ends {tok.decode(ids[0, -6:])!r}")

kw = dict(dtype=torch.float32, attn_implementation="eager")
merged = AutoModelForCausalLM.from_pretrained(merged_dir, **kw).eval()
base = AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf) or ".", gguf_file=os.path.basename(gguf), **kw
).eval()
with torch.no_grad():
    lb = base(ids).logits[0]
peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
with torch.no_grad():
    lm = merged(ids).logits[0]
    lp = peft_model(ids).logits[0]
scale = lm.abs().max().item()
d_peft = (lm - lp).abs().max().item()
d_base = (lm - lb).abs().max().item()
print(f"{type(merged).__name__} (merged) vs PEFT {type(peft_model).__name__}: "
      f"max |Δlogit| = {d_peft:.2e} over {lm.shape[0]} positions (logit scale {scale:.1f})")
print(f"merged vs base: max |Δlogit| = {d_base:.2e}")
ok = d_peft <= 1e-3 * max(scale, 1.0) and d_base > 10 * d_peft
with torch.no_grad():
    out = merged.generate(ids, max_new_tokens=24, do_sample=False)
print("greedy:", repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)))
print("ok" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
