"""
torch.compile for the packed FP8 codec (train.py --compile, nanogeo.tools.bench --compile).

The codec is a chain of small elementwise kernels (abs, amax, divide, clamp, cast); inductor
fuses each chain. The packed stages (nanogeo/wire/packing.py) call the two kernels through the
table KERNELS; compile_hot_path(True) fills it with torch.compile(dynamic=False) versions and
compile_hot_path(False) with the plain ones. Only this module's table changes: compress.py's
functions stay as written (the piece-by-piece path for row and tensor scaling, and the
transforms, run eagerly). The bytes are the same (tests/test_compress.py).

Fixed shapes: each distinct shape compiles once, on first use; a training run sees a fixed set
of shapes (its buckets), all in its first steps.
"""
import torch

import compress


EAGER = {"fp8_encode": compress.fp8_encode, "fp8_decode": compress.fp8_decode}
KERNELS = dict(EAGER)       # what the packed stages call: the plain or the compiled kernels
COMPILED = {}               # plain function -> its compiled version, made once
state = {"float8_eager": False}   # a GPU whose Triton cannot cast to float8 (below sm_89)


def compile_hot_path(enabled=True):
    """Switch the codec kernels between torch.compile (True) and eager (False)."""
    KERNELS.update(EAGER)
    state["float8_eager"] = enabled and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() < (8, 9)
    if not enabled:
        return
    if state["float8_eager"]:
        print("nanogeo.wire.kernels: this GPU (below sm_89) has no float8 casts in Triton: the FP8 "
              "codec runs eagerly", flush=True)
        return
    import torch._dynamo as dynamo   # imported only when compiling (about a second)
    # one compile per distinct shape: allow for the dozens of a real model's buckets
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    for name, plain in EAGER.items():
        if plain not in COMPILED:
            COMPILED[plain] = torch.compile(plain, dynamic=False)
        KERNELS[name] = COMPILED[plain]


def compiled():
    """Are the kernels compiled now?"""
    return any(KERNELS[name] is not plain for name, plain in EAGER.items())
