"""
A model this project did not design, for checking that GeoFP8's decisions do not fit only ours.

    python -m nanogeo.lab.capture --model=bytegpt --out grads_bytegpt.pt --workers=4 --train_steps=150

A byte-level GPT-2 (Radford et al. 2019) in miniature, written the way GPT-2 is, not the way
model.py's Llama is: LayerNorm with biases, a fused query/key/value projection (one 192 x 576
matrix), a GELU MLP with biases, learned position embeddings, the head tied to the token
embedding. Its vocabulary is the 256 byte values - smaller than its MLP width of 768, so no rule
of the kind "the largest dimension is the vocabulary" can be right on it. Its corpus is the Python
standard library's own source files (read from this interpreter's installation, so it works
offline): a few MB of code and docstrings.

nanogeo.lab.capture trains it with the same simulated data parallelism and optimizers (AdamW, or
Muon on the blocks' matrices) as our model, and writes the same gradient file, which
nanogeo.lab.fidelity and nanogeo.lab.tables read.
"""

import math
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as model_lib


@dataclass
class ByteGPTConfig:
    vocab_size: int = 256       # bytes
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192           # MLP width 4 * 192 = 768 > vocabulary 256


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)    # q, k, v in one matrix
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ByteGPT(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.config = cfg = cfg or ByteGPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                          # tied, as in GPT-2
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # GPT-2's init; residual projections scaled by 1/sqrt(2 n_layer)
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, fused=None):
        return model_lib.adamw(self.parameters(), weight_decay, learning_rate, betas, fused)

    def configure_muon(self, weight_decay, learning_rate, betas, muon_lr, muon_momentum,
                       ns_steps, adjust_lr_fn, fused=None):
        return model_lib.muon_and_adamw(self, self.h, weight_decay, learning_rate, betas, muon_lr,
                                        muon_momentum, ns_steps, adjust_lr_fn, fused)


def stdlib_corpus(limit=4_000_000, val_fraction=0.1):
    """{"train", "val"}: uint8 arrays of byte tokens from the standard library's .py files, in
    sorted path order (the same bytes on every machine with the same Python), up to `limit`."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for folder, dirs, files in os.walk(root):       # top-down, in sorted order
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
            if total >= limit:
                break
        if total >= limit:
            break
    if total < 100_000:
        raise FileNotFoundError(f"found only {total} bytes of Python source under {root}")
    tokens = np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)
    split = int(len(tokens) * (1 - val_fraction))
    return {"train": tokens[:split], "val": tokens[split:]}
