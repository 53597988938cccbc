"""
The error the optimizer sees: what a gradient error does to the next update, from the
optimizer's own state - AdamW's elementwise update, exactly (compress.py's adamw_direction, on
this rank's shard of FSDP's state too), and Muon's Newton-Schulz map, to first order.
compress.Communicator judges each layer's coordinates by it, through OptimizerView.error (why:
compress.py section 5); nanogeo.lab.fidelity and nanogeo.lab.variants report with it.
"""
import functools
from dataclasses import dataclass

import torch

import compress
from nanogeo.parallel.precision import ieee


@dataclass
class OptimizerView:
    """One parameter's optimizer as the gain check needs it: "adamw" or "muon", and functions
    returning its param group's settings and its per-parameter state now (empty before the
    first step). Read lazily: an optimizer.load_state_dict() after watch() is seen."""
    kind: str
    read_hyper: object
    read_state: object

    @property
    def hyper(self):
        return self.read_hyper()

    def error(self, mean, workers=1, rows=None):
        """delta -> its squared size as this optimizer's next update sees it (UpdateError)."""
        return UpdateError(self, mean, rows, workers)


@ieee
def newton_schulz(X, coefficients, steps, eps=1e-7):
    """Muon's orthogonalisation (the quintic iteration of torch.optim.Muon) in IEEE fp32: the gain
    check differences two calls, which bf16 rounding (or TF32's, ~5e-4) would drown."""
    a, b, c = coefficients
    wide = X.T if X.shape[0] > X.shape[1] else X
    Y = wide / wide.norm().clamp(min=eps)
    for _ in range(steps):
        A = Y @ Y.T
        Y = a * Y + (b * A + c * A @ A) @ Y
    return Y.T if X.shape[0] > X.shape[1] else Y


def local_tensor(t):
    """A DTensor's local shard (FSDP2's sharded optimizer state), any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class UpdateError:
    """Squared size of the change a gradient error makes to the next update of the optimizer
    in `view`, when the decoded mean gradient is `mean` (both (m, n)):

        none   ||delta||^2          no optimizer (view None)
        adamw  ||u(mean + delta) - u(mean)||^2      u: AdamW's update, exact (compress.adamw_error)
        muon   ||NS(X + c delta) - NS(X)||^2 / ...   X: the matrix Muon orthogonalises, c = dX/dg,
                                                    to first order

    `workers`: the gain check measures each worker's own codec error, but the mean carries the
    average of W independent errors, about 1 / sqrt(W) as large per element; AdamW's update is
    not linear in the error, so the error is scaled to that size before it goes through
    (and the result scaled back, so that sizes stay comparable to L2). Scalar factors common to
    every codec (learning rate, Muon's lr adjustment) are left out: only ratios between codecs
    are used. `rows` (FSDP): `mean` and the optimizer state hold only this rank's rows; the
    error is measured there (Muon, which needs whole matrices, falls back to L2)."""

    def __init__(self, view, mean, rows=None, workers=1):
        self.kind = view.kind if view is not None else "none"
        self.rows = rows
        if self.kind == "muon" and rows is not None:
            self.kind = "none"
        if self.kind == "adamw":       # this rank's shard of FSDP's state, or all of it
            state = {k: local_tensor(v) for k, v in view.read_state().items()}
            self.adamw = compress.adamw_error(state, view.hyper["betas"], view.hyper["eps"], mean,
                                              workers)
        elif self.kind == "muon":
            state, hyper = view.read_state(), view.hyper
            mu = hyper["momentum"]
            buf = state.get("momentum_buffer")
            buf = torch.zeros_like(mean, dtype=torch.float32) if buf is None else buf.float()
            buf = buf.lerp(mean.float(), 1 - mu)                         # this step's buffer
            self.X = mean.float().lerp(buf, mu) if hyper["nesterov"] else buf
            self.c = (1 - mu) * (1 + mu) if hyper["nesterov"] else 1 - mu
            self.ns = functools.partial(newton_schulz, coefficients=hyper["ns_coefficients"],
                                        steps=hyper["ns_steps"], eps=hyper.get("eps", 1e-7))
            self.base = self.ns(self.X)

    def __call__(self, delta):
        if self.rows is not None:
            delta = self.rows.local(delta)
        if self.kind == "adamw":
            return self.adamw(delta)
        if self.kind == "muon":     # a directional derivative: a step small enough to be linear
            eps = (1e-3 * self.X.norm()).clamp(min=1e-12) / (self.c * delta).norm().clamp(min=1e-30)
            return (self.ns(self.X + eps * self.c * delta) - self.base).pow(2).sum() / eps ** 2
        return delta.pow(2).sum()
