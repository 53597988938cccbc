"""nanogeo: the production path of geometry-aware FP8 gradient communication.

The algorithms live in the top-level `compress.py`; everything here imports them. The folders:

    parallel/   the communicator and what plugs it into training: DDP and FSDP2 hooks, the
                model's K-FAC hooks, simulated ranks, the IEEE-fp32 guard
    geometry/   the coordinates (whitening, subspace rotation, Hadamard) and what builds and
                judges them: FSDP row blocks, the optimizer's update error,
                the check that every rank holds the same geometry
    wire/       the bytes: packed codecs, the two-stage collective, the paper's FP8-sum, NVFP4
    run/        train.py's pieces: config, runtime, checkpoints, logs, evaluation
    smoke/      the first thing to run on a GPU node (make gpu-smoke)
    lab/        studies, benchmarks and measurement tools, not needed to train
"""
import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module path -> new one; a module of a renamed package follows its package unless it is
# named here itself (the longest old prefix wins). Drop an entry a release after it was added.
RENAMED = {
    "nanogeo.dist": "nanogeo.parallel",
    **{f"nanogeo.{old}.{m}": f"nanogeo.geometry.{m}"
       for old in ("parallel", "dist")
       for m in ("layers", "rows", "eigensolver", "hadamard", "agreement", "update_error")},
    "nanogeo.tools": "nanogeo.lab",
    "nanogeo.tools.smoke": "nanogeo.smoke",
}


def renamed(fullname):
    """The new name of an old module path, or None."""
    old = max((o for o in RENAMED if fullname == o or fullname.startswith(o + ".")),
              key=len, default=None)
    return None if old is None else RENAMED[old] + fullname[len(old):]


def warn_renamed(old, new, how="import", stacklevel=2):
    """The DeprecationWarning an old name gives (a module path, or an attribute's name)."""
    warnings.warn(f"{old} is deprecated: {how} {new} instead (the old name goes in the next "
                  "release)", DeprecationWarning, stacklevel=stacklevel + 1)


class _RenamedPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules that moved keep importing under their old names (RENAMED), for one release, with
    a DeprecationWarning that names the new module: `import nanogeo.tools.study` hands back the
    module object of `nanogeo.lab.study` itself (one module, one set of classes), without an old
    folder. `python -m` of an old path runs the new module (get_code)."""

    def find_spec(self, fullname, path=None, target=None):
        if renamed(fullname) is not None:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None                     # a placeholder; exec_module puts the real one in its place

    def exec_module(self, module):
        new = renamed(module.__name__)
        # stacklevel 2: the importing line (the import system's own frames are skipped)
        warn_renamed(module.__name__, new)
        target = importlib.import_module(new)
        if any(o.startswith(module.__name__ + ".") for o in RENAMED):
            # a package whose modules went to several places (tools/ -> lab/ and smoke/): the
            # old package stays a name that finds each module where it went
            def attribute(name, old=module.__name__):
                try:
                    return importlib.import_module(renamed(f"{old}.{name}"))
                except ImportError:
                    raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
            module.__path__, module.__getattr__ = [], attribute
            return
        sys.modules[module.__name__] = target   # what the import returns

    def get_code(self, fullname):
        """What `python -m OLD.PATH` runs as __main__ (runpy asks the loader for it): a stub that
        warns, from __main__ so that the default filters show it, and runs the new module as
        __main__ (its own file, argv[0] and spec, as `python -m NEW.PATH` would)."""
        new = renamed(fullname)
        stub = (f"import runpy, nanogeo\n"
                f"nanogeo.warn_renamed({fullname!r}, {new!r}, 'run python -m', 1)\n"
                f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n")
        return compile(stub, f"<{fullname}, moved to {new}>", "exec")


class RenamedAttribute:
    """A public attribute or method's old name, kept for one release: `chosen = RenamedAttribute(
    "listed")` in a class body reads and writes `listed` with a DeprecationWarning
    (the class itself gets the descriptor, so that introspection stays quiet)."""

    def __init__(self, new):
        self.new = new

    def __set_name__(self, owner, old):
        self.old = f"{owner.__name__}.{old}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        warn_renamed(self.old, f"{type(obj).__name__}.{self.new}", how="use")
        return getattr(obj, self.new)

    def __set__(self, obj, value):
        warn_renamed(self.old, f"{type(obj).__name__}.{self.new}", how="use")
        setattr(obj, self.new, value)


class ReusedName:
    """A method that took over an attribute's old name (0.2.0: ProductionCommunicator.step, in
    0.1 the deprecated name of the step counter steps_taken): `step = ReusedName(step,
    "steps_taken")` after the def. Reading it gives the method, as the def alone would;
    assigning to it, the old use, raises AttributeError naming the attribute to set, instead of
    hiding the method behind a number until the next step calls it."""

    def __init__(self, method, moved_to, since="0.2.0"):
        self.method, self.moved_to, self.since = method, moved_to, since
        functools.update_wrapper(self, method)
        self.old = method.__qualname__      # (__set_name__ gives the class's own name)

    def __set_name__(self, owner, name):
        self.old = f"{owner.__name__}.{name}"

    def __get__(self, obj, owner=None):
        return self.method if obj is None else self.method.__get__(obj, owner)

    def __set__(self, obj, value):
        raise AttributeError(f"{self.old} is a method since nanogeo {self.since}; set "
                             f"{type(obj).__name__}.{self.moved_to}, the attribute it named "
                             "before (to patch the method, patch the class)")

    def __delete__(self, obj):
        self.__set__(obj, None)


if not any(isinstance(f, _RenamedPackage) for f in sys.meta_path):
    sys.meta_path.insert(0, _RenamedPackage())
