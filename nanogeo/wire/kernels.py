"""
torch.compile for compress.py's hot path (train.py --compile, nanogeo.tools.bench --compile).

The FP8 codec is a chain of small elementwise kernels (abs, amax, divide, clamp, cast) and the
Householder reflection three thin matrix products; inductor fuses each chain. compress.py
writes them as plain functions; compile_hot_path(True) replaces them, in their modules, by
torch.compile(dynamic=False) versions, and compile_hot_path(False) puts the plain ones back.
Every caller looks them up by module attribute at call time, so nothing else changes, and the
numbers are the same (tests/test_compress.py: bytes equal, values within 1e-6).

Fixed shapes: each distinct shape compiles once, on first use; a training run sees a fixed set
of shapes (its buckets' pieces), all in its first steps.
"""
import importlib

import torch

HOT_PATH = {   # module -> its hot-path functions
    "compress": ("fp8_encode", "fp8_decode", "reflect"),
    "nanogeo.wire.packing": ("fp8_decode_groups",),
}
CASTS_FLOAT8 = {"fp8_encode", "fp8_decode", "fp8_decode_groups"}
EAGER = {}                  # (module, name) -> the plain function, while compiled
COMPILED = {}               # plain function -> its compiled version, made once
state = {"float8_eager": False}   # a GPU whose Triton cannot cast to float8 (below sm_89)


def compile_hot_path(enabled=True):
    """Switch the codec and transform kernels between torch.compile (True) and eager (False)."""
    restore_eager()
    state["float8_eager"] = enabled and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() < (8, 9)
    if not enabled:
        return
    if state["float8_eager"]:
        print("nanogeo.wire.kernels: this GPU (below sm_89) has no float8 casts in Triton: the FP8 codec "
              "runs eagerly, the transforms compiled", flush=True)
    import torch._dynamo as dynamo   # imported only when compiling (about a second)
    # one compile per distinct shape: allow for the dozens of a real model's pieces
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    for module_name, names in HOT_PATH.items():
        module = importlib.import_module(module_name)
        for name in names:
            if state["float8_eager"] and name in CASTS_FLOAT8:
                continue
            plain = EAGER[module_name, name] = getattr(module, name)
            if plain not in COMPILED:
                COMPILED[plain] = torch.compile(plain, dynamic=False)
            setattr(module, name, COMPILED[plain])


def restore_eager():
    """Put the plain functions back."""
    for (module_name, name), fn in EAGER.items():
        setattr(importlib.import_module(module_name), name, fn)
    EAGER.clear()
