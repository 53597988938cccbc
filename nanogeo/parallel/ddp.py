"""
GeoFP8 for any DistributedDataParallel model, as a DDP communication hook.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from nanogeo.parallel.ddp import CompressHookState, compress_hook

    model = DDP(model)
    state = CompressHookState(model, geo_rank=16)             # the subspace rotation (default)
    state = CompressHookState(model, geometry="geofp8")       # the published GeoFP8, or
    state = CompressHookState(model, geometry="hadamard")     # the geometry-agnostic control
    model.register_comm_hook(state, compress_hook)
    state.watch(optimizers)     # judge each layer by the error its optimizer sees

DDP hands the hook one bucket at a time: a flat buffer holding several parameters' gradients.
The hook names the parameters in the bucket, averages their gradients with compress.py's
two-stage FP8 collective (in geometry-aware coordinates where that measurably helps), writes the
mean back into the bucket and returns it as an already-completed future. Options are those of
Options (the same as train.py's flags): geometry, fmt, block, collective, select,
factor, refresh, warmup, error_feedback, vocabulary (names kept Euclidean, e.g. an untied output
head: hooks.vocabulary_layers), ...

Which matrices may go geometry-aware: the weights of nn.Linear modules (found by module type;
embedding tables and tied heads stay Euclidean), and of those the ones whose measured error -
as their optimizer sees it, after `state.watch(optimizers)` - drops by enough (compress.py section
5). Without watch() the check measures plain L2 error, which can mislead under AdamW.

The published method (geometry="geofp8") needs each linear layer's input second moment: the
state registers a forward pre-hook on every nn.Linear whose weight is a candidate (found by module
type) and collects a^T a on refresh steps; each bucket's communicator averages its layers'
moments over the ranks before it refreshes their factors. (The output side, G = E[delta delta^T],
is collected during the backward pass and is complete only after DDP's hooks have fired: the
hook supports the input side only.)

Buckets: DDP rebuilds its buckets once, after the first iteration, in the order gradients became
ready. Each distinct bucket gets its own communicator; when a new bucket appears, the geometry
and error-feedback state of its parameters move over from the communicators that held them, so
nothing learned is lost. Every rank sees the same buckets, so every rank builds the same state.
Parameters that received no gradient (find_unused_parameters=True) arrive as zeros and are sent
like any other.

Memory and streams: the per-parameter gradients DDP hands over are views of the bucket, so they
are averaged in place (no copies); the collective's wire buffers come from torch's caching
allocator. On GPU the hook runs on its own CUDA stream: DDP calls it from
the backward pass as each bucket fills, and on the compute stream the collectives would make
the rest of the backward wait for the network. The side stream first waits for the gradients
(the compute stream's work so far), then encodes, communicates and decodes while the backward
continues; the returned future carries the side stream's completion, and DDP's wait for it at
the end of backward makes the compute stream wait before the optimizer reads the gradients.
"""

import warnings

import torch
import torch.distributed as dist

import compress
from nanogeo.parallel import hooks
from nanogeo.run import summary
from nanogeo.parallel.communicator import OLD_GEOMETRY, Options, ProductionCommunicator


def check_candidates(names, module):
    """`linear=` names must be 2-D parameters of the module: a typo would leave everything
    Euclidean without a word."""
    shapes = {n: p.dim() for n, p in module.named_parameters()}
    bad = sorted(n for n in names if shapes.get(n) != 2)
    if bad:
        raise ValueError(f"nanogeo: linear= names {bad[0]!r}, which is not a matrix parameter "
                         "of the model; pass names from model.named_parameters()")


def check_vocabulary(names, module):
    """`vocabulary=` names must be parameters of the module: names taken from a wrapped model
    ("module.", "_orig_mod." in front) would leave the output head a candidate without a word."""
    params = dict(module.named_parameters())
    bad = sorted(n for n in names if n not in params)
    if bad:
        raise ValueError(f"nanogeo: vocabulary= names {bad[0]!r}, which is not a parameter of the "
                         "model; call hooks.vocabulary_layers on the bare model, before DDP, "
                         "fully_shard or torch.compile wrap it")


class CompressHookState:
    """What the hook keeps between calls: parameter names, one communicator per bucket layout,
    and the bytes sent (for logging). `linear`: the weight names that are candidates (default:
    every nn.Linear weight, found by module type); name weights of other matrix modules here -
    a GPT-2 Conv1D's (in, out) weight - to give them the subspace rotation or the Hadamard
    control, which need no input moments (the whitening needs nn.Linear layers)."""

    def __init__(self, model, process_group=None, linear=None, **options):
        module = model.module if hasattr(model, "module") else model
        self.options = Options.of(**options)
        self.process_group = process_group
        self.module = module
        self.names = {p: n for n, p in module.named_parameters()}
        self.trainable = sum(p.requires_grad for p in self.names)     # what DDP's buckets hold
        self.linear = set(hooks.linear_layers(module) if linear is None else linear)
        check_candidates(self.linear, module)
        check_vocabulary(self.options.vocabulary, module)
        self.views = {}             # name -> nanogeo.geometry.update_error.OptimizerView, from watch()
        self.communicators = {}     # tuple of names -> ProductionCommunicator
        self.owner = {}             # name -> the key of the communicator holding its state
        self.iteration = 0          # backward passes completed: the one step counter
        self.saved = None           # a loaded state_dict, handed out as buckets appear
        self.bytes_sent = 0         # since the last reset_bytes()
        self.streams = {}           # CUDA device -> the hook's side stream
        self.moments = None         # the whitened layers' K-FAC moments (geometry="geofp8")
        if self.options.feedback_stages != "1":
            raise ValueError("nanogeo.parallel.ddp: the DDP hook keeps error feedback's stage-1 "
                             "residuals only; use feedback_stages='1' (train.py runs stage 2's)")
        if self.options.geometry == "geofp8":
            if self.options.whiten_sides != "input":
                raise ValueError("nanogeo.parallel.ddp: the DDP hook whitens the input side only; "
                                 "use whiten_sides='input'")
            candidates = [n for n, p in module.named_parameters()
                          if compress.why_euclidean(n, tuple(p.shape), self.options, self.linear)
                          is None]
            if self.options.select == "fragile":
                raise ValueError("nanogeo.parallel.ddp: select='fragile' would pick top_k per bucket; "
                                 "profile with nanogeo.lab.profile and pass select='list', geo_layers=...")
            layers = hooks.linear_layers(module, candidates)
            other = sorted(set(candidates) - set(layers))
            if other:
                raise ValueError("nanogeo.parallel.ddp: the published whitening needs nn.Linear layers "
                                 f"(their inputs' moments), not {other[0]}; use "
                                 "geometry='subspace' or 'hadamard' for other matrices")
            self.moments = hooks.KroneckerMoments(layers, self.collecting).attach()
            # collected by the forward, not yet used by a bucket: {name: A}, {name: tokens}
            self.pending = {"input": {}, "tokens": {}}

    def collecting(self):
        """Collect moments in this forward pass? On refresh steps: every bucket's communicator
        counts the hook's one step counter, so they refresh together."""
        return self.iteration % self.options.geo_refresh == 0

    def moments_for(self, comm):
        """The moments of this bucket's whitened layers, if this step collected them."""
        if self.moments is None or not comm.moments_due():
            return None
        taken = self.moments.take()                  # what the forward just collected
        self.pending["input"].update(taken["input"])
        self.pending["tokens"].update(taken["tokens"]["input"])
        names = [n for n in comm.moment_layers() if n in self.pending["input"]]
        return {"input": {n: self.pending["input"].pop(n) for n in names},
                "tokens": {"input": {n: self.pending["tokens"].pop(n) for n in names}}}

    def communicator(self, names, shapes):
        key = tuple(names)
        comm = self.communicators.get(key)
        if comm is None:
            comm = ProductionCommunicator(list(zip(names, shapes)), self.options,
                                          self.process_group, linear=self.linear)
            comm.watch(self.views)
            comm.load_state_dict(self._state_for(names))
            self.communicators[key] = comm
            self.owner.update((n, key) for n in names)      # older buckets hand over
            self.communicators = {k: c for k, c in self.communicators.items()
                                  if any(self.owner[n] == k for n in k)}
            if len(self.owner) == self.trainable:             # a loaded state is all handed out
                self.saved = None
        return comm

    def _owned(self):
        """(communicator, the names whose state it holds now), oldest first."""
        return [(c, [n for n in k if self.owner[n] == k]) for k, c in self.communicators.items()]

    def _state_for(self, names):
        """The part of the hook's state (a loaded checkpoint, or the older buckets that held
        these parameters) that belongs to `names`, as a communicator state_dict."""
        state = self.state_dict()
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        return {"geometry": state["geometry"], "step": self.iteration,
                "layers": {n: s for n, s in state["layers"].items() if n in names},
                "proposals": {n: s for n, s in state["proposals"].items() if n in names},
                "residuals": {rank: {n: r for n, r in state["residuals"].items() if n in names}},
                "listed": state["listed"]}

    def state_dict(self):
        """Keyed by parameter name, with one step counter, whatever the bucket layout - like
        PowerSGD's state. Residuals are this rank's own (save one file per rank)."""
        saved = self.saved or {"layers": {}, "residuals": {}, "listed": ()}
        layers, residuals = dict(saved["layers"]), dict(saved["residuals"])   # then what ran since
        # new geometry awaiting its measurement (checkpoints before the rename: "candidates")
        proposals = dict(saved.get("proposals", saved.get("candidates", {})))
        # select="list"/"fragile": the names listed ("chosen" in checkpoints before the rename)
        listed = set(self.options.geo_layers) | set(saved.get("listed", saved.get("chosen", ())))
        for comm, names in self._owned():
            state = comm.state_dict()
            layers.update((n, s) for n, s in state["layers"].items() if n in names)
            for n in names:                     # this bucket's view of n replaces the older one
                proposals.pop(n, None)
            proposals.update((n, s) for n, s in state["proposals"].items() if n in names)
            for residual in state["residuals"].values():
                residuals.update((n, r) for n, r in residual.items() if n in names)
            listed |= set(state["listed"])
        return {"geometry": self.options.geometry, "iteration": self.iteration, "layers": layers,
                "proposals": proposals, "residuals": residuals, "listed": sorted(listed)}

    def load_state_dict(self, state):
        if OLD_GEOMETRY.get(state["geometry"], state["geometry"]) != self.options.geometry:
            raise ValueError(f"the hook state is for geometry={state['geometry']!r}, not "
                             f"{self.options.geometry!r}: resume with the same method")
        self.saved, self.iteration = state, state["iteration"]
        self.communicators, self.owner = {}, {}
        if self.moments is not None:    # nothing collected before the load may reach a refresh
            self.moments.take()
            self.pending = {"input": {}, "tokens": {}}

    def __getstate__(self):
        """Picklable, like PowerSGD's state: without the process group (the default group after
        unpickling), the CUDA streams and the optimizer views (watch() the new optimizers)."""
        state = dict(self.__dict__)
        state.update(process_group=None, streams={}, views={})  # views: call watch() again
        state["communicators"], state["owner"] = {}, {}
        state["saved"] = self.state_dict()
        return state

    def watch(self, optimizers):
        """Judge each layer by the error its optimizer sees (compress.py section 5): call once
        after building the optimizers. Without it, coordinates are chosen by plain L2 error."""
        self.views = hooks.optimizer_views(optimizers, self.module)
        for comm in self.communicators.values():
            comm.watch(self.views)
        return self

    def stream(self, device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def reset_bytes(self):
        nbytes, self.bytes_sent = self.bytes_sent, 0
        return nbytes

    def table(self):
        """Each parameter once, as the communicator holding it now reports it (one header)."""
        tables = [summary.layer_table(c, names) for c, names in self._owned() if names]
        if not tables:
            return ""
        header = tables[0].split("\n", 1)[0]
        return "\n".join([header] + [table.split("\n", 1)[1] for table in tables])


def compress_hook(state: CompressHookState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket through the communicator's compressed collective (Euclidean FP8 or
    NVFP4, the subspace rotation, the published GeoFP8, ...: state's Options). Returns a
    completed future."""
    params = bucket.parameters()
    names = [state.names[p] for p in params]
    comm = state.communicator(names, [tuple(p.shape) for p in params])
    buffer = bucket.buffer()
    moments = state.moments_for(comm)       # before the side stream: its tensors stay on ours
    if bucket.is_last():        # DDP calls the last bucket last: this backward is done
        state.iteration += 1
    if not buffer.is_cuda:
        state.bytes_sent += comm.reduce(bucket.gradients(), moments)   # views: in place
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    stream = state.stream(buffer.device)
    stream.wait_stream(torch.cuda.current_stream(buffer.device))   # the gradients are ready
    with torch.cuda.stream(stream):
        for side in (moments or {}).get("input", {}).values():
            side.record_stream(stream)      # allocated on the compute stream, used on ours
        state.bytes_sent += comm.reduce(bucket.gradients(), moments)
        # a CUDA-aware future: whoever waits on it waits for this stream's work so far
        future = torch.futures.Future(devices=[buffer.device])
        future.set_result(buffer)
    buffer.record_stream(stream)
    return future


class GeoFP8HookState(CompressHookState):
    """Deprecated: the old name of CompressHookState, which runs any geometry (the subspace
    rotation by default), not only the published GeoFP8. Kept for one release."""

    def __init__(self, *args, **kwargs):
        warnings.warn("nanogeo.parallel.ddp.GeoFP8HookState is now CompressHookState (and "
                      "geofp8_hook compress_hook); the old names will be removed",
                      DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)


def geofp8_hook(state, bucket):
    """Deprecated: the old name of compress_hook (see GeoFP8HookState)."""
    return compress_hook(state, bucket)
