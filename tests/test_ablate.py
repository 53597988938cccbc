"""docs/ablate.md works as written: a user's ablation, followed step by step.

A copy of the repository's tracked code gets the page's code blocks pasted exactly where the
page says (each block follows a marker `<!-- ablate: FILE, above the line starting "TEXT" -->`),
then the page's marked commands run in the copy, in order (`<!-- ablate: run NAME -->`: a bash
block through bash, a python block through python), with this interpreter as `python`. The
page's corpus is the tests' tiny one (conftest.tiny_corpus), in the copy's data/shakespeare_char.
"""
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT, run_in_session

PAGE = os.path.join(ROOT, "docs", "ablate.md")
PASTE = re.compile(r'<!-- ablate: (\S+), above the line starting "([^"]+)" -->\n'
                   r"```python\n(.*?)```", re.S)
RUN = re.compile(r"<!-- ablate: run (\w+) -->\n```(bash|python)\n(.*?)```", re.S)
CODE = ("compress.py", "model.py", "train.py", "prepare_data.py", "nanogeo")   # what runs


def copy_repository(dest):
    """The tracked files of CODE, copied to dest (no data, outputs or caches)."""
    files = subprocess.run(["git", "ls-files", *CODE], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    assert "compress.py" in files, "git ls-files found no code to copy"
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(dest, name))


def paste(root, path, anchor, code):
    """Insert `code` above the one line of root/path that starts with `anchor`."""
    with open(os.path.join(root, path)) as f:
        lines = f.readlines()
    at = [i for i, line in enumerate(lines) if line.startswith(anchor)]
    assert len(at) == 1, f"docs/ablate.md: {path} has {len(at)} lines starting {anchor!r}, not 1"
    lines.insert(at[0], code + "\n")
    with open(os.path.join(root, path), "w") as f:
        f.writelines(lines)


def run(root, language, text, timeout=600):
    """One of the page's commands in the copy, as a user runs it; its stdout. In a session of
    its own: past `timeout` it is killed with every run it started."""
    env = {**os.environ, "PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = ["bash", "-c", text] if language == "bash" else ["python", "-c", text]
    done = run_in_session(command, root, env, timeout)
    assert done.returncode == 0, (f"docs/ablate.md: {text!r} failed:\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}\n{runs_log(root)}")
    return done.stdout


def runs_log(root):
    """The end of the study's runs.log (where a failed run's train.py error is), if any."""
    logs = list(root.glob("out/*/runs.log"))
    return logs[0].read_text()[-3000:] if logs else ""


def python_on_path(root):
    """root/bin/python: this interpreter (a script: a virtual environment's python finds its
    packages from the path it is started by)."""
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (root / "bin" / "python").chmod(0o755)


def test_the_ablation_page_runs_as_written(tmp_path, tiny_corpus):
    text = open(PAGE).read()
    pastes, commands = PASTE.findall(text), RUN.findall(text)
    assert [p[0] for p in pastes] == ["compress.py", "nanogeo/lab/study/arms.py"], pastes
    assert [c[0] for c in commands] == ["check", "study", "answer"], commands
    copy_repository(tmp_path)
    python_on_path(tmp_path)
    os.makedirs(tmp_path / "data")
    os.symlink(tiny_corpus, tmp_path / "data" / "shakespeare_char")
    for path, anchor, code in pastes:
        paste(tmp_path, path, anchor, code)
    out = {name: run(tmp_path, language, code) for name, language, code in commands}

    # the codec: exactly the bytes wire_nbytes counts, rounded to nearest (<= half a step)
    nbytes = re.search(r"^bytes (\d+) (\d+)$", out["check"], re.M)
    assert nbytes and nbytes[1] == nbytes[2] == str(8 * (4 + 256)), out["check"]
    assert float(out["check"].split("largest error in steps")[1]) <= 0.5, out["check"]
    # the comparison ends in its table, a row of numbers for the new arm
    table = out["study"].split("[6/6]")[-1]
    assert re.search(r"^\| int8-row \| 2 \| \d\.\d{4} ± \d\.\d{4} \| [+-]\d\.\d{4} ± ", table,
                     re.M), out["study"]
    assert (tmp_path / "out" / "int8" / "study.md").read_text() in out["study"]
    # the answer reads the same results at W = 4 and names the new arm
    assert "int8-row" in out["answer"], out["answer"]


def test_the_study_help_shows_the_defaults():
    """`python -m nanogeo.lab.study --help` says what each option is when it is not given."""
    from nanogeo.lab.study.cli import parse_args
    parser, _, _ = parse_args([])
    text = parser.format_help()
    options = {chunk.split()[0]: " ".join(chunk.split()) for chunk in text.split("\n  --")[1:]}
    for option, default in (("optimizers", "adamw"), ("seeds", "1337"), ("workers", "0"),
                            ("nproc", "2"), ("margin", "0.002"), ("endpoint", "final"),
                            ("answer_workers", "32"), ("out_dir", "out/ablate")):
        assert f"(default {default}" in options[option], options[option]
    assert "Flags after `--` go to every train.py run" in " ".join(text.split())
