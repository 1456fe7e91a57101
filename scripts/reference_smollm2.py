#!/usr/bin/env python3
"""Independent reference for our GGUF loader and GGUF tokenizer (outside CI).

Reads SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh) with the `gguf`
package (llama.cpp's own Python reader and dequantizer), not candle, and:

(a) tokenizer: prints the ids of a fixed text
    - as transformers' GGUF conversion builds the tokenizer
      (`convert_gguf_tokenizer`; called directly because transformers' GGUF
      *file* reader needs torch, which we do not install). NB: transformers
      maps `tokenizer.ggml.pre = "smollm"` to plain GPT-2 pre-tokenisation,
      without llama.cpp's per-digit split, so its ids differ on numbers;
    - "llama.cpp-style": llama.cpp's `llm_tokenizer_bpe` semantics written
      out here with the `regex` module (control tokens split off first, then
      the SMOLLM regexes `\\p{N}` and GPT-2 applied one after the other, each
      to the pieces of the previous one), each piece BPE-merged by the
      transformers-built model. These are the ids our tokenizer must give.
(b) logits: a float64 numpy forward of the dequantized model (its own Q/K
    un-permute of llama.cpp's `permute`) on fixed prompts; prints the last
    position's top-5 and saves the full last-position logits.

Writes models/smollm2/reference.json (git-ignored) for tests/gguf.rs.

Setup (no torch needed):
    python3 -m venv /tmp/gguf-venv
    /tmp/gguf-venv/bin/pip install gguf numpy transformers tokenizers
    /tmp/gguf-venv/bin/python scripts/reference_smollm2.py
"""

import argparse
import json
import os
import sys

import numpy as np
import regex
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(ROOT, "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(ROOT, "models/smollm2/reference.json")

TEXT = "Hello, world! 12345 apples cost $3.50 — naïve café, 日本語, Привет."
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
PROMPTS = [CHAT, "The quick brown fox jumps over the lazy", TEXT]

# llama.cpp llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM
SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def field(r, key):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def transformers_tokenizer(r):
    # Importing the mapping module alone needs no torch.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    d = {
        "tokenizer_type": field(r, "tokenizer.ggml.model"),
        "pre_tokenizer_type": field(r, "tokenizer.ggml.pre"),
        "tokens": field(r, "tokenizer.ggml.tokens"),
        "token_type": field(r, "tokenizer.ggml.token_type"),
        "merges": field(r, "tokenizer.ggml.merges"),
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "unk_token_id": field(r, "tokenizer.ggml.unknown_token_id"),
        "pad_token_id": field(r, "tokenizer.ggml.padding_token_id"),
    }
    backend, _ = convert_gguf_tokenizer(field(r, "general.architecture"), d)
    return backend


def split_isolated(pieces, pattern):
    out = []
    for p in pieces:
        pos = 0
        for m in regex.finditer(pattern, p):
            if m.start() > pos:
                out.append(p[pos : m.start()])
            if m.end() > m.start():
                out.append(m.group())
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return out


def llamacpp_style_ids(r, backend, text):
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    tok_id = {t: i for i, t in enumerate(tokens)}
    b2u = bytes_to_unicode()
    model = backend.model
    ids = []
    # Control/user-defined tokens are matched verbatim first (llama.cpp's
    # tokenizer_st_partition), longest first.
    special_re = "(" + "|".join(regex.escape(s) for s in specials) + ")"
    for chunk in regex.split(special_re, text):
        if not chunk:
            continue
        if chunk in specials:
            ids.append(tok_id[chunk])
            continue
        pieces = [chunk]
        for pat in SMOLLM_REGEXES:
            pieces = split_isolated(pieces, pat)
        for p in pieces:
            mapped = "".join(b2u[b] for b in p.encode("utf-8"))
            ids.extend(t.id for t in model.tokenize(mapped))
    return ids


def load_weights(r):
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(x) for x in reversed(t.shape)])
    return w


def unpermute(x, n_head):
    # Inverse of convert_hf_to_gguf.py's permute():
    # w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2).reshape(w.shape)
    rows = x.shape[0]
    hd = rows // n_head
    return x.reshape(n_head, hd // 2, 2, -1).swapaxes(1, 2).reshape(x.shape)


def forward(r, w, ids):
    a = field(r, "general.architecture")
    g = lambda k: field(r, f"{a}.{k}")
    n_layer, n_head = g("block_count"), g("attention.head_count")
    n_kv = g("attention.head_count_kv")
    eps, theta = float(g("attention.layer_norm_rms_epsilon")), float(g("rope.freq_base"))
    hidden = g("embedding_length")
    hd = hidden // n_head
    T = len(ids)

    def rms(x, wt):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * wt

    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)
    sin = np.concatenate([np.sin(ang)] * 2, -1)

    def rope(x):  # (heads, T, hd), HF rotate-half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    emb = w["token_embd.weight"]
    x = emb[ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, w[p + "attn_norm.weight"])
        wq, wk = w[p + "attn_q.weight"], w[p + "attn_k.weight"]
        if a == "llama":
            wq, wk = unpermute(wq, n_head), unpermute(wk, n_kv)
        q = (h @ wq.T).reshape(T, n_head, hd).transpose(1, 0, 2)
        k = (h @ wk.T).reshape(T, n_kv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, n_kv, hd).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, n_head * hd)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gt, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ w[p + "ffn_down.weight"].T
    x = rms(x[-1], w["output_norm.weight"])
    head = w.get("output.weight", emb)
    return head @ x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if not os.path.isfile(args.gguf):
        sys.exit(f"{args.gguf} not found: run scripts/fetch-smollm2.sh first")
    r = GGUFReader(args.gguf)
    backend = transformers_tokenizer(r)

    tf_ids = backend.encode(TEXT, add_special_tokens=False).ids
    lc_ids = llamacpp_style_ids(r, backend, TEXT)
    print(f"text: {TEXT!r}")
    print(f"transformers GGUF conversion ids ({len(tf_ids)}): {tf_ids}")
    print(f"llama.cpp-style ids             ({len(lc_ids)}): {lc_ids}")
    print("decoded (llama.cpp-style):", repr(backend.decode(lc_ids)))

    w = load_weights(r)
    out = {
        "gguf": os.path.basename(args.gguf),
        "text": TEXT,
        "ids_transformers": tf_ids,
        "ids_llamacpp_style": lc_ids,
        "prompts": [],
    }
    for text in PROMPTS:
        ids = llamacpp_style_ids(r, backend, text)
        logits = forward(r, w, ids)
        top = np.argsort(-logits)[:5]
        print(f"\nprompt {text!r} ({len(ids)} tokens)")
        print("  top-5:", [(int(i), backend.id_to_token(int(i)), round(float(logits[i]), 4)) for i in top])
        out["prompts"].append(
            {"text": text, "ids": ids, "top5": [int(i) for i in top], "logits": [float(x) for x in logits]}
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
