"""
Capture real gradients of W data-parallel workers into a gradient file.

    python -m nanogeo.lab.capture --out grads.pt --workers=4 --train_steps=200 --capture_steps=4
    python -m nanogeo.lab.capture --out grads_muon.pt --optimizer=muon --workers=4 --train_steps=200
    python -m nanogeo.lab.capture --model=bytegpt --out grads_bytegpt.pt     # a GPT-2-style model
    python -m nanogeo.lab.capture --model=bytegpt --quiet_rows=0.25 ...      # with planted quiet rows

Trains a preset in one process for --train_steps with the exact fp32 mean of W workers'
gradients (each worker its own micro-batch, as in data parallelism), or starts from a train.py
checkpoint (--checkpoint=out/demo/ckpt.pt), then records --capture_steps successive steps. The
file holds, oldest step first:

    steps       [[{name: fp32 gradient} per worker] per step]
    inputs      [{weight name: A = a^T a / tokens} per step]     each nn.Linear but the output
    outputs     [{weight name: G = delta^T delta / tokens} per step]   head, all workers' tokens
    optimizer   {"groups": [{"class": "AdamW" | "Muon", "params": [names], "hyper": {kwargs}}],
                 (not with --keep=linear, which keeps only the linear layers' weights)
                 "state": {name: torch's per-parameter state}}   as it was before the first step
    optimizer_v {name: exp_avg_sq} at the end (AdamW's parameters; legacy)
    vocab_size  the model's vocabulary size
    vocabulary  names of the weights that read or write the vocabulary (the embedding, an untied
                head), found by module (hooks.vocabulary_layers): tools read roles from here
    linear      names of the nn.Linear weights (by module type): GeoFP8's candidates
    grad_clip   the global-norm clip applied to every mean before the optimizer step

Every recorded step is taken with the exact mean, so a tool can replay the optimizer from the
recorded state to know its state at every step.
"""

import inspect
import sys
from dataclasses import dataclass

import torch

import model as model_lib
from prepare_data import ShardError, load_splits
from nanogeo.lab import bytegpt
from nanogeo.run import checkpoint, config
from nanogeo.run.steps import (batch_rng, get_batch, make_optimizers, peak_lrs,
                               set_learning_rates, warmup_cosine)
from nanogeo.parallel import hooks


@dataclass
class CaptureConfig:
    out: str = "grads.pt"
    model: str = "llama"              # llama (model.py, --preset) | bytegpt (nanogeo.lab.bytegpt:
                                      # GPT-2 style, bytes of the Python standard library)
    preset: str = "cpu-tiny"
    data_dir: str = "data/shakespeare"
    checkpoint: str = ""              # a train.py ckpt.pt to start from (skips training)
    workers: int = 4
    train_steps: int = 200
    capture_steps: int = 4
    batch_size: int = 8
    block_size: int = 128
    optimizer: str = "adamw"          # adamw | muon (Muon on the blocks' matrices, as train.py)
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    muon_lr: float = 5e-4
    muon_momentum: float = 0.9
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    keep: str = "all"                 # all | linear: only the linear layers' weights (the ones
                                      # with moments) - small files for many workers
    quiet_rows: float = 0.0           # > 0: plant this fraction of quiet rows (plant_quiet_rows)
    seed: int = 1337


def simulated_training(cfg, record_from, collect_moments=False):
    """Train cfg.preset in one process as cfg.workers data-parallel workers, stepping with the
    exact fp32 mean of their gradients. Yields (step, model, optimizers, workers, moments, loss)
    for every step >= record_from *before* the optimizer takes it: workers is [{name: gradient}]
    per worker, moments the K-FAC statistics of every nn.Linear over all workers' tokens
    (hooks.KroneckerMoments.take(); None unless collect_moments), loss the workers' mean."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "bytegpt":
        if cfg.checkpoint:
            raise config.ConfigError("--checkpoint holds a train.py model; drop it for --model=bytegpt")
        model = bytegpt.ByteGPT(bytegpt.ByteGPTConfig(block_size=cfg.block_size))
        data = bytegpt.stdlib_corpus()
    else:
        model = model_lib.Llama(model_lib.model_config(cfg.preset, block_size=cfg.block_size))
        data = load_splits(cfg.data_dir, cfg.block_size, model.config.vocab_size)
    optimizers = make_optimizers(cfg, model, fused=False)
    start = 0
    if cfg.checkpoint:
        ckpt = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        checkpoint.load_optimizers(optimizers, ckpt)
        start = ckpt["step"]
        record_from += start
    params = dict(model.named_parameters())
    max_iters = record_from + cfg.capture_steps       # the schedule ends with the capture
    peaks = peak_lrs(optimizers)
    recording = [False]
    # every linear layer but the output head (its G alone would be vocab x vocab), found by
    # module type and one token's forward, never by shape
    vocabulary = hooks.vocabulary_layers(model, torch.zeros(1, 1, dtype=torch.long))
    layers = {n: m for n, m in hooks.linear_layers(model).items() if n not in vocabulary}
    moments = (hooks.KroneckerMoments(layers, lambda: recording[0], ("input", "output")).attach()
               if collect_moments else None)
    for step in range(start, max_iters):
        recording[0] = step >= record_from
        workers, loss = [], 0.0
        for w in range(cfg.workers):
            x, y = get_batch(data["train"], cfg.batch_size, cfg.block_size,
                             batch_rng(cfg.seed, w, step, 0), "cpu")
            model.zero_grad(set_to_none=True)
            worker_loss = model(x, y)[1]
            worker_loss.backward()
            loss += worker_loss.item() / cfg.workers
            workers.append({n: p.grad.detach().clone() for n, p in params.items()})
        if recording[0]:
            yield step, model, optimizers, workers, moments.take() if moments else None, loss
        for n, p in params.items():
            p.grad = sum(w[n] for w in workers) / cfg.workers
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = warmup_cosine(step, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, max_iters)
        set_learning_rates(optimizers, peaks, lr, cfg.learning_rate)
        for opt in optimizers:
            opt.step()
        if not recording[0] and step % 50 == 0:
            print(f"train step {step}")


def optimizer_record(optimizers, model):
    """The optimizers as the gradient file describes them: each param group's torch class,
    parameter names and constructor arguments, and each parameter's state (copied)."""
    names = {p: n for n, p in model.named_parameters()}
    groups, state = [], {}
    for opt in optimizers:
        accepted = inspect.signature(type(opt).__init__).parameters
        for group in opt.param_groups:
            groups.append({"class": type(opt).__name__,
                           "params": [names[p] for p in group["params"]],
                           "hyper": {k: v for k, v in group.items()
                                     if k in accepted and k != "params"}})
        for p, s in opt.state.items():
            state[names[p]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
    return {"groups": groups, "state": state}


def plant_quiet_rows(data, fraction, factor=1e-3):
    """Make the first `fraction` of every linear weight's rows quiet, as if they had always
    been: their gradients (every worker, every step) and the optimizer state such gradients
    leave (AdamW's moments, Muon's momentum) scaled down by `factor` (`factor`^2 for second
    moments). A stress test for the optimizer's view of the codec error: AdamW divides by those
    rows' tiny second moments, so an error spread onto them is magnified."""
    for workers in data["steps"]:
        for grads in workers:
            for n in data["linear"]:
                if n in grads:
                    grads[n][: int(grads[n].shape[0] * fraction)] *= factor
    for n in data["linear"]:
        state = data.get("optimizer", {}).get("state", {}).get(n, {})
        for key, power in (("exp_avg", 1), ("exp_avg_sq", 2), ("momentum_buffer", 1)):
            if key in state:
                state[key][: int(state[key].shape[0] * fraction)] *= factor ** power
    for n, v in data.get("optimizer_v", {}).items():
        if n in data["linear"]:
            v[: int(v.shape[0] * fraction)] *= factor ** 2


def capture(cfg: CaptureConfig):
    steps, inputs, outputs, record = [], [], [], None
    record_from = 0 if cfg.checkpoint else cfg.train_steps
    for step, model, optimizers, workers, moments, loss in simulated_training(cfg, record_from,
                                                                               True):
        if record is None:
            record = optimizer_record(optimizers, model)
        if cfg.keep == "linear":
            workers = [{n: w[n] for n in moments["input"]} for w in workers]
        steps.append(workers)
        inputs.append(moments["input"])
        outputs.append(moments["output"])
        print(f"captured step {step}: {cfg.workers} workers, loss {loss:.3f}")
    adamw = [o for o in optimizers if isinstance(o, torch.optim.AdamW)]
    names = {p: n for n, p in model.named_parameters()}
    optimizer_v = {names[p]: o.state[p]["exp_avg_sq"].clone() for o in adamw for p in o.state}
    data = {"steps": steps, "inputs": inputs, "outputs": outputs,
            "vocab_size": model.config.vocab_size,
            "vocabulary": hooks.vocabulary_layers(model, torch.zeros(1, 1, dtype=torch.long)),
            "linear": list(hooks.linear_layers(model))}
    if cfg.keep == "all":   # the optimizer replays only on the whole model (clipping is global)
        data.update(optimizer=record, optimizer_v=optimizer_v, grad_clip=cfg.grad_clip)
    if cfg.quiet_rows > 0:
        plant_quiet_rows(data, cfg.quiet_rows)
    torch.save(data, cfg.out)
    print(f"wrote {cfg.out}: {len(steps)} steps x {cfg.workers} workers x {len(steps[0][0])} "
          f"tensors, {cfg.optimizer}")


def main(argv=None):
    try:
        cfg = config.parse_config(sys.argv[1:] if argv is None else argv, CaptureConfig,
                                  presets={name: {} for name in model_lib.PRESETS},
                                  choices={"preset": tuple(model_lib.PRESETS),
                                           "optimizer": ("adamw", "muon"),
                                           "model": ("llama", "bytegpt"),
                                           "keep": ("all", "linear")}, doc=__doc__)
        capture(cfg)
    except (config.ConfigError, ShardError) as e:
        sys.exit(f"nanogeo.lab.capture: error: {e}")


if __name__ == "__main__":
    main()
