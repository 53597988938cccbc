"""
train.py --simulate_workers=W: one process plays W data-parallel ranks. SimulatedRanks computes
every simulated rank's gradients and keeps them apart; average() averages them through exactly
the numerics a W-rank run's collective applies (train.reduce_gradients calls it), so a study of
many ranks runs on one machine (tests/test_train.py: bit-equal to a real 2-rank gloo run).

The ranks in a few batched passes, bit for bit (BatchedRanks). Ranks differ only by their data,
so their micro-batches can go through the model together, (n B, T) for n ranks, instead of n
passes of (B, T): the per-call overhead of a small model's hundreds of small kernels is paid once
a pass. Nothing changes a rank's numbers:
  * every op before the loss acts on each sequence alone (matmuls row by row, attention per
    sequence, norms per token), and on the CPU its result for one sequence does not depend on
    how many others share the call;
  * each rank's loss is its own mean (the model's loss function on its rows), so the gradient
    that reaches every activation is the one its own pass computes;
  * what does depend on the batch is a parameter's gradient, a sum over all the tokens that used
    it. So the pass runs with the parameters frozen, hooks keep each parameterised module's
    input and output gradient, and each rank's parameter gradient is formed from its own rows
    as autograd forms it: for nn.Linear g^T x, for model.RMSNorm's gain g * normalize(x) summed
    over the tokens, for any other module (an embedding) autograd itself, on the module run
    again on the rank's rows - the same formulas on the same shapes as the rank's own pass.
The first step checks it: the first and the last rank's losses and gradients from the batched
passes against their own passes. Where they differ (a parameter used outside its module's
forward, dropout, a kernel whose rows depend on the batch) the run says so and plays the ranks
one by one.
"""
import functools

import torch
import torch.nn as nn

import compress
import model as model_lib
from nanogeo.parallel import hooks
from nanogeo.wire import collective

# Tokens per batched pass: enough to pay the per-kernel overhead once for several ranks, few
# enough that a pass's activations (and logits: tokens x vocabulary) stay small. char-study at
# W = 32, one step's forward/backward, CPU time, median of 6: one rank a pass 548 ms; 1024
# tokens a pass 362, 2048 366, 4096 345, 8192 397.
PASS_TOKENS = 2048


class SimulatedRanks:
    """The W data-parallel ranks one process plays. forward_backward runs each rank's micro-steps
    as a real rank would (own_pass: train.forward_backward) and returns each rank's gradients
    apart, with .grad left empty; average() then stands in for the collective.

    Ranks go through the model together (BatchedRanks, bit-equal to one by one) on the CPU, where
    a sequence's numbers do not depend on its batch, and eagerly; one by one on a GPU, with
    --compile, and on the steps whose forwards collect K-FAC moments (the hooks' sums are per
    rank, and a compiled graph never holds the hooks: those steps run raw_model)."""

    def __init__(self, raw_model, model, own_pass, moments=None, batched=True):
        self.raw_model, self.model, self.own_pass = raw_model, model, own_pass
        self.moments = moments
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        self.batched = (BatchedRanks(raw_model, model_lib.next_token_loss, own_pass) if batched
                        else None)

    def forward_backward(self, batches, grad_accum, autocast, collect=False):
        """batches[r][micro] = (x, y) of simulated rank r. Returns (rank 0's losses per
        micro-step, [rank r's gradients in parameter order], [rank r's K-FAC moments] if
        `collect` else None)."""
        if self.batched is not None and not collect:
            losses, grads = self.batched.forward_backward(batches, grad_accum)
            return losses, grads, None
        model = self.raw_model if collect else self.model
        rank_losses, rank_grads, rank_stats = [], [], []
        for rank_batches in batches:
            rank_losses.append(self.own_pass(model, rank_batches, grad_accum, autocast))
            rank_grads.append([p.grad for p in self.params])
            for p in self.params:       # the next rank starts at 0
                p.grad = None
            if collect:
                rank_stats.append(self.moments.take())
        return rank_losses[0], rank_grads, rank_stats if collect else None


class BatchedRanks:
    """Forward/backward of simulated ranks in batched passes (see the module docstring).

    model(x) returns (logits, None); loss_fn(logits, y) is the loss model(x, y) returns;
    own_pass(model, rank_batches, grad_accum) is what one real rank runs (train.forward_backward:
    its losses, its gradients left in .grad), used once to check the batched pass against it."""

    def __init__(self, model, loss_fn, own_pass):
        self.model, self.loss_fn, self.own_pass = model, loss_fn, own_pass
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owners = []            # (module, its own trainable parameters)
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if own:
                self.owners.append((module, own))
        self.agrees = None          # None until the first step has compared the two

    def forward_backward(self, batches, grad_accum):
        """batches[r][micro] = (x, y) of simulated rank r. Returns (rank 0's losses per
        micro-step, [rank r's gradients in parameter order]), as each rank's own pass would."""
        if self.agrees is None:
            return self._first_step(batches, grad_accum)
        if self.agrees:
            return self._batched(batches, grad_accum)
        return self._one_by_one(batches, grad_accum)

    def _first_step(self, batches, grad_accum):
        """Every rank batched, checked against the first and the last rank's own passes; where
        they differ, the ranks are played one by one from now on."""
        ends = sorted({0, len(batches) - 1})
        own_losses, own_grads = self._one_by_one([batches[r] for r in ends], grad_accum)
        try:
            losses, grads = self._batched(batches, grad_accum)
            self.agrees = same(losses, own_losses) and all(
                same(grads[r], own) for r, own in zip(ends, own_grads))
        except (AttributeError, TypeError, RuntimeError):   # e.g. a module of two inputs, or
            self.agrees = False             # a parameter with no gradient in some micro-step
        if self.agrees:
            return losses, grads
        print("simulated ranks: a batched pass does not reproduce a rank's own pass bit for bit "
              "on this model; playing the ranks one by one", flush=True)
        return self._one_by_one(batches, grad_accum)

    def _batched(self, batches, grad_accum):
        """Every rank's micro-steps, PASS_TOKENS at a time."""
        per_pass = max(1, PASS_TOKENS // batches[0][0][0].numel())
        first_losses, rank_grads = [], [None] * len(batches)
        for micro in range(grad_accum):
            for start in range(0, len(batches), per_pass):
                ranks = range(start, min(start + per_pass, len(batches)))
                xs, ys = zip(*(batches[r][micro] for r in ranks))
                losses, grads = self._pass(xs, ys, grad_accum)
                if start == 0:
                    first_losses.append(losses[0])
                for r, g in zip(ranks, grads):     # as .grad accumulates over micro-steps
                    rank_grads[r] = g if micro == 0 else [a + b for a, b in zip(rank_grads[r], g)]
        return first_losses, rank_grads

    def _pass(self, xs, ys, grad_accum):
        """One forward/backward of n ranks' micro-batches together. Returns (their losses, each
        rank's parameter gradients; None for a parameter that got none, as in autograd)."""
        saved, handles = {}, []
        for module, _ in self.owners:
            handles.append(module.register_forward_hook(functools.partial(self._keep, saved)))
        for p in self.params:
            p.requires_grad_(False)     # only the activations' gradients flow in this pass
        try:
            logits, _ = self.model(torch.cat(xs))                           # (n B, T, vocab)
            losses = [self.loss_fn(out, y) for out, y in zip(logits.split(len(xs[0])), ys)]
            torch.stack([loss / grad_accum for loss in losses]).sum().backward()
        finally:
            for handle in handles:
                handle.remove()
            for p in self.params:
                p.requires_grad_(True)
        grads = [{} for _ in xs]
        for module, own in self.owners:
            inputs, out_grads = saved.get(module, (None, None))
            if out_grads is None:       # the module did not run, or nothing used its output
                continue
            for rank, rank_grads in zip(grads, rank_parameter_grads(module, own, inputs,
                                                                     out_grads, len(xs))):
                for p, grad in zip(own, rank_grads):
                    rank[p] = rank[p] + grad if p in rank else grad     # tied: both uses
        return [loss.detach() for loss in losses], [[rank.get(p) for p in self.params]
                                                    for rank in grads]

    @staticmethod
    def _keep(saved, module, args, out):
        """Forward hook: keep the module's input, and through a hook on its output the gradient
        arriving there. The first module (an embedding of frozen weights) makes its output a
        leaf that wants a gradient, so that the backward reaches it."""
        entry = saved[module] = [args[0].detach(), None]
        if not out.requires_grad:
            out.requires_grad_()
        out.register_hook(functools.partial(entry.__setitem__, 1))

    def _one_by_one(self, batches, grad_accum):
        """Each rank's own pass, one after another (the reference, and the fallback)."""
        rank_losses, rank_grads = [], []
        for rank_batches in batches:
            rank_losses.append(self.own_pass(self.model, rank_batches, grad_accum))
            rank_grads.append([p.grad for p in self.params])
            for p in self.params:
                p.grad = None
        return rank_losses[0], rank_grads


def same(tensors, others):
    """Bit for bit (None only where None)."""
    return len(tensors) == len(others) and all(
        a is None and b is None or a is not None and b is not None and torch.equal(a, b)
        for a, b in zip(tensors, others))


def rank_parameter_grads(module, own, inputs, out_grads, n):
    """Each of n ranks' gradients of a module's own parameters, from the module's input in a
    pass and the gradient at its output (rank r's rows: the r-th of n equal chunks)."""
    chunks = list(zip(inputs.chunk(n), out_grads.chunk(n)))
    if isinstance(module, nn.Linear) and module.bias is None:
        # what autograd computes for the weight of y = x W^T: g^T x over the rank's tokens
        return [[g.reshape(-1, g.shape[-1]).t().mm(a.reshape(-1, a.shape[-1]))]
                for a, g in chunks]
    if isinstance(module, model_lib.RMSNorm):
        # ... for the gain of y = normalize(x) * weight: g * normalize(x), summed over the
        # rank's tokens (the product for the whole pass at once: it is elementwise)
        products = (out_grads * module.normalize(inputs)).chunk(n)
        return [[p.sum(tuple(range(p.dim() - 1)))] for p in products]
    with torch.enable_grad():       # any other module: autograd, on the rank's rows
        return [torch.autograd.grad(module(a), own, g) for a, g in chunks]


@torch.no_grad()
def average(worker_grads, method, communicator, worker_stats=None):
    """The mean of W simulated ranks' gradients (worker_grads[i]: rank i's, in parameter order)
    through exactly the numerics of the collective a W-rank run uses (method: --comm): the same
    sum in the wire's dtype for fp32 / bf16 (equal, bit for bit, to a 2-rank gloo run), the
    collective's simulator for the compressed methods. worker_stats: each rank's whitening
    moments, on the steps that collect them. Returns (the means, the bytes each rank would
    send, with the moments' all-reduce on the steps that average them, as a real rank counts
    them). train.reduce_gradients, for a process that plays every rank."""
    world = len(worker_grads)
    if method in ("fp32", "bf16"):
        dtype = torch.float32 if method == "fp32" else torch.bfloat16
        means = []
        for grads in zip(*worker_grads):
            total = grads[0].to(dtype)
            for g in grads[1:]:
                total = total + g.to(dtype)         # the all_reduce SUM, in the wire's dtype
            means.append(total.float() / compress.count_divisor(world, total))
        numel = sum(g.numel() for g in worker_grads[0])
        nbytes = collective.ring_allreduce_bytes(numel, dtype.itemsize, world) if world > 1 else 0
        return means, nbytes
    means, nbytes = communicator.reduce_workers(worker_grads, worker_stats or None)
    if worker_stats:            # ... averaged over the ranks by one more all-reduce
        nbytes += hooks.moments_bytes(communicator, world)
    return means, nbytes
