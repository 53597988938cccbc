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

Exact as eager on every backend. Compiled code is not eager code on a GPU: inductor's Triton
backend lowers a float32 division to an approximate one (div.full.f32) unless
`torch._inductor.config.eager_numerics.division_rounding` is set, while eager CUDA divides as
IEEE says (to nearest) and the CPU's C++ backend does too - which is why no CPU test could see
it. The codec divides twice: the scale fmax / amax (traced as reciprocal(amax) * fmax, and a
reciprocal is lowered as a division 1 / amax) and the decode, codes / scale. So the codec is
compiled with EXACT_AS_EAGER, inductor options that hold for its compiles only, not for the
model's torch.compile: the wire bytes must equal eager's (the simulator, every recorded run and
a run without --compile are the reference), the model's forward need not (its compiled graph
already adds in other orders) and keeps Triton's faster division. Every op of the two compiled
graphs, and why its Triton code rounds as eager's CUDA code does (EXACT_OPS; a test fails when
a new op appears, so it gets the same audit):

    abs, amax, gt, where, clamp_min, clamp_max, full, unsqueeze, view(dtype)
                        exact: no rounding (a max is the same in any order)
    mul                 one IEEE rounding on both; no add follows it, so no fused multiply-add
    reciprocal, div     IEEE division (div_rn) with EXACT_AS_EAGER, an approximation without it
    convert_element_type  fp32 -> fp8 to nearest even on both (sm_89+; below it the codec runs
                        eagerly, state["float8_eager"]); the values are clamped to +-fmax first,
                        so Triton's saturating cast and eager's are never told apart. fp8 -> fp32
                        is exact.

No sqrt, exp2, log2 or pow is compiled (those go through libdevice, whose approximations may
differ from eager's by an ulp: eager_numerics.use_pytorch_libdevice). NVFP4 and the transforms
run eagerly.
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


# inductor options under which the compiled codec rounds every value as eager does (above)
EXACT_AS_EAGER = {"eager_numerics.division_rounding": True}
# the ops the codec's compiled graphs may hold: each audited above for Triton against eager
EXACT_OPS = frozenset({
    "aten.abs.default", "aten.amax.default", "aten.gt.Scalar", "aten.where.self",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.full.default",
    "aten.unsqueeze.default", "aten.view.dtype", "aten.mul.Tensor", "aten.reciprocal.default",
    "aten.div.Tensor", "prims.convert_element_type.default"})

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
            COMPILED[plain] = any_group_count(torch.compile(plain, options=EXACT_AS_EAGER))
        KERNELS[name] = COMPILED[plain]


def compiled():
    """Are the kernels compiled now?"""
    return any(KERNELS[name] is not plain for name, plain in EAGER.items())
