"""nanogeo: the production path of GeoFP8 (tools and integrations).

The algorithm itself lives in the top-level `compress.py`; everything here imports it."""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings


class _RenamedPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`nanogeo.dist.*` became `nanogeo.parallel.*`; the old names keep importing, for one
    release, with a DeprecationWarning that names the new module: `import nanogeo.dist.ddp`
    hands back the module object of `nanogeo.parallel.ddp` itself (one module, one set of
    classes), without a dist/ folder. Drop this class and its registration in the next release."""

    OLD, NEW = "nanogeo.dist", "nanogeo.parallel"

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.OLD or fullname.startswith(self.OLD + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None                     # a placeholder; exec_module puts the real one in its place

    def exec_module(self, module):
        new = self.NEW + module.__name__[len(self.OLD):]
        # stacklevel 2: the importing line (the import system's own frames are skipped)
        warnings.warn(f"{module.__name__} is deprecated: import {new} instead (the old name "
                      "goes in the next release)", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)   # what the import returns


if not any(isinstance(f, _RenamedPackage) for f in sys.meta_path):
    sys.meta_path.insert(0, _RenamedPackage())
