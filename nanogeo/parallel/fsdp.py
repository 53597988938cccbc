"""
Geometry-aware FP8 gradient reduce-scatter for FSDP2 (`fully_shard`), through its custom
reduce-scatter API: the subspace rotation (the default), the Hadamard control or Euclidean FP8 /
NVFP4. (The published GeoFP8, the whitening, runs under DDP and train.py: see
use_compressed_reduce_scatter.)

    from torch.distributed.fsdp import fully_shard
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter, watch_optimizers

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    comms = use_compressed_reduce_scatter(model, geo_rank=16, geo_warmup=10)  # after fully_shard
    watch_optimizers(comms, optimizers, model)       # judge each matrix as its optimizer sees it

What FSDP hands the reduce-scatter
----------------------------------
For each FSDP module, after backward, one flat buffer laid out as W rows: row j holds rank j's
dim-0 shard of every parameter's *local, unreduced* gradient (parameter k's shard is its rows
[j c_k, (j + 1) c_k), c_k = ceil(m_k / W), zero-padded). Rank j must end with the average of
row j over ranks.

Why the rotation fits FSDP's dim-0 sharding
-------------------------------------
Sharding by rows looks as if it forbids a rotation of the rows (the left side, P), and the
column side alone gives less (BENCHMARKS.md section 12, under FSDP2: the right side alone
0.76x Euclidean FP8's error at no decode cost, both sides 0.58x). But before the reduce-scatter
every rank holds its *whole* local gradient G (m x n), so it can encode H = P^T G Q exactly as
DDP does. Only the decode meets the sharding:

    rank j receives the averaged rows H_j of H and needs G_j = (P H Q^T)_j
    right side, row by row:     K_j = H_j Q^T                                  (local)
    left side, P = I - Y T Y^T: G_j = K_j - (Y_j T)(Y^T K), Y^T K = sum_j Y_j^T K_j
                                                            (r x n, summed over ranks)

plus the ~r^2 values that core scattering moved between the first and last rows
(swap_entries_rows). Both are batched over the module's matrices: two small
all-reduces per module and step. The bases are refreshed from the decoded mean rows with the
same subspace iteration, its products summed over ranks (RowBlocks: n x r all-reduces
and an m x r all-gather every `refresh` steps); every rank completes the same Householder bases.
The coordinates of each matrix are chosen as in DDP, by the codec error measured on each rank's
own local gradient in both systems, all-reduced.

The Hadamard control (geometry="hadamard", nanogeo/geometry/hadamard.py) fits the row shards as they
are: along the columns it transforms each row alone, so a rank decodes its rows of the mean with
the layer's own decode - no collective at all, and no statistics to refresh. Its rows option
(hadamard_sides="both") mixes rows across the shards and is refused.

The collective is stage 1 of compress.py's (FSDP needs no all_gather of gradients): each
parameter's shard is quantized on its own (block scales never span two parameters, and the
block grid is the one core scattering was planned for), exchanged in one all_to_all, decoded
and summed in fp32 in rank order: 1 + 4/block bytes per element against 2 (bf16) or 4 (fp32),
plus r n + ~r^2 fp32 numbers per geometry-aware matrix for the decode. FSDP runs all of it on
its reduce-scatter stream, overlapped with the rest of the backward pass.

Not supported (a clear error): error feedback (it would keep a full unsharded residual per
parameter, which is what FSDP exists to avoid), `full` / random bases (dense m x m), FSDP
placements other than the default Shard(0). If a call's buffer does not match the module's
parameters (some received no gradient), that call falls back to per-buffer Euclidean FP8.
"""

import functools
import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import compress
from nanogeo.parallel import hooks
from nanogeo.parallel.precision import ieee
from nanogeo.geometry.rows import RowBlocks, decode_geo_rows, swap_entries_rows
from nanogeo.run import summary
from nanogeo.parallel.ddp import check_candidates, check_vocabulary
from nanogeo.wire import collective
from nanogeo.parallel.communicator import Options, ProductionCommunicator

# why FSDP2 refuses the published GeoFP8 (geometry="geofp8") and its fp8-sum collective
FSDP_GEOMETRIES = (
    "nanogeo.parallel.fsdp: FSDP2 supports geometry='subspace' (the default), 'hadamard' or "
    "'euclidean', on the two-stage collective. The published GeoFP8 (geometry='geofp8') whitens "
    "each layer by its inputs' second moments, which FSDP's hooks do not collect yet, and its "
    "fp8-sum collective is an all-reduce, not a reduce-scatter: run it under DDP "
    "(nanogeo.parallel.ddp) or train.py")

CHECKED_TORCH = (2, 9)      # FSDP2's custom reduce-scatter and the internals below: 2.9 .. 2.13


def fsdp_params(module):
    """[(sharded parameter, original shape, shard dim)] of an FSDP module's one parameter group:
    the one place this file reads FSDP2 internals (private attributes; checked on torch 2.9 to
    2.13). [] for a module without parameters of its own."""
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version < CHECKED_TORCH:
        raise RuntimeError(f"nanogeo.parallel.fsdp needs torch >= {'.'.join(map(str, CHECKED_TORCH))} "
                           f"(FSDP2's custom reduce-scatter); this is {torch.__version__}")
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError("nanogeo.parallel.fsdp: a module needs exactly one FSDP parameter group; "
                             "call fully_shard(module) before use_compressed_reduce_scatter")
        return [(p.sharded_param, tuple(p._orig_size), p.fsdp_placement.dim)
                for group in groups for p in group.fsdp_params]
    except AttributeError as e:
        raise RuntimeError(f"nanogeo.parallel.fsdp: FSDP2's internals changed in torch {torch.__version__} "
                           f"({e}); use a torch between 2.9 and 2.13") from None


class FP8ReduceScatter(ReduceScatter):
    """Euclidean FP8 / NVFP4 for `FSDPModule.set_custom_reduce_scatter`, knowing nothing of the
    parameters: each row of FSDP's buffer is quantized as one flat tensor (so a block may span
    two parameters' shards). Counts the bytes it sends."""

    def __init__(self, fmt="e4m3", block=128):
        compress.check_codec(fmt, block)
        self.fmt, self.block = fmt, block
        self.bytes_sent = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = group.size()
        size = input_tensor.numel() // world                      # row j goes to rank j
        layout = row_chunks(((size,),), self.fmt, self.block, world)
        send = compress.quantize_bucket([input_tensor.reshape(-1)], layout)
        total = exchange_and_sum(send, layout, group)[0]
        output_tensor.copy_(average(total, op, world).to(output_tensor.dtype))
        self.bytes_sent += (world - 1) * layout.nbytes[0]
        return None


@functools.lru_cache(maxsize=256)
def row_chunks(chunk_shapes, fmt, block, world):
    """The compress.ShardLayout of FSDP's reduce-scatter: tensor k has world x c_k rows
    (chunk_shapes[k] = (c_k, ...)) and rank j owns the j-th chunk of c_k rows of every tensor,
    each quantized on its own (scaling blocks start at the chunk)."""
    pieces = [[] for _ in range(world)]
    for k, chunk in enumerate(chunk_shapes):
        numel = math.prod(chunk)
        # as compress.ShardLayout: "row" scaling of a 1-D tensor is one scale per chunk
        piece_block = ("row" if len(chunk) >= 2 else "tensor") if block == "row" else block
        shape = (chunk[0], numel // chunk[0]) if piece_block == "row" else (numel,)
        for j in range(world):
            if numel:
                pieces[j].append(compress.Piece(k, j * numel, (j + 1) * numel, shape, piece_block))
    shapes = [(world * chunk[0], *chunk[1:]) for chunk in chunk_shapes]
    return collective.layout(shapes, fmt, block, world, pieces)


def exchange_and_sum(send, layout, group):
    """Send rank j its shard of `send` (equal sizes) with one all_to_all; decode the W copies of
    this rank's pieces and sum them in rank order, fp32: the same numerics on every rank.
    Returns one flat tensor per piece (per tensor of the layout)."""
    me = group.rank()
    recv = torch.empty(group.size() * layout.nbytes[me], dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, send, group=group)
    return layout.sum_copies(recv, me)


def average(total, op, world):
    """Apply FSDP's reduce op to a sum over ranks (AVG unless a divide factor was set)."""
    if op in (dist.ReduceOp.AVG, "avg"):
        return total / compress.count_divisor(world, total)
    if op in (dist.ReduceOp.SUM, "sum"):
        return total
    raise ValueError(f"nanogeo.parallel.fsdp: unsupported reduce op {op}; "
                     "leave FSDP's gradient divide factor at its default")


class CompressedReduceScatter(FP8ReduceScatter):
    """The geometry-aware reduce-scatter of one FSDP module (its one parameter group). `options` are
    Options fields (train.py's flag names): geometry ("subspace", "hadamard" or "euclidean"),
    fmt, block, geo_rank, geo_refresh, geo_warmup, stochastic_round..."""

    def __init__(self, module, prefix="", linear=None, **options):
        options.setdefault("geometry", "subspace")   # the method built for FSDP's row shards
        if options.get("error_feedback") or options.get("full") or \
                options.get("basis", "householder") != "householder":
            raise ValueError("nanogeo.parallel.fsdp: error_feedback, full and random bases are not "
                             "supported with FSDP; drop those options")
        if options["geometry"] == "geofp8" or options.get("collective") == "fp8-sum":
            raise ValueError(FSDP_GEOMETRIES)
        if options.get("stage2_fmt", "") not in ("", options.get("fmt", "e4m3")):
            raise ValueError("nanogeo.parallel.fsdp: FSDP's reduce-scatter has no second stage to "
                             "send in stage2_fmt; drop stage2_fmt")
        if options.get("stochastic_stages", "both") == "2":
            raise ValueError("nanogeo.parallel.fsdp: FSDP's reduce-scatter has no second stage to "
                             "round stochastically; use stochastic_stages='both' or '1'")
        if options.get("geometry") == "hadamard" and options.get("hadamard_sides") == "both":
            raise ValueError("nanogeo.parallel.fsdp: hadamard_sides='both' mixes rows that live on "
                             "different ranks; use hadamard_sides='right'")
        params = fsdp_params(module)
        if not params:
            raise ValueError("nanogeo.parallel.fsdp: the module has no FSDP parameters; call "
                             "fully_shard(module) before use_compressed_reduce_scatter")
        if any(dim != 0 for _, _, dim in params):
            raise ValueError("nanogeo.parallel.fsdp: only FSDP's default Shard(0) placement is supported; "
                             "drop shard_placement_fn")
        names = {p: n for n, p in module.named_parameters(prefix=prefix)}
        self.names = [names[p] for p, _, _ in params]
        self.shapes = [shape for _, shape, _ in params]
        self.comm = ProductionCommunicator(list(zip(self.names, self.shapes)),
                                           Options.of(**options), linear=linear)
        super().__init__(self.comm.opts.fmt, self.comm.opts.block)
        self.geometry_bytes = 0     # the decode's small all-reduces, bytes sent (ring estimate)
        self.fallbacks = 0
        self.blocks = {}            # group -> {name: RowBlocks}: this rank's rows of each matrix

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world, me = group.size(), group.rank()
        per_rank = [-(-s[0] // world) for s in self.shapes]                  # c_k rows
        chunk_shapes = [(c, *s[1:]) for c, s in zip(per_rank, self.shapes)]
        if input_tensor.numel() != world * sum(math.prod(s) for s in chunk_shapes):
            self.fallbacks += 1                 # not every parameter got a gradient this time
            if self.fallbacks == 1:
                warnings.warn("nanogeo.parallel.fsdp: some parameters have no gradient; such calls "
                              f"send Euclidean {self.fmt}, rounded to nearest (counted in "
                              "`fallbacks`)")
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        self.comm.group = group
        rows = input_tensor.view(world, -1)
        sizes = [math.prod(s) for s in chunk_shapes]
        if group not in self.blocks:    # before any encode: the swaps must match the decode
            self.blocks[group] = {n: RowBlocks(s[0], group)
                                  for n, s in zip(self.names, self.shapes) if n in self.comm.layers}
            self._align_core_scattering(per_rank)
        # every parameter's whole local gradient, and the same in the coordinates in use
        grads, coords = [], []
        for name, shape, chunk, flat in zip(self.names, self.shapes, chunk_shapes,
                                            rows.split(sizes, dim=1)):
            g = flat.reshape(world * chunk[0], *shape[1:])[: shape[0]].float()   # (m, ...)
            grads.append(g)
            h = self.comm.to_coords(name, g)
            coords.append(torch.cat([h, h.new_zeros(world * chunk[0] - shape[0], *shape[1:])]))
        opts = self.comm.opts
        streams = collective.streams(opts.stochastic_round, self.comm.rounding_seed(),
                                     input_tensor.device, opts.stochastic_stages)
        layout = row_chunks(tuple(chunk_shapes), self.fmt, self.block, world).with_streams(
            streams, sender=me)
        send = compress.quantize_bucket(coords, layout)
        totals = [t.view(c) for t, c in zip(exchange_and_sum(send, layout, group), chunk_shapes)]
        self.bytes_sent += (world - 1) * layout.nbytes[0]
        # this rank's rows of every mean, back in original coordinates
        means = {name: average(total, op, world)[: max(0, min(c, shape[0] - me * c))]
                 for name, shape, c, total in zip(self.names, self.shapes, per_rank, totals)}
        blocks = self.blocks[group]
        means.update(self._decode([n for n in self.comm.layers if self.comm.sent_in_geometry(n)],
                                  means, blocks, world))
        out = [torch.cat([means[n].reshape(-1),
                          means[n].new_zeros(c * math.prod(s[1:]) - means[n].numel())])
               for n, s, c in zip(self.names, self.shapes, per_rank)]
        output_tensor.copy_(torch.cat(out).to(output_tensor.dtype))
        self.comm.advance(means, [grads], across_ranks=True, rows=blocks)
        return None

    def _align_core_scattering(self, per_rank):
        """FSDP quantises each rank's chunk of rows with scaling blocks that start at the chunk,
        but core scattering plans on the whole tensor's block grid (compress.core_swaps). Where
        a chunk is not a whole number of blocks the two grids differ and a scattered core entry
        could share a block: scattering is turned off for that matrix (one notice; the decode
        stays exact, the matrix only loses that refinement)."""
        block = self.comm.opts.scale_block
        if not isinstance(block, int):
            return                      # row / tensor scaling: nothing to align
        for name, shape, rows in zip(self.names, self.shapes, per_rank):
            layer = self.comm.layers.get(name)
            if layer is not None and layer.swaps is not None and rows * math.prod(shape[1:]) % block:
                layer.swaps = None
                warnings.warn(f"nanogeo.parallel.fsdp: {name}: a rank's {rows} rows are not a whole number "
                              f"of {block}-element scaling blocks; core scattering is off for it")

    @ieee       # the coordinates in IEEE fp32 (precision.py)
    def _decode(self, names, means, blocks, world):
        """The geometry-aware matrices' rows back to original coordinates. A layer whose decode
        acts on each row alone (row_local: the Hadamard control, a rotation of the columns only)
        decodes this rank's rows itself; the others need two all-reduces for all of them (the
        scattered core entries, then Y^T K)."""
        decoded = {n: self.comm.layers[n].decode(means[n]) for n in names
                   if self.comm.layers[n].row_local}
        names = [n for n in names if n not in decoded]
        layers = [self.comm.layers[n] for n in names]
        H = swap_entries_rows([(means[n], layer.swaps_for(layer.transform), blocks[n])
                               for n, layer in zip(names, layers)])
        G = decode_geo_rows([(h, *layer.transform, blocks[n])
                             for h, n, layer in zip(H, names, layers)])
        for layer in layers:  # the two small all-reduces' bytes (ring estimate), for logging
            small = (layer.r * layer.shape[1] if layer.transform[0] is not None else 0) + \
                (2 * layer.swaps[0].numel() if layer.swaps_for(layer.transform) is not None else 0)
            self.geometry_bytes += collective.ring_allreduce_bytes(small, 4, world)
        return {**decoded, **dict(zip(names, G))}

    def table(self):
        return summary.layer_table(self.comm)


def use_compressed_reduce_scatter(model, linear=None, **options):
    """Give every FSDP module of `model` (after fully_shard) a CompressedReduceScatter. Options as
    Options. Candidates: the weight names in `linear`, by default every nn.Linear
    weight (found by module type; name a GPT-2 Conv1D's weights here to rotate them too); pass
    vocabulary=hooks.vocabulary_layers(model, batch), found on the bare model before
    fully_shard, to keep an untied output head Euclidean. Returns the reduce-scatters (their
    bytes_sent, geometry_bytes and table() are for logging; watch_optimizers)."""
    linear = set(hooks.linear_layers(model) if linear is None else linear)
    check_candidates(linear, model)
    check_vocabulary(options.get("vocabulary", ()), model)
    comms = []
    for prefix, module in model.named_modules():
        if isinstance(module, FSDPModule) and fsdp_params(module):
            comm = CompressedReduceScatter(module, prefix, linear, **options)
            module.set_custom_reduce_scatter(comm)
            comms.append(comm)
    if not comms:
        raise ValueError("nanogeo.parallel.fsdp: no FSDP module with parameters; call fully_shard first")
    return comms


def use_geofp8(model, linear=None, **options):
    """Deprecated: the old name of use_compressed_reduce_scatter, which does not run the published
    GeoFP8 (see FSDP_GEOMETRIES). Kept for one release."""
    warnings.warn("nanogeo.parallel.fsdp.use_geofp8 is now use_compressed_reduce_scatter (it runs "
                  "the subspace rotation, the Hadamard control or Euclidean FP8, not the published "
                  "GeoFP8); use_geofp8 will be removed", DeprecationWarning, stacklevel=2)
    return use_compressed_reduce_scatter(model, linear, **options)


def watch_optimizers(comms, optimizers, model):
    """Judge each matrix by the error its optimizer sees (compress.py section 5). Under FSDP each
    rank weighs the rows it owns - its shard of AdamW's second moments against the same rows of
    its own gradient's codec error - and the gain check's all-reduce adds the ranks' row blocks
    up; Muon, which needs whole matrices, is judged in L2."""
    views = hooks.optimizer_views(optimizers, model)
    for comm in comms:
        comm.comm.watch(views)


def state_dict(comms):
    """The geometry of every FSDP module's reduce-scatter, keyed by parameter name (identical
    on every rank: save it from rank 0 next to the model's checkpoint)."""
    return {"modules": {",".join(c.names): c.comm.state_dict() for c in comms}}


def load_state_dict(comms, state):
    """Give each reduce-scatter (from use_compressed_reduce_scatter on the same model) its saved
    geometry."""
    saved = state["modules"]
    missing = [",".join(c.names) for c in comms if ",".join(c.names) not in saved]
    if missing:
        raise ValueError(f"nanogeo.parallel.fsdp: the saved state has no module with parameters "
                         f"{missing[0][:80]}...; load it into the model it was saved from")
    for c in comms:
        c.comm.load_state_dict(saved[",".join(c.names)])
