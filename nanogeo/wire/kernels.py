"""
torch.compile for the packed FP8 codec (train.py --compile, nanogeo.lab.bench --compile).

The codec is a chain of small elementwise kernels (abs, amax, divide, clamp, cast); inductor
fuses each chain. The packed stages (nanogeo/wire/packing.py) call the two kernels through the
table KERNELS; compile_hot_path(True) fills it with torch.compile'd versions and
compile_hot_path(False) with the plain ones. Only this module's table changes: compress.py's
functions stay as written (the piece-by-piece path for row and tensor scaling, and the
transforms, run eagerly). The bytes are the same (tests/test_compress.py).

Shapes: a group always holds `block` values (128), while the number of groups G follows the
bucket's size, and a DDP model can have a hundred bucket sizes. Compiled for fixed shapes, each G
would compile anew, and past dynamo's recompile limit every further size would run eagerly (a
recompile storm, then a silently slower codec). So G is marked dynamic: one compile per format
serves every bucket (dynamo specializes G = 1 apart), and a kernel's code does not depend on G:
the row's amax is over its `block` values, everything else is elementwise, so the bytes equal
eager's for every G (tests/test_gpu_contact.py, tests/test_compress.py).
"""
import torch

import compress


def any_group_count(compiled_kernel):
    """compiled_kernel(groups_or_codes, ...) with the groups' count G (dimension 0 of every
    tensor argument) marked dynamic before the call: one graph for all bucket sizes."""
    import torch._dynamo as dynamo

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                dynamo.maybe_mark_dynamic(a, 0)
        return compiled_kernel(*args)
    return call


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
    # a compile per format and dtype (and G = 1 apart): far below the limit, kept as headroom
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    for name, plain in EAGER.items():
        if plain not in COMPILED:
            COMPILED[plain] = any_group_count(torch.compile(plain))
        KERNELS[name] = COMPILED[plain]


def compiled():
    """Are the kernels compiled now?"""
    return any(KERNELS[name] is not plain for name, plain in EAGER.items())
