"""
The study's statistics, written out (no scipy): Student t quantiles, the paired t interval of
per-seed differences, the TOST test of equivalence within a margin, Welch's test of one machine
against the rest, and the fraction of a reference's gap a method recovers, with its interval.

Every comparison is paired by block. A block is one seed on one machine: every arm of a seed runs
on one CPU, back to back (another CPU rounds differently, BENCHMARKS.md section 14), so what a
seed and a machine do to every method alike cancels in the difference. Blocks of several
machines are pooled as independent draws of that difference; each machine's own mean is shown
beside the pooled one, and a machine whose mean differs from the others' is flagged (machine_flag).

Equivalence (TOST, two one-sided t tests at 5 %): methods A and B are called equivalent within
+-margin when the 90 % paired t interval of A - B lies inside (-margin, +margin). A paired
interval that merely includes 0 says "no difference detected (+- its 95 % half-width)", never
"the same".
"""

import functools
import math
import random

MIN_BOOTSTRAP_SEEDS = 8
# the default equivalence margin in final val loss: 0.002, about 0.12 % of the study's loss
# (~1.7 nats per character at 300 steps), the size of FP8's gap to bf16 that the paper's claim is
# about, and what >= 24 seeds resolve at the study's paired sd (0.0023-0.0042)
MARGIN = 0.002


def incomplete_beta(x, a, b):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz's
    method; Numerical Recipes 6.4), which converges fast for x < (a + 1) / (a + b + 2) - on the
    other side by the symmetry I_x(a, b) = 1 - I_{1-x}(b, a)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(1 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * fraction / a


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The p quantile (p > 0.5) of Student's t with df degrees of freedom (df may be fractional:
    Welch's), rounded to 3 decimals as printed tables give it (t_quantile(0.975, 2) = 4.303).
    P(T <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2 for t >= 0; solved by bisection."""
    lo, hi = 0.0, 1e4
    for _ in range(100):
        t = (lo + hi) / 2
        below = 1 - incomplete_beta(df / (df + t * t), df / 2, 0.5) / 2
        lo, hi = (t, hi) if below < p else (lo, t)
    return round((lo + hi) / 2, 3)


def mean_sd(values):
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, sd


def mean_ci(values, level=0.95):
    """(mean, half-width of the two-sided `level` Student t interval); nan half-width for one
    value."""
    n = len(values)
    mean, sd = mean_sd(values)
    if n < 2:
        return mean, float("nan")
    return mean, t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)


def p_value(diffs):
    """The two-sided p of the paired t test that the mean difference is 0 (Student t, n - 1
    degrees of freedom): I_{df / (df + t^2)}(df / 2, 1 / 2). nan with fewer than 2 blocks; 0
    when every difference is the same nonzero value. For a family of k comparisons read it with
    Holm's correction: the smallest p against 0.05 / k, the next against 0.05 / (k - 1), ..."""
    n = len(diffs)
    if n < 2 or not all(map(math.isfinite, diffs)):
        return float("nan")
    mean, sd = mean_sd(diffs)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = mean / (sd / math.sqrt(n))
    return incomplete_beta((n - 1) / (n - 1 + t * t), (n - 1) / 2, 0.5)


def tost(diffs, margin=MARGIN):
    """Two one-sided t tests at 5 % of |mean difference| < margin, from per-block differences
    A - B: (low, high) of the 90 % paired t interval, and whether it lies inside (-margin,
    +margin) - then A and B are equivalent within +-margin. None with fewer than 2 blocks."""
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return None
    mean, half = mean_ci(diffs, level=0.90)
    return mean - half, mean + half, -margin < mean - half and mean + half < margin


def verdict(diffs, margin=MARGIN):
    """What per-block differences A - B say, in the study's words: "equivalent within +-margin
    (TOST)", "lower" / "higher" (the 95 % paired t interval excludes 0; both can hold when a
    real difference is smaller than the margin), or "no difference detected (+- the 95 %
    half-width)"."""
    if not diffs:
        return "no shared seeds"
    mean, half = mean_ci(diffs)
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return f"one seed ({mean:+.4f})" if len(diffs) < 2 else "not finite"
    significant = abs(mean) > half
    side = "lower" if mean < 0 else "higher"
    if tost(diffs, margin)[2]:
        return f"equivalent within ±{margin:g} (TOST)" + (f"; {side} at 95 %" if significant
                                                           else "")
    return f"{side} at 95 %" if significant else f"no difference detected (± {half:.4f})"


def welch_differs(a, b):
    """Whether the means of samples a and b differ at 5 % (two-sided Welch t test: unequal
    variances, Welch-Satterthwaite degrees of freedom); None when either has < 2 values."""
    if len(a) < 2 or len(b) < 2:
        return None
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    if va + vb == 0:
        return ma != mb
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    return abs(ma - mb) > t_quantile(0.975, df) * math.sqrt(va + vb)


def reference_problem(reference_gaps):
    """Why no fraction of the reference's gap (per seed: reference - fp32) can be given, or None:
    one seed; a run that diverged; its paired t interval includes 0 (no gap established) or
    lies below it; or a seed in which it did not lose to fp32 (that seed's fraction would divide
    by a number <= 0)."""
    if len(reference_gaps) < 2:
        return "one seed"
    if not all(math.isfinite(g) for g in reference_gaps):
        return "reference gap not finite"
    mean, half = mean_ci(reference_gaps)
    if mean + half < 0:
        return "reference better than fp32"
    if mean - half <= 0:
        return "reference gap not significant"
    if min(reference_gaps) <= 0:
        return "reference gap <= 0 in a seed"
    return None


def recovered(gaps, reference_gaps, draws=2000):
    """The fraction of the reference's gap a method recovers, from per-seed fractions
    f = 1 - gap / reference gap (paired by seed): (mean of f, low, high, interval), a 95 % t
    interval - or with >= MIN_BOOTSTRAP_SEEDS seeds a 95 % percentile bootstrap of the mean
    (interval "bootstrap"). Ask reference_problem(reference_gaps) first."""
    fractions = [1 - g / r for g, r in zip(gaps, reference_gaps)]
    n = len(fractions)
    mean, half = mean_ci(fractions)
    if n < MIN_BOOTSTRAP_SEEDS:
        return mean, mean - half, mean + half, "t"
    rng = random.Random(0)
    means = sorted(sum(fractions[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return mean, means[int(0.025 * draws)], means[int(0.975 * draws) - 1], "bootstrap"


def estimate(values, digits=4, sign=""):
    """'mean ± half-width' (95 % t), or 'mean (one seed)'."""
    mean, half = mean_ci(values)
    if len(values) < 2:
        return f"{mean:{sign}.{digits}f} (one seed)"
    return f"{mean:{sign}.{digits}f} ± {half:.{digits}f}"


def paired(runs, other):
    """The blocks both dicts {block: record} hold (a block: (machine, seed)), and runs' val loss
    minus other's on each."""
    blocks = [b for b in sorted(runs) if b in other]
    return blocks, [runs[b]["final_val_loss"] - other[b]["final_val_loss"] for b in blocks]


def includes_zero(values):
    mean, half = mean_ci(values)
    return abs(mean) <= half
