"""
What GeoFP8 reads from the model and its optimizers, as torch hooks and adapters:

  * linear_layers: the model's nn.Linear weights, found by module type (never by name or
    shape): the matrices that may use a geometry, and the layers whose inputs K-FAC reads;
  * vocabulary_layers: the weights that read or write the vocabulary (nn.Embedding, and a
    linear layer whose output the model returns: an untied output head), found by module type
    and one forward, so they stay Euclidean whatever the model's width;
  * KroneckerMoments: the K-FAC moments of linear layers (A = E[a a^T] of the inputs, G =
    E[delta delta^T] of the output gradients) that the published method whitens with, collected
    by forward hooks (compress.py section 3);
  * average_moments: those moments averaged over the ranks (token-weighted, one
    all-reduce), so that every rank computes the same factors (ProductionCommunicator
    calls it; average_worker_moments does the same for simulated ranks; moments_bytes
    counts what that all-reduce sends);
  * optimizer_views: each parameter's optimizer (AdamW or Muon) as an OptimizerView, so
    that the per-layer choice is judged by the error that optimizer sees (compress.py
    section 5).
"""
import contextlib
import functools
import warnings

import torch

import compress
import nanogeo
from nanogeo.geometry import agreement
from nanogeo.parallel.precision import ieee
from nanogeo.geometry.update_error import OptimizerView
from nanogeo.wire.collective import ring_allreduce_bytes


def linear_layers(model, names=None):
    """{weight name: the nn.Linear owning it}, found by module type (never by name or shape),
    restricted to `names` if given. A weight shared with another module (a tied embedding) is
    left out: its gradient is not one layer's sum of delta a^T."""
    owners = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    found = {}
    for name, param in model.named_parameters():
        modules = owners.get(id(param), [])
        if (len(modules) == 1 and isinstance(modules[0], torch.nn.Linear)
                and param is modules[0].weight and (names is None or name in names)):
            found[name] = modules[0]
    return found


def vocabulary_layers(model, *example):
    """The names of the weights that read or write the vocabulary, found by module type and
    one forward of `example` (e.g. one token) in eval mode, without gradients: an nn.Embedding
    that reads one of the example's tensors (the token embedding; a position table reads
    positions), and an nn.Linear (linear_layers) whose output is one of the model's outputs (an
    untied output head, whose rows are the vocabulary; a tied one is the embedding's weight).
    Neither a name nor a shape is consulted, so a model whose width equals its vocabulary size
    (char-wide: 128 and 128) keeps its other matrices as candidates.

    Call it on the bare model, before DDP, fully_shard or torch.compile wrap it (their
    parameter names differ, and a DDP forward is a collective). A head whose output the model
    changes before returning it (a soft cap, a cast) is not found - a warning says so - so name
    it yourself (Options(vocabulary=...))."""
    names = {id(p): n for n, p in model.named_parameters()}    # a tied weight: its first name
    modules = [m for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))]
    weight_of = {m: names.get(id(m.weight)) for m in modules}   # read before the forward
    linear = set(linear_layers(model))
    seen = []       # (module, input, output): holding them keeps their ids from being reused
    hooks = [m.register_forward_hook(
                 lambda m, args, out: seen.append((m, args[0] if args else None, out)))
             for m in modules]
    training = {m: m.training for m in model.modules()}
    devices = [t.device for t in example if isinstance(t, torch.Tensor) and t.is_cuda]
    try:        # eval mode, random streams kept: no dropout draw, no running statistic moves
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices[:1]):
            returned = torch.utils._pytree.tree_leaves(model(*example))
    finally:
        for hook in hooks:
            hook.remove()
        for m, mode in training.items():
            m.train(mode)
    tokens = [weight_of[m] for m, x, _ in seen
              if isinstance(m, torch.nn.Embedding) and any(x is e for e in example)]
    heads = [weight_of[m] for m, _, out in seen
             if weight_of[m] in linear and any(out is r for r in returned)]
    tied = any(isinstance(m, torch.nn.Linear) and weight_of[m] in tokens for m in modules)
    if tokens and not heads and not tied:
        warnings.warn("vocabulary_layers: no nn.Linear's output is the model's output (a head "
                      "that is cast or capped after it?); if the model has an untied output "
                      "head, pass its weight's name in Options(vocabulary=...) yourself")
    return list(dict.fromkeys(tokens + heads))


class KroneckerMoments:
    """Collects the K-FAC moments of some linear layers: input[name] = sum of a a^T over
    tokens (a forward pre-hook on the layer's input) and output[name] = sum of delta delta^T (a
    hook on the gradient of the layer's output), in fp32, with token counts. Only training
    forwards with autograd on count (an evaluation in between adds nothing), and only while
    `active()` is true. take() returns the per-token means collected since the last take().
    `layers` maps weight names to nn.Linear modules (see linear_layers).

    The hooks exist between attach() and detach(). train.py attaches them for the forward
    passes of refresh steps only, which it runs eagerly, so a torch.compile'd graph never
    contains them; the DDP hook keeps them attached and lets `active()` decide."""

    def __init__(self, layers, active=None, sides=("input",)):
        self.layers, self.active, self.sides = layers, active, sides
        self.sums, self.counts, self.handles = {}, {}, []

    def attach(self):
        for name, module in self.layers.items():
            # partials of methods, not closures: a model with these hooks still pickles
            if "input" in self.sides:
                self.handles.append(module.register_forward_pre_hook(
                    functools.partial(self._input_hook, name)))
            if "output" in self.sides:
                self.handles.append(module.register_forward_hook(
                    functools.partial(self._output_hook, name)))
        return self

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @contextlib.contextmanager
    def attached(self):
        """with moments.attached(): forwards here record their moments."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def _collecting(self, module):
        return module.training and torch.is_grad_enabled() and (self.active is None or self.active())

    @ieee       # x^T x in IEEE fp32, also where the model's matmuls use TF32 (precision.py)
    def _add(self, key, x):
        with torch.autocast(x.device.type, enabled=False):    # fp32 sums, also under autocast
            x = x.detach().reshape(-1, x.shape[-1]).float()      # (tokens, d)
            self.sums[key] = self.sums.get(key, 0) + x.T @ x
        self.counts[key] = self.counts.get(key, 0) + x.shape[0]

    def _input_hook(self, name, module, args):
        if self._collecting(module):
            self._add(("input", name), args[0])

    def _output_hook(self, name, module, args, out):
        if self._collecting(module) and out.requires_grad:
            out.register_hook(functools.partial(self._add, ("output", name)))

    def take(self):
        """{"input": {name: A}, "output": {name: G}, "tokens": {side: {name: count}}}: the
        means per token since the last take(); empty if nothing came."""
        means = {"input": {}, "output": {}, "tokens": {"input": {}, "output": {}}}
        for (side, name), total in self.sums.items():
            means[side][name] = total / self.counts[(side, name)]
            means["tokens"][side][name] = self.counts[(side, name)]
        self.sums, self.counts = {}, {}
        return means


OPTIMIZER_KINDS = {"AdamW": "adamw", "Adam": "adamw", "Muon": "muon"}


def optimizer_views(optimizers, model):
    """{parameter name: OptimizerView} for the AdamW/Adam/Muon parameters of `optimizers`
    (other optimizer classes: none, and their layers are judged in plain L2)."""
    names = {p: n for n, p in model.named_parameters()}
    views = {}
    for opt in optimizers:
        kind = OPTIMIZER_KINDS.get(type(opt).__name__)
        for group in opt.param_groups if kind else ():
            for p in group["params"]:
                views[names[p]] = OptimizerView(kind, functools.partial(param_group, opt, p),
                                                functools.partial(param_state, opt, p))
    return views


def param_state(optimizer, param):
    """The optimizer's state of one parameter now (functions, so views pickle)."""
    return optimizer.state.get(param, {})


def param_group(optimizer, param):
    """The param group holding `param` now (load_state_dict replaces the group dicts)."""
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


def average_worker_moments(worker_moments, shapes, sides, device):
    """average_moments for W simulated ranks (worker_moments[i]: rank i's), with the same
    arithmetic: each rank's vector of count-weighted sums, added in rank order."""
    vectors = []
    for moments in worker_moments:
        average_moments(moments, shapes, sides, lambda flat: vectors.append(flat.clone()), device)
    total = vectors[0]
    for v in vectors[1:]:
        total = total + v
    return average_moments(worker_moments[0], shapes, sides, lambda flat: flat.copy_(total), device)


def moment_slots(shapes, sides):
    """The fixed list of (side, layer name, d) slots that average_moments all-reduces: a d x d
    moment per slot (d: the layer's input width, or output width for the output side)."""
    return [(side, n, shape[1] if side == "input" else shape[0])
            for side in sides for n, shape in shapes.items()]


def moments_bytes(communicator, world_size):
    """Bytes one rank sends in average_moments' all-reduce for a ProductionCommunicator's
    whitened layers (ring estimate): every slot's d x d fp32 sum and its fp32 token count. The
    collective's own bytes leave it out; train.py adds it on the steps that average moments."""
    shapes = {n: communicator.shapes[n] for n in communicator.moment_layers()}
    slots = moment_slots(shapes, communicator.whitened_sides())
    numel = sum(d * d for _, _, d in slots) + len(slots)
    return ring_allreduce_bytes(numel, 4, world_size) if slots else 0


def __getattr__(name):
    """statistics_bytes, moments_bytes' old name, for one release."""
    if name == "statistics_bytes":
        nanogeo.warn_renamed(f"{__name__}.statistics_bytes", f"{__name__}.moments_bytes", "use")
        return moments_bytes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moments_device(moments):
    """The device the moments are on (the current GPU, or the CPU, where a rank has none)."""
    for side in ("input", "output"):
        for moment in moments.get(side, {}).values():
            return moment.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def average_moments(moments, shapes, sides, all_reduce, device):
    """The token-weighted mean over ranks of every rank's K-FAC moments, in one all-reduce
    over a fixed list of (side, layer) slots - the same list on every rank, whatever each rank
    collected (a layer a rank did not run contributes zero tokens). Afterwards every rank holds
    the same A and G, so every rank computes the same factors. One host sync (the counts)."""
    tokens = moments.get("tokens", {})
    slots, parts = moment_slots(shapes, sides), []
    for side, n, d in slots:
        m, count = moments.get(side, {}).get(n), tokens.get(side, {}).get(n, 0)
        parts.append(m.reshape(-1) * count if m is not None
                     else torch.zeros(d * d, device=device))
    counts = agreement.device_vector([tokens.get(side, {}).get(n, 0) for side, n, _ in slots],
                                     device).float()
    flat = torch.cat(parts + [counts])
    all_reduce(flat)
    totals = flat[: -len(slots)].split([d * d for _, _, d in slots])
    out = {side: {} for side in sides}
    for (side, n, d), total, count in zip(slots, totals, flat[-len(slots):].tolist()):
        if count > 0:   # by a tensor: CUDA divides by a number as a product with its reciprocal
            out[side][n] = total.view(d, d) / compress.count_divisor(count, total)
    return out
