"""
What train.py prints and records: one pipe-separated line per logged step on rank 0, the same
numbers as JSON lines in out_dir/log.jsonl (a resumed run appends to it), the optional
downstream evaluation every --eval_every steps, and the closing summary: the final losses (the
validation loss averaged over the --final_evals last evaluations), the bytes each rank sent per
step averaged over the steps this process communicated (all of them but a step skipped for a
non-finite gradient), and the resolved configuration.
"""
import json
import math
import os
from dataclasses import asdict

import torch.distributed as dist

from nanogeo.run import runtime
from nanogeo.wire.collective import ring_allreduce_bytes


class RunLog:
    def __init__(self, cfg, master):
        self.cfg, self.master = cfg, master
        self.jsonl = None

    def print(self, text):
        if self.master:
            print(text, flush=True)

    def write(self, record):
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def start(self, model, params, world_size, device, data_parallel):
        """The run's header lines; opens log.jsonl (appended to when resuming)."""
        cfg = self.cfg
        if self.master:
            os.makedirs(cfg.out_dir, exist_ok=True)
            self.jsonl = open(os.path.join(cfg.out_dir, "log.jsonl"), "a" if cfg.resume else "w")
        self.print(f"config: {json.dumps(asdict(cfg))}")
        backend = dist.get_backend() if world_size > 1 else "-"
        self.print(f"model: {cfg.preset}, {model.num_params() / 1e6:.2f}M parameters | world_size "
                   f"{world_size} | device {device} | backend {backend}"
                   + (f" | simulating {data_parallel} data-parallel ranks"
                      if cfg.simulate_workers else ""))
        self.world_size, self.data_parallel = world_size, data_parallel
        self.tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * data_parallel
        self.flops_per_step = model.flops_per_token(cfg.block_size) * self.tokens_per_step
        self.peak = runtime.peak_flops(device)
        self.bf16_bytes = ring_allreduce_bytes(sum(p.numel() for p in params), 2, data_parallel)
        self.bytes_sent, self.steps_sent = 0, 0

    def geometry(self, step, communicator, as_sent):
        """A log.jsonl record of the coordinates every candidate layer's gradient was sent in on
        this step (as_sent: {name: "geo" | "euclidean"}, read before the reduce) and its last
        measured gain (null before the first, or not finite): a study's gain history."""
        if not self.jsonl:
            return
        gains = {n: layer.gain for n, layer in communicator.layers.items()}
        self.write({"geometry_at": step, "coords": {
            n: [coords, gains[n] if math.isfinite(gains[n]) else None]
            for n, coords in as_sent.items()}})

    def sent(self, wire_bytes):
        """Count one step's bytes (every collective of the step), for the summary's mean."""
        self.bytes_sent += wire_bytes
        self.steps_sent += 1

    def first_eval(self, val_loss):
        if val_loss is not None:
            self.print(f"step 0 | val loss {val_loss:.4f}")

    def step(self, done, train_loss, val_loss, lr, grad_norm, dt, wire_bytes):
        """One step's line: loss, lr, time, throughput, MFU (GPU) and bytes on the wire."""
        spread = self.data_parallel > 1
        record = {"step": done, "loss": train_loss, "val_loss": val_loss, "lr": lr,
                  "grad_norm": float(grad_norm), "dt_ms": 1000 * dt,
                  "tok_per_s": self.tokens_per_step / dt,
                  "mfu": (self.flops_per_step / dt / (self.peak * self.world_size)
                          if self.peak else None),
                  "wire_bytes": wire_bytes,
                  "wire_vs_bf16": wire_bytes / self.bf16_bytes if spread else None}
        mfu = f"{100 * record['mfu']:.1f}%" if self.peak else "-"
        ratio = f"{record['wire_vs_bf16']:.3f}" if spread else "-"
        self.print(f"step {done} | loss {train_loss:.4f} | val {val_loss:.4f} | lr {lr:.2e} | "
                   f"dt {1000 * dt:.0f}ms | tok/s {record['tok_per_s']:.0f} | mfu {mfu} | "
                   f"wire {wire_bytes / 1e6:.2f}MB ({ratio}x bf16)")
        self.write(record)

    def downstream(self, done, model, device):
        """Zero-shot scores (nanogeo.run.eval). Every rank scores its share of the requests (no rank
        waits on another's evaluation in a collective, which a long one would time out)."""
        from nanogeo.run import eval as downstream
        cfg = self.cfg
        scores = downstream.evaluate_model(model, cfg.eval_tasks.split(","), cfg.eval_limit,
                                           cfg.batch_size, device, quiet=True)
        self.print(f"step {done} | downstream | " + " | ".join(
            f"{t} {r.get('acc_norm', r['acc']):.4f}" for t, r in scores.items()))
        self.write({"step": done, "downstream": {
            t: {k: v for k, v in r.items() if not isinstance(v, list)} for t, r in scores.items()}})

    def finish(self, train_loss, final_vals, first_val, start_step, elapsed, checksum, ckpt_path,
               tail_vals=()):
        """The closing summary line and record; returns the summary (tests and tools read it).
        final_vals: [(step, val loss)] of the evaluations the final val loss is the mean of;
        tail_vals: those of the tail val loss (--tail_evals), if any."""
        steps_run = self.cfg.max_iters - start_step
        val_loss = sum(v for _, v in final_vals) / len(final_vals)
        mean_bytes = self.bytes_sent / max(1, self.steps_sent)
        summary = {"final_train_loss": train_loss, "final_val_loss": val_loss,
                   "final_val_losses": [list(e) for e in final_vals],
                   "initial_val_loss": first_val, "steps": steps_run,
                   "tokens_seen": steps_run * self.tokens_per_step, "time_s": elapsed,
                   "ms_per_step": 1000 * elapsed / max(1, steps_run), "param_sha256": checksum,
                   "mean_wire_bytes": mean_bytes,
                   "mean_wire_vs_bf16": (mean_bytes / self.bf16_bytes
                                         if self.data_parallel > 1 else None),
                   "config": asdict(self.cfg)}
        if tail_vals:
            summary["tail_val_loss"] = sum(v for _, v in tail_vals) / len(tail_vals)
            summary["tail_val_losses"] = [list(e) for e in tail_vals]
        evals = f" (mean of {len(final_vals)} evaluations)" if len(final_vals) > 1 else ""
        self.print(f"summary | train loss {train_loss:.4f} | val loss {val_loss:.4f}{evals}"
                   + (f" (from {first_val:.4f})" if first_val is not None else "")
                   + (f" | tail val loss {summary['tail_val_loss']:.4f} (mean of "
                      f"{len(tail_vals)})" if tail_vals else "")
                   + f" | {summary['tokens_seen']:,} tokens | {elapsed:.1f}s "
                   f"({summary['ms_per_step']:.0f}ms/step) | checkpoint {ckpt_path}")
        self.write({"summary": summary})
        if self.jsonl:
            self.jsonl.close()
        return summary
