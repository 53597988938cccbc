import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """The CPU suite stays on the CPU on a GPU machine: unless this session selects the GPU
    twins (`pytest -m gpu`), CUDA is hidden before anything initialises it - in this process,
    in run_ranks' ranks (which set LOCAL_RANK to their rank: on a 1-GPU machine rank 1 would
    ask for a second GPU) and in the train.py subprocesses, which inherit the environment.
    The bit-equality tests compare gloo runs and emulations in IEEE fp32; on GPUs they would
    compare NCCL under TF32 with them. (nanogeo.run.runtime reads an empty
    CUDA_VISIBLE_DEVICES as GPUs hidden on purpose, not as a CPU-only torch on a GPU node.)"""
    markexpr = config.option.markexpr or ""
    if not ("gpu" in markexpr and "not gpu" not in markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, done_dir, args):
    # what torchrun would set
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    fn(rank, world_size, *args)
    open(os.path.join(done_dir, f"rank{rank}.done"), "w").close()   # fn returned on this rank
    # leave at once: the interpreter's teardown is where gloo's threads now and then abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in world_size fresh processes with a torchrun-like env.
    fn must live in an importable module (a test file is fine) and init its process group
    itself (train.train does) or through dist_init().

    A Python error in any rank fails the test at once. gloo now and then aborts a process while
    it sets up or tears down its TCP pairs (SIGABRT, "terminate called without an active
    exception"; cf. pytorch/gloo#514), which says nothing about the code under test: a rank
    killed by a *signal* after fn returned on every rank is a finished run; one killed before
    is run again, once, with the same arguments (safe for an abort at set-up, before fn wrote
    anything). A crash that repeats fails the test."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as done_dir:
            try:
                mp.start_processes(_entry, args=(fn, world_size, free_port(), done_dir, args),
                                   nprocs=world_size, join=True, start_method="spawn")
                return
            except mp.ProcessExitedException as e:
                finished = all(os.path.exists(os.path.join(done_dir, f"rank{r}.done"))
                               for r in range(world_size))
                if e.signal_name and finished:      # died at teardown, after its work
                    print(f"run_ranks: rank {e.error_index} died with {e.signal_name} after "
                          f"{fn.__name__} returned on every rank", file=sys.stderr)
                    return
                if attempt == 2 or not e.signal_name:
                    raise
                print(f"run_ranks: rank {e.error_index} died with {e.signal_name}; running "
                      f"{fn.__name__} once more", file=sys.stderr)


def run_in_session(command, cwd, env, timeout):
    """subprocess.run(command) in a session of its own: one that outlives `timeout` seconds is
    killed with every process it started (no rank left behind to load the machine for the tests
    after it), and its stderr says so. Returns the CompletedProcess."""
    with subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:      # the group ended between the timeout and the kill
                pass
            stdout, stderr = process.communicate()
            stderr += f"\n(killed after {timeout} s)"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one thread, as the ranks of run_ranks do: many compare runs bit for
    bit, and a float sum split over threads adds in another order - with a thread count that a
    BLAS library may choose by the machine's load. So no outcome depends on threads or load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY_TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
             "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n"
             "And by opposing end them. To die, to sleep;\nNo more; and by a sleep to say we end\n"
             "The heart-ache and the thousand natural shocks\nThat flesh is heir to.\n\n")


def tiny_shards(tmp_path_factory, tokenizer):
    """A few Shakespeare-like paragraphs, repeated, tokenized into train/val shards."""
    import prepare_data
    root = tmp_path_factory.mktemp(f"corpus-{tokenizer}")
    (root / "a.txt").write_text(TINY_TEXT * 200)
    (root / "b.txt").write_text(TINY_TEXT.upper() * 100)
    out = root / "shards"
    prepare_data.tokenize_files([str(root / "a.txt"), str(root / "b.txt")], str(out),
                                chunk_tokens=256, val_every=10, tokenizer=tokenizer)
    return str(out)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """The small dataset of the training tests, one token per character: with
    `--preset=char-study` (0.12M parameters; test_train.tiny_args) a step costs milliseconds,
    where cpu-tiny's 50257-word vocabulary made it seconds."""
    return tiny_shards(tmp_path_factory, "char")


@pytest.fixture(scope="session")
def bpe_corpus(tmp_path_factory):
    """The same text in GPT-2 BPE tokens: for what needs GPT-2's vocabulary (cpu-tiny's)."""
    return tiny_shards(tmp_path_factory, "gpt2")


# ---------------------------------------------------------------------------- a GPT-2 shape
# Hugging Face's GPT2LMHeadModel in plain torch.nn (transformers is not a dependency): its
# matrices are Conv1D modules holding (in, out) weights, y = x @ W + b; the head is tied to the
# token embedding; positions are a learned table. A model we did not design for GeoFP8.

import torch.nn as nn  # noqa: E402


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with its weight transposed."""

    def __init__(self, n_out, n_in):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.mlp_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(d, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class GPT2Shaped(nn.Module):
    def __init__(self, vocab=300, d=64, heads=4, layers=2, positions=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight                       # tied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def conv1d_weights(model):
    """The names of a GPT2Shaped model's Conv1D weights: what a user passes as `linear`."""
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Conv1D)}
