"""
torch.compile for the packed FP8 codec (train.py --compile, nanogeo.lab.bench --compile).

The codec is a chain of small elementwise kernels (abs, amax, divide, clamp, cast) and the
wire's packing (each group's fp32 scale as 4 bytes before its codes: compress.fp8_pack); inductor
fuses an encode and its packing into one kernel, and an unpacking and its decode into another
(inductor's C++ backend, counted; Triton's may cut a graph in two, not measured).
The owner's stage 2 (decode the W copies it received, add them, divide, encode) is a third.
The packed stages (nanogeo/wire/packing.py) call the three through the table KERNELS:
compile_hot_path(True) fills it with torch.compile'd versions of the *_fused forms below (the
same bytes, written so that inductor can fuse the packing) and compile_hot_path(False) with the
plain ones, compress.py's functions. Only this module's table changes: compress.py's functions
stay as written (the piece-by-piece path for row and tensor scaling, and the transforms, run
eagerly). The bytes are the same (tests/test_compress.py, tests/test_gpu_contact.py).

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
already adds in other orders) and keeps Triton's faster division. Every op of the three compiled
graphs, and why its Triton code rounds as eager's CUDA code does (EXACT_OPS; a test fails when
a new op appears, so it gets the same audit):

    abs, amax, gt, where, clamp_min, clamp_max, full, unsqueeze, view(dtype)
                        exact: no rounding (a max is the same in any order)
    mul                 one IEEE rounding on both; no add follows it, so no fused multiply-add
    add                 (stage 2's sum of W decoded copies, in rank order) one IEEE rounding on
                        both; each summand is a division's result, so no multiply-add either
    reciprocal, div     IEEE division (div_rn) with EXACT_AS_EAGER, an approximation without it
    convert_element_type  fp32 -> fp8 to nearest even on both (sm_89+; below it the codec runs
                        eagerly, state["float8_eager"]); the values are clamped to +-fmax first,
                        so Triton's saturating cast and eager's are never told apart. fp8 -> fp32
                        is exact; uint8 <-> int32 (the packing's bytes) is exact.
    iota, lt, constant_pad_nd, bitwise_and, bitwise_or, shifts, view, slice, select
                        exact: the packing's integer arithmetic on a scale's bits, and copies
                        (a scale is never negative - 0 where amax is inf - so its top byte is
                        below 128 and no shift meets a sign bit; view(dtype) int32 <-> fp32 is
                        a bitcast)

No sqrt, exp2, log2 or pow is compiled (those go through libdevice, whose approximations may
differ from eager's by an ulp: eager_numerics.use_pytorch_libdevice). NVFP4 and the transforms
run eagerly.
"""
import sys

import torch

import compress


def any_group_count(compiled_kernel):
    """compiled_kernel(groups_or_codes, ...) with the groups' count G (dimension 0 of every
    tensor argument) marked dynamic before the call: one graph for all bucket sizes."""
    import torch._dynamo as dynamo

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                dynamo.maybe_mark_dynamic(a, 0)
        return compiled_kernel(*args)
    return call


# inductor options under which the compiled codec rounds every value as eager does (above)
EXACT_AS_EAGER = {"eager_numerics.division_rounding": True}
# the ops the codec's compiled graphs may hold: each audited above for Triton against eager
EXACT_OPS = frozenset({
    "aten.abs.default", "aten.amax.default", "aten.gt.Scalar", "aten.where.self",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.full.default", "aten.add.Tensor",
    "aten.unsqueeze.default", "aten.view.dtype", "aten.mul.Tensor", "aten.reciprocal.default",
    "aten.div.Tensor", "prims.convert_element_type.default",
    # the packing (encode_packed_fused, decode_packed_fused): integers and copies
    "aten.view.default", "aten.slice.Tensor", "aten.select.int", "prims.iota.default",
    "aten.lt.Scalar", "aten.constant_pad_nd.default", "aten.bitwise_and.Scalar",
    "aten.bitwise_or.Tensor", "aten.__rshift__.Tensor", "aten.__lshift__.Scalar"})


def encode_packed(groups, fmax, dtype):
    """(G, L) fp32 -> (G * (4 + L),) uint8: compress.fp8_encode, then fp8_pack's wire."""
    return compress.fp8_pack(*compress.fp8_encode(groups, fmax, dtype))


def decode_packed(wire, block, dtype):
    """encode_packed's inverse: the wire's (G, block) fp32 values (compress.fp8_decode)."""
    rows = wire.view(-1, 4 + block)
    scale = rows[:, :4].contiguous().view(torch.float32).view(-1)       # (G,)
    return compress.fp8_decode(rows[:, 4:], scale, dtype)


# The same bytes, written so that inductor can fuse the packing into the codec's kernel:
# fp8_pack's cat of the scales' bytes (a bitcast to a smaller dtype, which inductor leaves to an
# eager op and a copy) becomes a where over the row's columns, each scale byte cut from its bits
# by a shift; the decode assembles the scale from its bytes likewise. Little-endian bytes, as
# .view(torch.uint8) gives them on a little-endian host (x86, ARM; compile_hot_path keeps the
# codec eager on a big-endian one).

def encode_packed_fused(groups, fmax, dtype):
    scale, codes = compress.fp8_encode(groups, fmax, dtype)           # (G,), (G, L)
    column = torch.arange(4 + codes.shape[1], device=groups.device, dtype=torch.int32)
    shift = 8 * column.clamp(max=3)                                    # byte k: bits >> 8 k
    scale_bytes = ((scale.view(torch.int32)[:, None] >> shift) & 0xFF).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (4, 0))                     # (G, 4 + L)
    return torch.where(column < 4, scale_bytes, codes).view(-1)


def decode_packed_fused(wire, block, dtype):
    rows = wire.view(-1, 4 + block)
    b = rows[:, :4].to(torch.int32)                                    # the scale's 4 bytes
    scale = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)).view(torch.float32)
    return compress.fp8_decode(rows[:, 4:], scale, dtype)


def sum_in_rank_order(copies):
    """(W, ...) -> their sum over the first dimension, added left to right, copy 0 + copy 1 + ...:
    the order of the piece-by-piece path (compress.ShardLayout.sum_copies), so the sums are
    equal bit for bit. (torch's .sum(dim=0) adds in another order - in blocks of 16 or more rows
    on a CPU, a tree on a GPU - and rounds differently.)"""
    total = copies[0]
    for one_copy in copies[1:]:
        total = total + one_copy
    return total


def average_packed(received, world, block, dtype, fmax, divisor):
    """Stage 2's owner step on W = `world` received copies of its shard's wire (back to back):
    each decoded, added in rank order (sum_in_rank_order), divided by `divisor` (W as a 0-dim
    fp32 tensor: compress.count_divisor) and encoded - the wire of the mean."""
    total = sum_in_rank_order(decode_packed(received, block, dtype).view(world, -1, block))
    return encode_packed(total / divisor, fmax, dtype)  # (the copies freed: one bucket's peak)


def average_packed_fused(received, world, block, dtype, fmax, divisor):
    total = sum_in_rank_order(decode_packed_fused(received, block, dtype).view(world, -1, block))
    return encode_packed_fused(total / divisor, fmax, dtype)


EAGER = {"encode_packed": encode_packed, "decode_packed": decode_packed,
         "average_packed": average_packed}
FUSED = {"encode_packed": encode_packed_fused, "decode_packed": decode_packed_fused,  # compiled
         "average_packed": average_packed_fused}
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
    if sys.byteorder != "little":
        print("nanogeo.wire.kernels: a big-endian host: the FP8 codec runs eagerly (its fused "
              "packing cuts a scale's bytes little-endian)", flush=True)
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
            COMPILED[plain] = any_group_count(torch.compile(FUSED[name],
                                                            options=EXACT_AS_EAGER))
        KERNELS[name] = COMPILED[plain]


def compiled():
    """Are the kernels compiled now?"""
    return any(KERNELS[name] is not plain for name, plain in EAGER.items())
