"""
FP8 gradient reduce-scatter for FSDP2 (`fully_shard`), through its custom reduce-scatter API.

    from torch.distributed.fsdp import fully_shard
    from nanogeo.fsdp import FP8ReduceScatter

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    for module in [*model.layers, model]:
        module.set_custom_reduce_scatter(FP8ReduceScatter(fmt="e4m3", block=128))

FSDP2 hands the reduce-scatter one flat buffer per parameter group, laid out as W rows: row j
holds rank j's dim-0 shard of every parameter. Here each row is quantized with compress.py's
codec (scales inline, one uint8 buffer per destination), exchanged with one all_to_all, and each
rank decodes the W copies of its own row, sums them in fp32 and applies FSDP's reduce op. This is
stage 1 of the GeoFP8 collective (FSDP needs no all_gather of gradients): 1 + 4/block bytes per
element instead of 2 (bf16) or 4 (fp32).

Scope: Euclidean coordinates only, for now. Measured on our gradients (BENCHMARKS.md §2), a
one-sided rotation gains nothing (column side alone 1.00x, row side alone 0.95x of Euclidean
error; both sides 0.49x), so the column-side-only rotation that FSDP's dim-0 sharding would
allow for free is not worth building. The planned GeoFP8 version is two-sided: every rank holds
its *whole* local gradient before the reduce-scatter, so it can encode H = P^T G Q locally; the
decode P H_mean Q^T of a row shard needs Y^T H_mean = sum over shards of Y_j^T H_j, one all-reduce
of an r x n matrix per rotated matrix (r n floats against the shard's m n / W), and the basis
refresh needs all-reduces of n x r sketches and an all-gather of U (m x r). Not built yet.
The buffer layout here carries no parameter boundaries, so blocks may span two parameters' shards.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import compress


class FP8ReduceScatter(ReduceScatter):
    """A ReduceScatter for `FSDPModule.set_custom_reduce_scatter`. Counts bytes it sends."""

    def __init__(self, fmt="e4m3", block=128):
        compress.check_codec(fmt, block)
        self.fmt, self.block = fmt, block
        self.bytes_sent = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = group.size()
        rows = input_tensor.view(world, -1)                       # row j goes to rank j
        send = [compress.quantize(rows[j], self.fmt, self.block).buffer for j in range(world)]
        size = send[0].numel()  # every row has the same numel, so the same wire size
        recv = torch.empty(world * size, dtype=torch.uint8, device=input_tensor.device)
        dist.all_to_all_single(recv, torch.cat(send), group=group)
        shape = rows[0].shape
        total = None
        for piece in recv.split(size):  # fixed source order: identical numerics everywhere
            values = compress.dequantize(compress.Quantized(piece, shape, self.fmt, self.block))
            total = values if total is None else total + values
        if op in (dist.ReduceOp.AVG, "avg"):
            total = total / world
        output_tensor.copy_(total.to(output_tensor.dtype))
        self.bytes_sent += (world - 1) * size
        return None
