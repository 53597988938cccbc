"""
The path from train() to the first byte on the wire: the Python frames between train.train and
the first torch.distributed.all_to_all_single of the gradient reduction (issue 56 item 6), on 2
gloo ranks of one training step.

    python -m nanogeo.lab.frames [--impl reference|fast|both] [-- more train.py flags]

Prints, per --impl, the frames (file:function, outermost first) and their count; frames outside
the repository (torch's no_grad wrapper of reduce_gradients, any library's) are shown but not
counted, nor is the collective itself. Defaults: --preset=char-study --comm=fp8, one step, nothing written but a
scratch out_dir. docs/method.md gives the counts.
"""
import argparse
import inspect
import os
import runpy
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--preset=char-study", "--comm=fp8", "--max_iters=1", "--eval_interval=1000",
         "--eval_iters=1", "--final_evals=1", "--device=cpu", "--overwrite=true"]


def path_to_wire(stack):
    """[file:function] from train.train (outermost) to the caller of the collective."""
    frames = []
    for frame in reversed(stack):
        where = os.path.relpath(frame.filename, ROOT)
        if where == "train.py" and frame.function == "train":
            frames = []
        frames.append(f"{where}:{frame.function}")
    return frames


def rank_main(rank, world_size, port, impl, extra, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    collective, seen = dist.all_to_all_single, []

    def spy(*args, **kwargs):
        if rank == 0 and not seen:
            frames = path_to_wire(inspect.stack(0)[1:])
            counted = [f for f in frames if not f.startswith((".", os.sep))]    # ours only
            files = sorted({f.split(":")[0] for f in counted})
            # into a file that main() prints: a distributed train.py may leave with os._exit
            with open(os.path.join(out_dir, "frames.txt"), "w") as f:
                f.write(f"{len(counted)} frames in {len(files)} files: " + " -> ".join(frames))
            seen.append(frames)
        return collective(*args, **kwargs)

    dist.all_to_all_single = spy
    # train.py run as its command line runs it (the package never imports it)
    script = os.path.join(ROOT, "train.py")
    sys.argv = [script, *FLAGS, f"--impl={impl}", f"--out_dir={out_dir}", *extra]
    runpy.run_path(script, run_name="__main__")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--impl", default="both", choices=("reference", "fast", "both"))
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    for impl in ("reference", "fast") if args.impl == "both" else (args.impl,):
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(rank_main, args=(2, free_port(), impl, extra, out_dir), nprocs=2,
                               join=True, start_method="spawn")
            found = os.path.join(out_dir, "frames.txt")
            print(f"--impl={impl}: " + (open(found).read() if os.path.exists(found) else
                                         "no all_to_all_single reached (fp32, bf16, the FP8-sum "
                                         "collective and --simulate_workers send none)"))


if __name__ == "__main__":
    main()
