"""
Capture real gradients of W data-parallel workers into a gradient file (DESIGN.md section 5).

    python -m nanogeo.capture --out grads.pt --workers=4 --train_steps=200 --capture_steps=4

Trains a preset in one process for --train_steps with the exact fp32 mean of W workers'
gradients (each worker its own micro-batch, as in data parallelism), or starts from a train.py
checkpoint (--checkpoint=out/demo/ckpt.pt), then records --capture_steps successive steps: for each,
every worker's gradient, after which the model is stepped with their exact mean. Adam's
exp_avg_sq at the end is saved as optimizer_v (for errors in Adam-normalised units).
"""

import sys
from dataclasses import dataclass

import torch

import model as model_lib
import train


@dataclass
class CaptureConfig:
    out: str = "grads.pt"
    preset: str = "cpu-tiny"
    data_dir: str = "data/shakespeare"
    checkpoint: str = ""              # a train.py ckpt.pt to start from (skips training)
    workers: int = 4
    train_steps: int = 200
    capture_steps: int = 4
    batch_size: int = 8
    block_size: int = 128
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337


def capture(cfg: CaptureConfig):
    torch.manual_seed(cfg.seed)
    mcfg = model_lib.model_config(cfg.preset, block_size=cfg.block_size)
    model = model_lib.Llama(mcfg)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
    start = 0
    if cfg.checkpoint:
        ckpt = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]
    data = train.load_data(cfg, mcfg.vocab_size)
    params = dict(model.named_parameters())
    schedule = train.TrainConfig(learning_rate=cfg.learning_rate, min_lr=cfg.min_lr,
                                 warmup_iters=cfg.warmup_iters,
                                 max_iters=start + cfg.train_steps + cfg.capture_steps)
    steps = []
    total = 0 if cfg.checkpoint else cfg.train_steps
    for step in range(start, start + total + cfg.capture_steps):
        workers = []
        for w in range(cfg.workers):
            x, y = train.get_batch(data["train"], cfg.batch_size, cfg.block_size,
                                   train.batch_rng(cfg.seed, w, step, 0), "cpu")
            model.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            workers.append({n: p.grad.detach().clone() for n, p in params.items()})
        for n, p in params.items():
            p.grad = sum(w[n] for w in workers) / cfg.workers
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = train.learning_rate(schedule, step)
        optimizer.step()
        if step >= start + total:
            steps.append(workers)
            print(f"captured step {step}: {cfg.workers} workers, loss {model(x, y)[1].item():.3f}")
        elif step % 50 == 0:
            print(f"train step {step}")
    optimizer_v = {n: optimizer.state[p]["exp_avg_sq"].clone() for n, p in params.items()}
    torch.save({"steps": steps, "optimizer_v": optimizer_v}, cfg.out)
    print(f"wrote {cfg.out}: {len(steps)} steps x {cfg.workers} workers x {len(params)} tensors")


def main(argv=None):
    try:
        cfg = train.parse_config(sys.argv[1:] if argv is None else argv, CaptureConfig,
                                 presets={name: {} for name in model_lib.PRESETS},
                                 choices={"preset": tuple(model_lib.PRESETS)})
        capture(cfg)
    except (train.ConfigError, train.ShardError) as e:
        sys.exit(f"nanogeo.capture: error: {e}")


if __name__ == "__main__":
    main()
