"""The shape of the code: compress.py (the teaching core) imports nothing from nanogeo/, not even
lazily; no import cycle among the repository's modules, static or inside a function; the
package never imports the top-level train.py."""
import ast
import os
import re
import subprocess
import sys

from conftest import ROOT


def repo_modules():
    """{module name: path} of the top-level files and the nanogeo package."""
    found = {}
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            found[name[:-3]] = os.path.join(ROOT, name)
    for folder, _, files in os.walk(os.path.join(ROOT, "nanogeo")):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


def imports_of(path, modules):
    """The repository modules a file imports anywhere in it (module level or in a function)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            out |= named or ({node.module} & set(modules))
    return out


def test_import_graph_has_no_cycle_and_compress_imports_nothing():
    modules = repo_modules()
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    assert graph["compress"] <= {"model"} and not any(m.startswith("nanogeo") for m in graph["compress"])
    assert not [m for m in graph if m.startswith("nanogeo") and "train" in graph[m]]
    state, path = {}, []

    def visit(m):                     # depth-first; a module met again on the path is a cycle
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            assert state.get(n) != "open", " -> ".join(path[path.index(n):] + [n])
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_compress_runs_on_its_own():
    """The teaching communicator on its own - each geometry through the simulator, forced, the
    whitening from K-FAC moments - and `python compress.py`, the demo a reader runs first; no
    nanogeo module loaded on the way (nothing imported lazily)."""
    code = """
import runpy, sys, torch, compress
g = torch.Generator().manual_seed(0)
workers = [[torch.randn(64, 96, generator=g) @ torch.diag(torch.logspace(-2, 1, 96))] for _ in range(4)]
moments = {"input": {"w": torch.eye(96) + 0.1}}
for geometry in ("subspace", "geofp8", "euclidean"):
    opts = compress.GeoOptions(geometry=geometry, min_numel=16, select="all", geo_judge="l2")
    comm = compress.Communicator([("w", (64, 96))], opts)
    for _ in range(6):
        means, sent = comm.reduce_workers(workers, moments if comm.moments_due() else None)
    assert torch.isfinite(means[0]).all() and sent > 0
    assert comm.sent_in_geometry("w") == (geometry != "euclidean"), geometry
runpy.run_path("compress.py", run_name="__main__")
assert not [m for m in sys.modules if m.startswith("nanogeo")], "compress.py loaded nanogeo"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stderr
    demo = out.stdout.splitlines()[:-1]
    assert demo[0].startswith("8 simulated ranks")
    rows = {}
    row = (r"  (\w+) +(\w*) +(forced|used|not used|-)(?:, gain ([0-9.]+)|, unmeasured)? +"
           r"L2 ([0-9.]+)x  Muon ([0-9.]+)x  ([0-9.]+)x bytes$")
    for line, reading in zip(demo, demo[1:]):   # each row: a line, then the line that reads it
        match = re.match(row, line)
        if match:
            geometry, fmt, how, gain, l2, muon, to_bf16 = match.groups()
            rows[geometry, fmt, how] = (gain and float(gain), float(l2), float(muon),
                                        float(to_bf16))
            assert reading.startswith("    ") and len(reading.split()) > 3, line
    assert set(rows) == {("bf16", "", "-"), ("euclidean", "e4m3", "-"), ("geofp8", "e4m3", "used"),
                         ("geofp8", "e4m3", "forced"), ("subspace", "e4m3", "used"),
                         ("subspace", "e4m3", "forced"), ("euclidean", "nvfp4", "-"),
                         ("subspace", "nvfp4", "forced")}
    # judged by Muon's update error, the rotation and the whitening measure better and are used
    # (the whitening is worse in L2: in plain L2 it would not be); each used gain clears 1.10
    assert rows["euclidean", "e4m3", "-"][1:3] == (1.0, 1.0)
    assert rows["subspace", "e4m3", "used"][2] < 1 and rows["subspace", "e4m3", "used"][0] > 1.1
    assert rows["geofp8", "e4m3", "used"][2] < 1 < rows["geofp8", "e4m3", "used"][1]
    # the bytes: FP8 about half of a bf16 ring's, NVFP4 under 0.30x
    assert rows["bf16", "", "-"][3] == 1.0 and 0.5 < rows["euclidean", "e4m3", "-"][3] < 0.53
    assert rows["euclidean", "nvfp4", "-"][3] < 0.30 and rows["bf16", "", "-"][1] < 1


def test_package_folders_and_old_paths():
    """The folders say what lives in them (nanogeo/__init__.py lists them), and every module
    that moved keeps importing under its old path with a DeprecationWarning naming the new one:
    the same module object, for `import a.b.c`, `from a.b import c` and `from a.b.c import X`."""
    import nanogeo
    folders = {n for n in os.listdir(os.path.dirname(nanogeo.__file__))
               if os.path.isdir(os.path.join(os.path.dirname(nanogeo.__file__), n))
               and not n.startswith("__")}
    assert folders == {"parallel", "geometry", "wire", "run", "smoke", "lab"}
    assert all(f"{f}/" in nanogeo.__doc__ for f in folders)
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import nanogeo.tools.study as old_study
    from nanogeo.tools import smoke as old_smoke, fidelity as old_fidelity
    from nanogeo.parallel.layers import ProductionSubspaceLayer
    from nanogeo.parallel import rows as old_rows
    import nanogeo.dist.eigensolver as old_eig
import nanogeo.lab.study, nanogeo.smoke, nanogeo.lab.fidelity, nanogeo.geometry.layers
import nanogeo.geometry.rows, nanogeo.geometry.eigensolver
assert old_study is nanogeo.lab.study and old_smoke is nanogeo.smoke
assert old_fidelity is nanogeo.lab.fidelity and old_rows is nanogeo.geometry.rows
assert old_eig is nanogeo.geometry.eigensolver
assert ProductionSubspaceLayer is nanogeo.geometry.layers.ProductionSubspaceLayer
said = " ".join(str(w.message) for w in caught if w.category is DeprecationWarning)
for old, new in [("nanogeo.tools.study", "nanogeo.lab.study"), ("nanogeo.parallel.layers",
                 "nanogeo.geometry.layers"), ("nanogeo.dist.eigensolver", "nanogeo.geometry.eigensolver")]:
    assert f"{old} is deprecated: import {new} instead" in said, (old, said)
try:
    from nanogeo.tools import nothing
except ImportError:
    pass
else:
    raise AssertionError("a missing module imported")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_python_m_of_an_old_path_runs_the_tool_with_the_warning():
    """`python -m nanogeo.tools.fidelity` (issue 59 item 8) runs nanogeo.lab.fidelity as
    __main__ - the same output - with the import's DeprecationWarning, shown by the default
    filters; so does a moved package with a __main__ (tools.smoke -> smoke); and every tool with
    a main has an old path that finds it."""
    import importlib.util
    import nanogeo
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*argv):
        return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                              text=True, env=env)
    old, new = run("nanogeo.tools.fidelity", "--help"), run("nanogeo.lab.fidelity", "--help")
    assert old.returncode == 0 and old.stdout == new.stdout and "usage:" in old.stdout, old.stderr
    assert ("DeprecationWarning: nanogeo.tools.fidelity is deprecated: run python -m "
            "nanogeo.lab.fidelity instead") in old.stderr and "Deprecation" not in new.stderr
    smoke = run("nanogeo.tools.smoke", "--help")
    assert smoke.returncode == 0 and "usage: python -m nanogeo.smoke" in smoke.stdout, smoke.stderr
    assert "nanogeo.tools.smoke is deprecated: run python -m nanogeo.smoke" in smoke.stderr
    tools = [m for m, p in repo_modules().items() if m.startswith(("nanogeo.lab", "nanogeo.smoke"))
             and "__main__" in open(p).read()]
    for tool in tools:      # the old path of every tool with a main resolves to it
        old_path = "nanogeo.tools" + tool.removeprefix("nanogeo.lab").removeprefix("nanogeo")
        assert nanogeo.renamed(old_path) == tool and importlib.util.find_spec(tool), tool


def test_renamed_public_attributes_keep_their_old_names_for_a_release():
    """The names 906d8c0 changed on what a user holds (a DDP hook's communicators, their layers,
    hooks' byte count) still read and write, each with a DeprecationWarning naming the new name
    (issue 59 item 8). The step counter's old name, `step`, was kept for 0.1 only: since 0.2 it
    is the method that takes a step, as compress.Communicator.step (issue 56, item 6)."""
    import warnings
    import pytest
    import torch
    import nanogeo
    from nanogeo.parallel import hooks
    from nanogeo.parallel.communicator import Options, ProductionCommunicator
    for geometry in ("subspace", "geofp8", "hadamard"):
        comm = ProductionCommunicator([("w", (48, 64)), ("b", (64,))], Options(
            geometry=geometry, geo_rank=8, min_numel=16, select="list", geo_layers=("w",)))
        comm.reduce_workers([[torch.randn(48, 64), torch.randn(64)]],
                            {"input": {"w": torch.eye(64)}} if comm.moments_due() else None)
        layer = comm.layers["w"]
        aliases = [(comm, "chosen", "listed"),
                   (comm, "kind", "layer_class"), (comm, "uses_moments", "from_moments"),
                   (layer, "ready", "built")]
        for obj, old, new in aliases:
            with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use "
                              f"{type(obj).__name__}.{new} instead"):
                assert getattr(obj, old) == getattr(obj, new)
        with pytest.warns(DeprecationWarning, match="is_geo is deprecated"):
            assert comm.is_geo("w") == comm.sent_in_geometry("w")
        with pytest.warns(DeprecationWarning, match="wants_moments is deprecated"):
            assert comm.wants_moments() == comm.moments_due()
        assert callable(comm.step) and isinstance(comm.steps_taken, int)
        with pytest.raises(AttributeError, match="step is a method since nanogeo 0.2.0; set "
                           "ProductionCommunicator.steps_taken"):
            comm.step = 7               # a resumed hook setting its counter, as in 0.1
        assert callable(comm.step)
    with pytest.warns(DeprecationWarning, match="statistics_bytes is deprecated: use "
                      "nanogeo.parallel.hooks.moments_bytes"):
        assert hooks.statistics_bytes is hooks.moments_bytes
    with warnings.catch_warnings():     # the new names, and the classes themselves, say nothing
        warnings.simplefilter("error")
        assert isinstance(type(comm).chosen, nanogeo.RenamedAttribute)
        with pytest.raises(AttributeError):
            hooks.nothing


def test_no_module_of_the_package_is_over_600_lines():
    """A module of nanogeo/ is read whole: none over 600 lines (issue 56; communicator.py was
    950 before its options and geometry step had modules of their own)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "nanogeo"
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
