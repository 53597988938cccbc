import math

import pytest
import torch

from model import (Llama, ModelConfig, PAPER_VOCAB_SIZE, PRESETS, apply_rotary, model_config,
                   rotary_table)


def naive_rope(x, theta=10000.0):
    """Rotary embedding written the textbook way: position t rotates the pair (x_i, x_{i+hs/2})
    by angle t * theta^(-2i/hs), one scalar at a time."""
    B, H, T, D = x.shape
    out = torch.empty_like(x)
    half = D // 2
    for t in range(T):
        for i in range(half):
            angle = t * theta ** (-2 * i / D)
            a, b = x[..., t, i], x[..., t, i + half]
            out[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, i + half] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_rope_matches_naive_reference():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    cos, sin = rotary_table(8, 16, 10000.0)
    torch.testing.assert_close(apply_rotary(x, cos[:7], sin[:7]), naive_rope(x), atol=1e-5, rtol=1e-5)


def test_rope_preserves_relative_position():
    """q.k after RoPE depends only on the offset between positions."""
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rotary_table(8, 32, 10000.0)
    def rot(v, t):
        return apply_rotary(v.view(1, 1, 1, 8), cos[t:t + 1], sin[t:t + 1]).view(8)
    assert torch.allclose(rot(q, 5) @ rot(k, 2), rot(q, 13) @ rot(k, 10), atol=1e-5)


def tiny(**kw):
    return Llama(ModelConfig(vocab_size=97, block_size=32, n_layer=2, n_embd=32, n_head=4,
                             n_kv_head=2, **kw))


def test_causality():
    torch.manual_seed(0)
    model = tiny().eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_shapes_and_loss():
    torch.manual_seed(0)
    model = tiny()
    attn = model.layers[0].attn
    assert attn.wq.weight.shape == (32, 32)
    assert attn.wk.weight.shape == (16, 32) and attn.wv.weight.shape == (16, 32)  # 2 kv heads of 8
    idx = torch.randint(0, 97, (3, 20))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 20, 97)
    assert abs(loss.item() - math.log(97)) < 0.5  # near-uniform at init


def test_gqa_equals_mha_with_repeated_kv():
    """With n_kv_head < n_head, attention equals full multi-head attention whose k/v weights
    repeat each kv head for its group of query heads."""
    torch.manual_seed(0)
    gqa = tiny()
    mha = Llama(ModelConfig(vocab_size=97, block_size=32, n_layer=2, n_embd=32, n_head=4, n_kv_head=4))
    state = gqa.state_dict()
    for key, value in list(state.items()):
        if key.endswith(("wk.weight", "wv.weight")):
            state[key] = value.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,target", [("llama-300m", 300e6), ("llama-600m", 600e6)])
def test_preset_parameter_counts(name, target):
    with torch.device("meta"):
        model = Llama(model_config(name))
    assert abs(model.num_params() - target) <= 0.1 * target
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= 50257


def test_tied_embeddings_share_storage():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert model.num_params() == tiny().num_params() - 97 * 32


def test_optimizer_groups_decay_only_matrices():
    model = tiny()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def ids(params):
    return sorted(id(p) for p in params)


@pytest.mark.parametrize("tie", [False, True])
def test_muon_takes_exactly_the_block_matrices(tie):
    """Muon gets the seven matrices of every block; AdamW the embedding, the head (its own tensor
    or the embedding's) and every norm gain; nothing is left out or counted twice."""
    model = tiny(tie_embeddings=tie)
    muon, adamw = model.configure_muon(0.1, 1e-3, (0.9, 0.95), muon_lr=5e-4, muon_momentum=0.9,
                                       ns_steps=5, adjust_lr_fn="match_rms_adamw")
    blocks = list(model.layers)
    expected_muon = [m.weight for b in blocks for m in (b.attn.wq, b.attn.wk, b.attn.wv, b.attn.wo,
                                                         b.mlp.w1, b.mlp.w2, b.mlp.w3)]
    expected_adamw = [model.tok_embeddings.weight, model.norm.weight,
                      *[b.attn_norm.weight for b in blocks], *[b.mlp_norm.weight for b in blocks]]
    if not tie:
        expected_adamw.append(model.lm_head.weight)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    [muon_group] = muon.param_groups
    decay, no_decay = adamw.param_groups
    assert ids(muon_group["params"]) == ids(expected_muon)
    assert ids(decay["params"] + no_decay["params"]) == ids(expected_adamw)
    assert ids(muon_group["params"] + decay["params"] + no_decay["params"]) == ids(model.parameters())
    assert muon_group["lr"] == 5e-4 and muon_group["momentum"] == 0.9 and muon_group["ns_steps"] == 5
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw"
    assert muon_group["weight_decay"] == 0.1 and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == 1e-3 and decay["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("name,n_layer,n_embd,ffn,heads,seq,size", [
    ("paper-300m", 24, 1024, 2736, 16, 4096, (0.30e9, 0.31e9)),
    ("paper-600m", 32, 1280, 3456, 20, 2048, (0.60e9, 0.65e9))])
def test_paper_presets(name, n_layer, n_embd, ffn, heads, seq, size):
    """The GeoFP8 paper's models: full multi-head attention, tied embeddings, its FFN widths.
    The sizes in their names match the transformer blocks' parameters (302M, 634M)."""
    with torch.device("meta"):
        model = Llama(model_config(name))
        paper_vocab = Llama(model_config(name, vocab_size=PAPER_VOCAB_SIZE))
    cfg = model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.ffn_hidden, cfg.n_head, cfg.block_size) == (
        n_layer, n_embd, ffn, heads, seq)
    assert cfg.n_kv_head == cfg.n_head and cfg.tie_embeddings and cfg.vocab_size == 50304
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert model.layers[0].mlp.w1.weight.shape == (ffn, n_embd)
    assert model.layers[0].attn.wk.weight.shape == (n_embd, n_embd)
    blocks = model.num_params() - cfg.vocab_size * n_embd - n_embd  # less embedding, final norm
    assert size[0] <= blocks <= size[1]
    assert paper_vocab.num_params() == model.num_params() - (50304 - 32000) * n_embd


def test_bad_model_config_is_rejected():
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        model_config("llama-7b")
    assert set(PRESETS) == {"cpu-tiny", "char-study", "char-wide", "llama-300m", "llama-600m", "paper-300m", "paper-600m"}
