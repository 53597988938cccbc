"""
What a compressed run's communication did: the per-layer table (layer_table: each candidate's
coordinates, measured gain and core energy; every other tensor with the reason it stays
Euclidean), the memory its geometry holds, and, measured on the run's own last step, the error of
the averaged gradient its communicator delivered, against the exact fp32 mean of the same
gradients, next to Euclidean FP8 through the same collective (a stateless twin fed the same
gradients) and, for a run on another codec or collective, next to the FP8 the README
recommends: Euclidean e4m3 (blocks of 128) on the two-stage collective. train.py prints it at the end of every run with --comm=fp8/geofp8/subspace/hadamard,
after the per-layer table; LastStep keeps that step's gradients for it.

The error is the relative L2 distance to the fp32 mean, over three sets of tensors: the
matrices in geometry-aware coordinates on that step, all candidate matrices, all tensors. With
error feedback the delivered mean also carries the previous step's residual, so its distance to
this step's exact mean is not only this step's rounding.
"""

import math

import torch
import torch.distributed as dist

from nanogeo.parallel.communicator import Options, ProductionCommunicator
from nanogeo.parallel.precision import ieee


def layer_table(communicator, names=None):
    """Per-layer table: shape, r (the subspace rotation's and the whitening's rank, the Hadamard
    control's block size), coordinates in use, last measured gain, core energy ("-" where there
    is none: a gain before the first measurement, the energy of a whitened or Hadamard layer)."""
    lines = [f"{'tensor':40s} {'shape':>12s} {'r':>4s} {'coords':>10s} {'gain':>6s} {'energy':>6s}"]
    for n in names or communicator.names:
        shape = "x".join(map(str, communicator.shapes[n]))
        layer = communicator.layers.get(n)
        if layer is None:
            lines.append(f"{n:40s} {shape:>12s} {'-':>4s} {'euclidean':>10s} "
                         f"{'(' + communicator.reasons[n] + ')':>13s}")
            continue
        coords = communicator.coords(n)
        sides = getattr(layer, "sides", "both")     # compress.py's rotation: always both
        if coords == "geo" and sides != "both":
            coords += "/" + sides
        rank = getattr(layer, "r", None) or layer.opts.whiten_rank     # the whitening: its r
        energy = getattr(layer, "energy", math.nan)
        lines.append(f"{n:40s} {shape:>12s} {rank:4d} {coords:>10s} "
                     f"{cell(layer.gain, '.2f'):>6s} {cell(energy, '.2f'):>6s}")
    return "\n".join(lines)


def cell(value, spec):
    """`value` formatted by `spec`, or "-" where there is nothing to say: the communicator's
    NaN means "not measured" (a gain before the first judgement; the core energy, which only
    the subspace rotation has, before its first refresh or in a whitened layer)."""
    value = float(value)        # the energy is a device scalar: one sync, for the table only
    return "-" if math.isnan(value) else format(value, spec)


def geometry_state_bytes(communicator):
    """Memory held for geometry (reflectors, energies, moments, factors; dense bases in
    ablations) - in use and candidates awaiting their measurement - in bytes."""
    held = {}                                   # id -> tensor: each counted once
    for layer in [*communicator.layers.values(), *communicator.proposals.values()]:
        tensors = layer.tensors() if layer.built else []
        tensors += [basis.M for basis in layer.transform if hasattr(basis, "M")]  # DenseBasis
        held.update((id(t), t) for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in held.values())


# the FP8 the README recommends: Euclidean e4m3, blocks of 128, the two-stage collective
RECOMMENDED = {"fmt": "e4m3", "block": 128, "collective": "two-stage", "stochastic_round": False,
               "stochastic_stages": "both", "stage2_fmt": "", "nvfp4_scale": "6"}


def euclidean_twin(communicator, **codec):
    """A Euclidean communicator with the same codec and collective (or those in `codec`),
    without state."""
    o = communicator.opts
    same = dict(fmt=o.fmt, block=o.block, collective=o.collective, sum_order=o.sum_order,
                scale_sync_every=o.scale_sync_every, stochastic_round=o.stochastic_round,
                stochastic_stages=o.stochastic_stages, stage2_fmt=o.stage2_fmt,
                nvfp4_scale=o.nvfp4_scale, bucket_mb=o.bucket_mb)
    options = Options(geometry="euclidean", seed=o.seed + 1, vocab_size=o.vocab_size,
                      **{**same, **codec})
    twin = ProductionCommunicator([(n, communicator.shapes[n]) for n in communicator.names],
                                  options, communicator.group)
    twin.steps_taken = communicator.steps_taken - 1   # as the last reduce ran (scale syncing)
    return twin


def other_than_recommended(communicator):
    """Does the run send another codec or collective than the recommended FP8?"""
    o = communicator.opts
    return any(getattr(o, k) != v for k, v in RECOMMENDED.items())


def exact_and_twins(communicator, local, world_size, simulated):
    """(fp32 mean, Euclidean mean through the same codec and collective, the recommended FP8's
    mean or None where that is the run's own) of this step's gradients. local: this rank's
    tensors, or with simulated ranks a list of every rank's."""
    twins = [euclidean_twin(communicator)]
    if other_than_recommended(communicator):
        twins.append(euclidean_twin(communicator, **RECOMMENDED))
    if simulated:
        exact = [torch.stack(ts).mean(dim=0) for ts in zip(*local)]
        means = [twin.reduce_workers([[g.clone() for g in w] for w in local])[0] for twin in twins]
    else:
        flat = torch.cat([g.reshape(-1).float() for g in local])
        if world_size > 1:
            dist.all_reduce(flat, group=communicator.group)
        exact = [t.view_as(g) for t, g in zip((flat / world_size).split([g.numel() for g in local]),
                                              local)]
        means = [[g.clone() for g in local] for _ in twins]
        for twin, mean in zip(twins, means):
            twin.reduce(mean)
    return exact, means[0], (means[1] if len(means) > 1 else None)


def relative_error(means, exact, keep):
    num = sum(float((m - e).pow(2).sum()) for m, e, k in zip(means, exact, keep) if k)
    den = sum(float(e.pow(2).sum()) for e, k in zip(exact, keep) if k)
    return math.sqrt(num / den) if den > 0 else float("nan")


def last_step_report(communicator, local, delivered, coords, world_size, simulated=False):
    """The lines train.py prints: `delivered` is what the communicator returned on the last
    step (before clipping), `local` that step's gradients as for exact_and_euclidean, `coords`
    each tensor's coordinates on that step (communicator.coords, read before the reduce)."""
    exact, euclid, recommended = exact_and_twins(communicator, local, world_size, simulated)
    names = communicator.names
    sets = {"geometry-aware matrices": [c == "geo" for c in coords],
            "candidate matrices": [n in communicator.layers for n in names],
            "all tensors": [True] * len(names)}
    geo = sum(sets["geometry-aware matrices"])
    lines = [f"communication on the last step: {geo} of {sum(sets['candidate matrices'])} "
             f"candidate matrices in geometry-aware coordinates; error of the averaged gradient "
             f"against the exact fp32 mean (relative L2):"]
    for label, keep in sets.items():
        if not any(keep):
            continue
        ours, base = relative_error(delivered, exact, keep), relative_error(euclid, exact, keep)
        ratio = ours / base if base > 0 else float("nan")      # nan: nothing to compare
        lines.append(f"  {label:24s} this run {cell(ours, '.4f')} | Euclidean FP8, same "
                     f"collective {cell(base, '.4f')} | ratio {cell(ratio, '.3f')}")
    if recommended is not None:
        everything = sets["all tensors"]
        ours = relative_error(delivered, exact, everything)
        best = relative_error(recommended, exact, everything)
        lines.append(f"  the recommended FP8 on the same gradients (Euclidean e4m3, blocks of 128, "
                     f"two-stage collective): all tensors {cell(best, '.4f')} | this run / it "
                     f"{cell(ours / best if best > 0 else float('nan'), '.3f')}")
    return "\n".join(lines)


class LastStep:
    """The end-of-run comparison, kept by train.py on its last step: the gradients as sent
    (keep_sent, before the reduce) and as delivered (keep_delivered, after it, before clipping);
    report() is then last_step_report's lines. Nothing is kept on a step skipped for a
    non-finite gradient: taken() says whether there is anything to report."""

    def __init__(self, communicator, world_size, simulated=False):
        self.communicator, self.world_size, self.simulated = communicator, world_size, simulated
        self.local = self.coords = self.delivered = None

    def keep_sent(self, worker_grads, grads):
        """Before the reduce: the step's gradients (each simulated rank's, or this rank's own)
        and the coordinates each tensor is sent in (the reduce may change them)."""
        self.local = [[g.clone() for g in w] for w in worker_grads] or [g.clone() for g in grads]
        self.coords = [self.communicator.coords(n) for n in self.communicator.names]

    def keep_delivered(self, params):
        """After the reduce: the averaged gradients the communicator delivered."""
        self.delivered = [p.grad.clone() for p in params]

    def taken(self):
        return self.delivered is not None

    def report(self):
        return last_step_report(self.communicator, self.local, self.delivered, self.coords,
                                self.world_size, simulated=self.simulated)


# -----------------------------------------------------------------------------
# the error of a step split by stage of the two-stage collective (train.py --log_stages)

def mean_over_ranks(tensors, group, world_size):
    """The mean over the process group of each tensor (one all-reduce of them all)."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if world_size > 1:
        dist.all_reduce(flat, group=group)
    return [t.view_as(s) for t, s in zip((flat / world_size).split([t.numel() for t in tensors]),
                                         tensors)]


@ieee       # a measurement: IEEE fp32 whatever the model uses (nanogeo/parallel/precision.py)
def stage_errors(communicator, sent, delivered, world_size, simulated, noise_samples=4):
    """One step's communication error split by stage of the two-stage collective, each part
    against the sampling noise of the mean, in plain L2 and as each optimizer sees it:

        stage 1  the mean of every rank's own round trip minus the exact mean: the error an
                 exact (fp32) second stage would leave - each rank's rounding, averaged over W
                 (with stage-1 error feedback, also the residual it carried in);
        stage 2  the delivered mean minus that: the re-quantization of the averaged shards (on
                 the paper's fp8-sum collective: the FP8 sum's re-roundings hop by hop);
        total    delivered - exact = stage 1 + stage 2 (as vectors).

    The mean's sampling noise, sum_w ||g_w - m||^2 / (W (W - 1)), is what a communication error
    competes with: at a ratio near 1 it acts like a batch about half as large. Returns, per metric
    ("l2"; "adamw" and "muon" over the matrices each optimizer owns, through its view of the
    exact mean, the noise from up to `noise_samples` ranks' deviations), {"stage1", "stage2",
    "total"}: sqrt(error energy / noise energy), and for "l2" also "of_mean", |total| / |mean|.
    sent: the step's gradients before communication (each simulated rank's, or this rank's);
    delivered: the decoded means; communicator.stage1 from a step run with decompose=True. The
    energies are summed on the device and read once (logged steps only)."""
    group = communicator.group
    if simulated:
        W, workers = len(sent), sent
        exact = [torch.stack(ts).float().mean(0) for ts in zip(*sent)]
        stage1 = communicator.stage1
    else:
        W, workers = world_size, [sent]
        exact = mean_over_ranks(sent, group, world_size)
        stage1 = mean_over_ranks(communicator.stage1, group, world_size)
    if W < 2:
        return None                         # one rank: no sampling noise to compare with
    energy = {}                             # metric -> [stage 1, stage 2, total, noise, mean]
    for i, (n, m, s, d) in enumerate(zip(communicator.names, exact, stage1, delivered)):
        parts = (s - m, d - s, d - m)
        # a rank's deviation / sqrt(W - 1): a vector the size of the mean's sampling noise
        deviations = [(w[i].float() - m) / math.sqrt(W - 1) for w in workers]
        noise = torch.stack([x.pow(2).sum() for x in deviations]).mean()
        add(energy, "l2", [p.pow(2).sum() for p in parts] + [noise, m.pow(2).sum()])
        view = communicator.views.get(n)
        if view is not None:
            seen, sample = view.error(m, 1), deviations[:noise_samples]
            noise = torch.stack([seen(x).float() for x in sample]).mean()
            add(energy, view.kind, [seen(p).float() for p in parts] + [noise, noise * 0])
    kinds = list(energy)
    table = torch.stack([torch.stack([torch.as_tensor(v).float() for v in energy[k]])
                         for k in kinds])                       # (metrics, 5), on the device
    if not simulated:                       # each rank's noise sample: their mean
        table[:, 3] = mean_over_ranks([table[:, 3].contiguous()], group, world_size)[0]
    rows = dict(zip(kinds, table.tolist()))                     # the one host sync
    out = {kind: {k: math.sqrt(v / noise) if noise > 0 else float("nan")
                  for k, v in (("stage1", e1), ("stage2", e2), ("total", e))}
           for kind, (e1, e2, e, noise, _) in rows.items()}
    total, mean = rows["l2"][2], rows["l2"][4]
    out["l2"]["of_mean"] = math.sqrt(total / mean) if mean > 0 else float("nan")
    return out


def add(energy, kind, values):
    energy[kind] = [a + b for a, b in zip(energy.get(kind, [0.0] * len(values)), values)]


def stages_line(done, stages):
    """The log line of a step's stage_errors: each part of the error / the sampling noise."""
    parts = " | ".join(f"{kind} {s['stage1']:.3f}, {s['stage2']:.3f}, {s['total']:.3f}"
                       for kind, s in stages.items())
    return (f"step {done} | error of the mean / its sampling noise - stage 1, stage 2, total: "
            f"{parts}")
