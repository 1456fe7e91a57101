#!/usr/bin/env python3
"""Load actguide's HF-layout checkpoints with HF transformers and compare logits.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors
    cargo test --test hf_models -- --ignored export     # writes target/hf-export/*
    /tmp/hf/bin/python scripts/check-hf-transformers.py [target/hf-export]

Each folder holds what `Policy::save_hf_dir` wrote (config.json,
model.safetensors) and `actguide_logits.json` (token ids and our
last-position logits). transformers loads the folder with
AutoModelForCausalLM (float32, eager attention) and the script prints the
max |Δ| of the last-position logits against ours. Exit 1 when any folder
fails to load or differs by more than 1e-3 × the logit scale. Not run by
CI (needs torch).
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

root = sys.argv[1] if len(sys.argv) > 1 else "target/hf-export"
bad = 0
for name in sorted(os.listdir(root)):
    d = os.path.join(root, name)
    ref = os.path.join(d, "actguide_logits.json")
    if not os.path.exists(ref):
        continue
    ours = json.load(open(ref))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            d, torch_dtype=torch.float32, attn_implementation="eager"
        )
    except Exception as e:  # noqa: BLE001 - report any load failure
        print(f"{name}: transformers could not load it: {e}")
        bad += 1
        continue
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ours["ids"]])).logits[0, -1]
    mine = torch.tensor(ours["logits"])
    diff = (out - mine).abs().max().item()
    scale = mine.abs().max().item()
    ok = diff <= 1e-3 * max(scale, 1.0)
    bad += 0 if ok else 1
    print(
        f"{name}: {type(model).__name__} loaded, max |Δlogit| = {diff:.2e} "
        f"(logit scale {scale:.1f}) {'ok' if ok else 'MISMATCH'}"
    )
sys.exit(1 if bad else 0)
