"""
Convergence ablation: the same training run with each gradient communication method.

    python -m nanogeo.ablate --comms fp32,bf16,fp8,geofp8 --nproc 2 --out_dir out/ablate [-- TRAIN FLAGS]

Runs `torchrun --standalone --nproc_per_node=N train.py` once per method (same seed, same data,
same schedule; extra flags after `--` go to every run), reads each run's log.jsonl, and writes
out_dir/ablation.md (final train/val loss, gap to fp32, wire bytes per step, time per step) and,
with matplotlib installed, out_dir/loss.png. Methods: fp32, bf16, fp8, fp8-ef (with error
feedback), fp8-paper (the paper's FP8-sum collective), geofp8 (published), subspace (ours),
nvfp4, geo-nvfp4, subspace-nvfp4.
"""

import argparse
import json
import os
import subprocess
import sys

COMMS = {"fp32": ["--comm=fp32"], "bf16": ["--comm=bf16"], "fp8": ["--comm=fp8"],
         "fp8-ef": ["--comm=fp8", "--error_feedback"],
         "fp8-paper": ["--comm=fp8", "--fmt=e5m2", "--collective=fp8-sum"],
         "geofp8": ["--comm=geofp8"], "subspace": ["--comm=subspace"],
         "nvfp4": ["--comm=fp8", "--fmt=nvfp4"], "geo-nvfp4": ["--comm=geofp8", "--fmt=nvfp4"],
         "subspace-nvfp4": ["--comm=subspace", "--fmt=nvfp4"]}


def run(comm, nproc, out_dir, extra):
    run_dir = os.path.join(out_dir, comm)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "train.py", f"--out_dir={run_dir}", "--overwrite=true", *COMMS[comm], *extra]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl"))]
    return [r for r in records if "loss" in r], records[-1]["summary"]


def write_table(results, path):
    base = results.get("fp32")
    lines = ["| comm | final train loss | final val loss | val gap to fp32 | wire MB/step/rank | vs bf16 ring | ms/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for comm, (steps, summary) in results.items():
        gap = summary["final_val_loss"] - base[1]["final_val_loss"] if base else float("nan")
        last = steps[-1]
        ratio = last["wire_vs_bf16"] if last["wire_vs_bf16"] is not None else float("nan")
        lines.append(f"| {comm} | {summary['final_train_loss']:.4f} | {summary['final_val_loss']:.4f} | "
                     f"{gap:+.4f} | {last['wire_bytes'] / 1e6:.2f} | {ratio:.3f} | "
                     f"{summary['ms_per_step']:.0f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(results, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no loss plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for comm, (steps, _) in results.items():
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=comm, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (rank 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--comms", default="fp32,bf16,fp8,geofp8")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out_dir", default="out/ablate")
    args = parser.parse_args(argv)
    comms = args.comms.split(",")
    unknown = [c for c in comms if c not in COMMS]
    if unknown:
        parser.error(f"unknown comm {unknown[0]!r}; choose from {', '.join(COMMS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    results = {c: run(c, args.nproc, args.out_dir, extra) for c in comms}
    write_table(results, os.path.join(args.out_dir, "ablation.md"))
    plot(results, os.path.join(args.out_dir, "loss.png"))


if __name__ == "__main__":
    main()
