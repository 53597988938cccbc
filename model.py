"""
A Llama-style decoder-only transformer, in one file.

This is the model every experiment in nanogeo trains. It is a plain single-device module:
it knows nothing about processes, collectives or gradient compression (that is train.py's and
compress.py's business), so you can read it as a textbook Llama.

The pieces, in the order a token meets them:

  tokens (B, T) -> embedding (B, T, C)
    -> n_layer x Block:
         x = x + Attention(RMSNorm(x))     grouped-query attention with rotary positions
         x = x + SwiGLU(RMSNorm(x))        gated MLP
    -> RMSNorm -> lm_head (B, T, vocab)

What makes it "Llama" rather than GPT-2:
  * RMSNorm instead of LayerNorm: rescales by the root-mean-square, no mean subtraction, no bias.
  * Rotary position embeddings (RoPE): queries and keys are rotated by an angle proportional to
    their position, so q.k depends only on the relative offset. No learned position table.
  * SwiGLU MLP: silu(x W1) * (x W3), then W2. Three matrices instead of two, hidden size ~8/3 C.
  * Grouped-query attention (GQA): n_kv_head <= n_head; each key/value head is shared by
    n_head // n_kv_head query heads. Cuts the KV projection (and KV cache) without hurting much.
  * No biases anywhere.

Presets (parameter counts with the GPT-2 vocabulary padded to 50304):
  cpu-tiny    ~ 13.7M  (6.4M of it the two vocab matrices)  for CI and the 2-core CPU demo
  char-study  ~ 0.12M  128 character ids, 2 x 64: the convergence studies and the tests
  char-wide   ~ 0.8M   the same, 4 x 128: do the studies' answers hold for larger matrices?
  llama-300m  ~ 302M   untied embeddings, GQA
  llama-600m  ~ 608M   untied embeddings, GQA
  paper-300m  ~ 354M   the GeoFP8 paper's 300M model: 24 x 1024, FFN 2736, 16 heads, no GQA,
                       seq 4096, tied embeddings; 335M with the paper's 32000-token vocabulary,
                       302M without the embedding
  paper-600m  ~ 699M   the paper's 600M model: 32 x 1280, FFN 3456, 20 heads, no GQA, seq 2048,
                       tied; 675M at vocabulary 32000, 634M without the embedding
Run `python model.py` to print them (with a second count at vocabulary 32000).
"""

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


@dataclass
class ModelConfig:
    vocab_size: int = 50304      # GPT-2's 50257 padded up to a multiple of 64 (faster matmuls)
    block_size: int = 256        # longest sequence the rotary table is built for
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2           # grouped-query attention: n_head must be a multiple of this
    ffn_hidden: int = 0          # 0 = Llama's rule: 8/3 * n_embd rounded up to multiple_of
    multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head size n_embd // n_head must be even for rotary embeddings")
        if self.ffn_hidden == 0:
            hidden = int(8 * self.n_embd / 3)
            self.ffn_hidden = self.multiple_of * math.ceil(hidden / self.multiple_of)


PRESETS = {
    "cpu-tiny":   dict(n_layer=4, n_embd=128, n_head=4, n_kv_head=2, block_size=128),
    # character-level studies on a CPU (prepare_data.py --tokenizer char: 85 ids fit in 128)
    "char-study": dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, block_size=64,
                       vocab_size=128),
    # the same, twice as wide and deep: do the studies' answers hold for larger matrices?
    "char-wide":  dict(n_layer=4, n_embd=128, n_head=4, n_kv_head=2, block_size=64,
                       vocab_size=128),
    "llama-300m": dict(n_layer=18, n_embd=1024, n_head=16, n_kv_head=4, block_size=2048),
    "llama-600m": dict(n_layer=23, n_embd=1408, n_head=22, n_kv_head=2, block_size=2048),
    # the GeoFP8 paper's two models: full multi-head attention (no GQA), tied embeddings, its
    # FFN widths; our GPT-2 vocabulary instead of the paper's Llama-2 one (PAPER_VOCAB_SIZE)
    "paper-300m": dict(n_layer=24, n_embd=1024, n_head=16, n_kv_head=16, ffn_hidden=2736,
                       block_size=4096, tie_embeddings=True),
    "paper-600m": dict(n_layer=32, n_embd=1280, n_head=20, n_kv_head=20, ffn_hidden=3456,
                       block_size=2048, tie_embeddings=True),
}
PAPER_VOCAB_SIZE = 32000  # the Llama-2 tokenizer the paper trained with


def model_config(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[preset], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.normalize(x) * self.weight

    def normalize(self, x):
        """x / rms(x) over the last dimension, in fp32 even under bf16 autocast: the mean of
        squares is precision-sensitive."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x)


def rotary_table(head_dim: int, max_len: int, theta: float):
    """cos and sin of the rotation angles, each (max_len, head_dim // 2).

    Pair i of a head (dimensions 2i and 2i+1 of the 'interleaved' convention; we use the
    'half-split' convention: dims i and i + head_dim/2) rotates with frequency theta^(-2i/head_dim).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate (B, nh, T, hs) by the per-position angles: the two halves of each head form
    hs/2 complex numbers x1 + i x2, each multiplied by exp(i * angle)."""
    x1, x2 = x.float().chunk(2, dim=-1)                      # (B, nh, T, hs/2) each
    cos, sin = cos[None, None], sin[None, None]              # (1, 1, T, hs/2)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x, cos, sin):
        heads = "b t (h hs) -> b h t hs"                     # (B, T, h * hs) -> (B, h, T, hs)
        q = rearrange(self.wq(x), heads, hs=self.head_dim)                          # (B, nh, T, hs)
        k = rearrange(self.wk(x), heads, hs=self.head_dim)                          # (B, nkv, T, hs)
        v = rearrange(self.wv(x), heads, hs=self.head_dim)                          # (B, nkv, T, hs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA: each kv head serves n_head // n_kv_head query heads. On a GPU, SDPA's enable_gqa
        # reads each shared head in place (flash attention), where repeat_interleave would copy
        # K and V n_head // n_kv_head times. The CPU keeps the copy: the forward is bit-equal
        # either way, but the in-kernel backward adds the shared heads' gradients in another
        # order, and every CPU run recorded so far was made with the copy.
        if q.device.type == "cpu" and self.n_kv_head < self.n_head:
            repeat = self.n_head // self.n_kv_head
            k = k.repeat_interleave(repeat, dim=1)                                  # (B, nh, T, hs)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,                # (B, nh, T, hs)
                                           enable_gqa=k.shape[1] < self.n_head)
        return self.wo(rearrange(y, "b h t hs -> b t (h hs)"))                     # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def adamw(params, weight_decay, learning_rate, betas, fused=None):
    """AdamW that decays the matrices (2-D and up) and not the gains and biases."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


def muon_and_adamw(model, blocks, weight_decay, learning_rate, betas, muon_lr, muon_momentum,
                   ns_steps, adjust_lr_fn, fused=None):
    """(Muon, AdamW), to be stepped together. torch.optim.Muon orthogonalizes each update
    matrix with a few Newton-Schulz iterations, which only makes sense for the hidden
    matrices: the nn.Linear weights inside the transformer `blocks`. The token embedding and the
    output head (a lookup table and a classifier, tied or not), position tables, norm gains and
    biases stay with AdamW, which decays its matrices only. The split is read from which module
    owns a parameter, not from its name or shape."""
    hidden = {id(m.weight) for block in blocks for m in block.modules()
              if isinstance(m, nn.Linear)}
    params = [p for p in model.parameters() if p.requires_grad]
    muon = torch.optim.Muon([p for p in params if id(p) in hidden], lr=muon_lr,
                            weight_decay=weight_decay, momentum=muon_momentum,
                            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
    rest = [p for p in params if id(p) not in hidden]
    return muon, adamw(rest, weight_decay, learning_rate, betas, fused)


def next_token_loss(logits, targets):
    """Mean cross-entropy of the next-token predictions (B, T, vocab) against targets (B, T),
    in fp32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rotary_table(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        # non-persistent: derived from the config, so not part of the checkpoint
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 style: scale the init of projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), so the residual's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() deduplicates tied weights

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.tok_embeddings(idx)                                   # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))                            # (B, T, vocab)
        return logits, None if targets is None else next_token_loss(logits, targets)

    def configure_optimizers(self, weight_decay, learning_rate, betas, fused=None):
        """AdamW with weight decay on matrices only: 2-D weights (linears, embeddings) decay,
        1-D parameters (norm gains) do not, as in GPT-2/Llama recipes."""
        return adamw(self.parameters(), weight_decay, learning_rate, betas, fused)

    def configure_muon(self, weight_decay, learning_rate, betas, muon_lr, muon_momentum,
                       ns_steps, adjust_lr_fn, fused=None):
        """(Muon, AdamW), to be stepped together: see muon_and_adamw."""
        return muon_and_adamw(self, self.layers, weight_decay, learning_rate, betas, muon_lr,
                              muon_momentum, ns_steps, adjust_lr_fn, fused)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 N for the matmuls plus the
        attention scores, 12 * n_layer * n_embd * T (PaLM appendix B). The embedding lookup is
        not a matmul, so its parameters are excluded from N."""
        cfg = self.config
        n = self.num_params() - self.tok_embeddings.weight.numel() * (not cfg.tie_embeddings)
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len


if __name__ == "__main__":
    # second column: the same shapes with the paper's vocabulary, to compare with its counts
    for name in PRESETS:
        cfg = model_config(name)
        with torch.device("meta"):
            model = Llama(cfg)
            paper_vocab = Llama(model_config(name, vocab_size=PAPER_VOCAB_SIZE))
        print(f"{name:12s} {model.num_params() / 1e6:8.1f}M parameters "
              f"({paper_vocab.num_params() / 1e6:6.1f}M at vocab {PAPER_VOCAB_SIZE})  {asdict(cfg)}")
