import os
import socket
import sys

import pytest
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    # what torchrun would set
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


def run_ranks(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in world_size fresh processes with a torchrun-like env.
    fn must live in an importable module (a test file is fine) and init its process group
    itself (train.train does) or through dist_init().

    A Python error in any rank fails the test at once. A rank killed by a *signal* is run again,
    once: gloo now and then aborts a process while it sets up its TCP pairs (SIGABRT,
    "terminate called without an active exception"; cf. pytorch/gloo#514), which says nothing
    about the code under test. A crash that repeats fails the test."""
    for attempt in (1, 2):
        try:
            mp.start_processes(_entry, args=(fn, world_size, free_port(), args),
                               nprocs=world_size, join=True, start_method="spawn")
            return
        except mp.ProcessExitedException as e:
            if attempt == 2 or not e.signal_name:
                raise
            print(f"run_ranks: rank {e.error_index} died with {e.signal_name}; running "
                  f"{fn.__name__} once more", file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small prepared dataset (a few Shakespeare-like paragraphs repeated), for fast runs."""
    import prepare_data
    root = tmp_path_factory.mktemp("corpus")
    text = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n"
            "And by opposing end them. To die, to sleep;\nNo more; and by a sleep to say we end\n"
            "The heart-ache and the thousand natural shocks\nThat flesh is heir to.\n\n")
    (root / "a.txt").write_text(text * 200)
    (root / "b.txt").write_text(text.upper() * 100)
    out = root / "shards"
    prepare_data.tokenize_files([str(root / "a.txt"), str(root / "b.txt")], str(out),
                                chunk_tokens=256, val_every=10)
    return str(out)
