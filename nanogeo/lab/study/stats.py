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
+-margin when the 90 % paired t interval of A - B lies inside (-margin, +margin) - "at the edge"
when its outer bound is within EDGE (5 %) of the margin. A paired interval that merely includes 0
says "no difference detected (+- its 95 % half-width)", never "the same".

Beyond one test: the fraction of a gap a method recovers as a ratio of two paired means with
Fieller's interval (fieller), Holm's step-down correction over a family of tests (holm), the
Benjamini-Hochberg q of each of many tests (benjamini_hochberg), and the seeds a paired t test
needs for a given power (seeds_for_power).

Words (standing): what an interval says of A - B, in one of four phrases - within the margin
(TOST), lower / higher at 95 % (the 95 % interval excludes 0), likely lower / higher (only the 90 %
interval excludes 0: said with its bounds), or no difference detected (the 90 % interval holds
0). "No difference detected" is never said of an interval that leans one way at 90 %.
"""

import functools
import math
import random
import textwrap

MIN_BOOTSTRAP_SEEDS = 8
# the default equivalence margin in final val loss: 0.002, about 0.12 % of the study's loss
# (~1.7 nats per character at 300 steps), the size of FP8's gap to bf16 that the paper's claim is
# about, and what >= 24 seeds resolve at the study's paired sd (0.0023-0.0042)
MARGIN = 0.002
# a TOST that passes with its 90 % bound within this fraction of the margin passes "at the edge"
EDGE = 0.05


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


def one_sided_p(diffs, shift=0.0, upper=True):
    """The one-sided p of the paired t test that the mean of diffs is below `shift` (upper=True:
    small when the mean is clearly above it) or above it (upper=False): P(T >= t) for
    t = (mean - shift) / (sd / sqrt(n)), from the two-sided p of that t."""
    n = len(diffs)
    mean, sd = mean_sd(diffs)
    t = (mean - shift) / (sd / math.sqrt(n)) if sd > 0 else math.copysign(math.inf, mean - shift)
    t = t if upper else -t
    tail = incomplete_beta((n - 1) / (n - 1 + t * t), (n - 1) / 2, 0.5) / 2 if math.isfinite(t) \
        else 0.0
    return tail if t > 0 else 1 - tail


def tost_p(diffs, margin=MARGIN):
    """The p of the two one-sided t tests of equivalence within +-margin: the larger of the p's
    that the mean is above -margin and below +margin. Below 0.05 exactly where the 90 % paired t
    interval lies inside the margin (tost()); nan with fewer than 2 blocks."""
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return float("nan")
    return max(one_sided_p(diffs, -margin, upper=True), one_sided_p(diffs, margin, upper=False))


def tost(diffs, margin=MARGIN):
    """Two one-sided t tests at 5 % of |mean difference| < margin, from per-block differences
    A - B: (low, high) of the 90 % paired t interval, and whether it lies inside (-margin,
    +margin) - then A and B are equivalent within +-margin. None with fewer than 2 blocks."""
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return None
    mean, half = mean_ci(diffs, level=0.90)
    return mean - half, mean + half, -margin < mean - half and mean + half < margin


def edge(diffs, margin=MARGIN):
    """The outer bound of the 90 % interval when the TOST passes at the edge (that bound within
    EDGE of the margin), else None: equivalence that one more seed could undo."""
    interval = tost(diffs, margin)
    if interval is None or not interval[2]:
        return None
    outer = max(interval[:2], key=abs)
    return outer if abs(outer) >= (1 - EDGE) * margin else None


def edge_text(diffs, margin=MARGIN):
    """' at the edge, 90 % bound +0.00197' or '' (to follow "TOST" in a parenthesis)."""
    outer = edge(diffs, margin)
    return "" if outer is None else f" at the edge, 90 % bound {outer:+.5f}"


def standing(diffs, margin=MARGIN):
    """Where A - B stands, from its per-block differences: "equivalent" (the TOST passes),
    "lower" / "higher" (the 95 % paired t interval excludes 0), "likely lower" / "likely higher"
    (only the 90 % interval excludes 0) or "no difference detected" (the 90 % interval holds 0).
    "equivalent" wins where the 95 % interval also excludes 0 (a real difference smaller than
    the margin): verdict() and the words add the side."""
    mean, half = mean_ci(diffs)
    low, high, equivalent = tost(diffs, margin)
    side = "lower" if mean < 0 else "higher"
    if equivalent:
        return "equivalent"
    if abs(mean) > half:
        return side
    return f"likely {side}" if low > 0 or high < 0 else "no difference detected"


def interval90(diffs):
    """'+0.0003 to +0.0038': the 90 % paired t interval of the differences."""
    low, high, _ = tost(diffs)
    return f"{low:+.4f} to {high:+.4f}"


def verdict(diffs, margin=MARGIN):
    """What per-block differences A - B say, in the study's words (standing()): "equivalent
    within +-margin (TOST)" (with "; lower / higher at 95 %" where that holds too), "lower" /
    "higher at 95 %", "likely lower" / "likely higher (90 % interval excludes 0)", or "no
    difference detected (+- the 95 % half-width)"."""
    if not diffs:
        return "no shared seeds"
    mean, half = mean_ci(diffs)
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return f"one seed ({mean:+.4f})" if len(diffs) < 2 else "not finite"
    said = standing(diffs, margin)
    side = "lower" if mean < 0 else "higher"
    if said == "equivalent":
        return (f"equivalent within ±{margin:g} (TOST{edge_text(diffs, margin)})"
                + (f"; {side} at 95 %" if abs(mean) > half else ""))
    if said.startswith("likely"):
        return f"{said} (90 % interval excludes 0)"
    return f"{side} at 95 %" if said == side else f"no difference detected (± {half:.4f})"


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


def fieller(numerators, denominators, level=0.95):
    """The ratio of two paired means, mean(numerators) / mean(denominators), with Fieller's
    `level` interval: (ratio, low, high), low and high None when the interval is unbounded
    (the denominator's mean is not established away from 0 at that level).

    With a, b the two means, v_aa, v_bb, v_ab the variances and covariance of the means (the
    per-block values are paired, so they covary) and t the Student t quantile with n - 1
    degrees of freedom, the interval holds every R with (a - R b)^2 <= t^2 (v_aa - 2 R v_ab +
    R^2 v_bb): the roots of (b^2 - t^2 v_bb) R^2 - 2 (a b - t^2 v_ab) R + (a^2 - t^2 v_aa) = 0.
    A per-block ratio's mean would divide by each block's small denominator; this does not."""
    n = len(numerators)
    if n < 2 or n != len(denominators):
        raise ValueError("fieller needs >= 2 paired values on each side")
    (a, _), (b, _) = mean_sd(numerators), mean_sd(denominators)
    moment = lambda x, mx, y, my: sum((u - mx) * (v - my) for u, v in zip(x, y)) / (n - 1) / n
    v_aa = moment(numerators, a, numerators, a)
    v_bb = moment(denominators, b, denominators, b)
    v_ab = moment(numerators, a, denominators, b)
    t2 = t_quantile((1 + level) / 2, n - 1) ** 2
    quad, half_lin, const = b * b - t2 * v_bb, a * b - t2 * v_ab, a * a - t2 * v_aa
    ratio = a / b if b else float("nan")
    root = half_lin * half_lin - quad * const
    if quad <= 0 or root < 0:
        return ratio, None, None
    return ratio, (half_lin - math.sqrt(root)) / quad, (half_lin + math.sqrt(root)) / quad


def holm(p_values):
    """Holm's step-down adjusted p-values, in the order given: the k-th smallest p times
    (m - k + 1), made non-decreasing, at most 1. A test of the family is rejected at 5 % when its
    adjusted p is below 0.05 - the same as comparing the smallest p with 0.05 / m, the next with
    0.05 / (m - 1), and so on, stopping at the first that fails."""
    m = len(p_values)
    order = sorted(range(m), key=lambda k: p_values[k])
    adjusted, running = [0.0] * m, 0.0
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[k]))
        adjusted[k] = running
    return adjusted


def benjamini_hochberg(p_values):
    """Benjamini-Hochberg q-values, in the order given: the k-th smallest p times m / k, made
    non-increasing from the largest down, at most 1. Rejecting every test with q below 0.05
    keeps the expected share of false discoveries among the rejected at most 5 % (independent
    or positively dependent tests) - a weaker promise than Holm's (no false rejection at all
    with probability 95 %), for a long list of comparisons rather than a decision. nan p's
    (no test) stay nan and do not count in m."""
    tested = [k for k, p in enumerate(p_values) if math.isfinite(p)]
    m = len(tested)
    order = sorted(tested, key=lambda k: p_values[k], reverse=True)
    q, running = [float("nan")] * len(p_values), 1.0
    for position, k in enumerate(order):
        running = min(running, p_values[k] * m / (m - position))
        q[k] = running
    return q


def seeds_for_power(sd, effect, power=0.8, level=0.95):
    """The fewest blocks with which a two-sided paired t test at 1 - level detects a true mean
    difference `effect` with probability `power`, at a paired sd `sd`: the smallest n with
    n >= ((t_{(1+level)/2, n-1} + t_{power, n-1}) sd / effect)^2, the usual approximation to the
    noncentral t (against 200,000 simulated normal tests: the same n at 10 and 29 blocks, one
    more than needed at 45)."""
    if not (sd > 0 and effect > 0):
        raise ValueError("seeds_for_power needs a positive sd and effect")
    n = 2
    while n < ((t_quantile((1 + level) / 2, n - 1) + t_quantile(power, n - 1)) * sd / effect) ** 2:
        n += 1
    return n


def estimate(values, digits=4, sign=""):
    """'mean ± half-width' (95 % t), or 'mean (one seed)'."""
    mean, half = mean_ci(values)
    if len(values) < 2:
        return f"{mean:{sign}.{digits}f} (one seed)"
    return f"{mean:{sign}.{digits}f} ± {half:.{digits}f}"


# the end points a record holds: train.py's final val loss (the mean of its last 3 evaluations,
# the primary one) and its tail val loss (the mean of the last 12, --tail_evals: the second)
ENDPOINTS = {"final": "final_val_loss", "tail": "tail_val_loss"}


def paired(runs, other, endpoint="final"):
    """The blocks both dicts {block: record} hold (a block: (machine, seed)), and runs' val loss
    minus other's on each, at `endpoint` (ENDPOINTS; a block whose records lack it is left
    out)."""
    key = ENDPOINTS[endpoint]
    blocks = [b for b in sorted(runs) if b in other
              and runs[b].get(key) is not None and other[b].get(key) is not None]
    return blocks, [runs[b][key] - other[b][key] for b in blocks]


def includes_zero(values):
    mean, half = mean_ci(values)
    return abs(mean) <= half


def wrap(text, width=100):
    """A generated paragraph in lines of at most `width` characters (never breaking a word, a
    hyphenated name, "23 %" or "± 0.0017"); a leading "- " makes the rest hang under it, as a
    markdown bullet."""
    indent = "  " if text.startswith("- ") else ""
    kept = text.replace(" %", "\u00a0%").replace("± ", "±\u00a0")   # textwrap splits no NBSP
    return textwrap.fill(kept, width, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False).replace("\u00a0", " ")
