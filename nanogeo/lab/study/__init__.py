"""
Convergence studies: the same training run with each gradient communication method, over a grid
of methods x optimizers x seeds x data-parallel ranks, compared seed by seed with Student t
intervals; and the short fp32 learning-rate sweep that tunes each optimizer before a study.

    python -m nanogeo.lab.study --comms fp32,bf16,fp8,geofp8 --nproc 2 --out_dir out/ablate [-- TRAIN FLAGS]
    python -m nanogeo.lab.study --sweep muon_lr=1e-3,3e-3,1e-2 --optimizers muon --workers 32 \\
        --seeds 0,1 --out_dir out/sweep -- --preset=char-study --max_iters=300
    python -m nanogeo.lab.study --comms fp32,fp8-paper,subspace-paper --workers 32 --seeds 0,1,2 \\
        --optimizers muon --lr_from out/sweep/sweep.json --out_dir out/study -- --preset=char-study

Runs. One process per run: `torchrun --nproc_per_node=N train.py` for real ranks (--nproc), or
`python train.py --simulate_workers=W` for W ranks simulated in one process (--workers; the
same numerics, see train.py). Runs live in out_dir/COMM/OPTIMIZER/simW (or ranksN)/seedS (a
sweep's in out_dir/FLAG=VALUE/fp32/...); a run whose log ends with its summary and whose command
(command.json) was this one is skipped, so an interrupted study resumes where it stopped; an
unfinished run starts again from step 0. Extra flags after `--` go to every run.

What a run's record holds (out_dir/results.json, rewritten after every run): the whole command
(train.py and every flag), the train flags its group shares (learning rates and the flags after
`--`), the commit it ran at (git rev-parse HEAD, and whether tracked files had changes) and the
machine (CPU, torch version, OMP_NUM_THREADS: another CPU rounds differently, machine()), its
preset, steps and the learning rates train.py resolved; its final val loss (train.py's summary:
the mean of the last --final_evals evaluations, 3 with --preset=char-study), the bytes each rank
sent per step averaged over all steps (every collective of the gradient communication: the
two-stage collective's all_to_all and all_gather, or the paper's FP8 all-reduce and the MAX
all-reduce of its scales, and the K-FAC statistics' all-reduce of the published GeoFP8; not
the few-number all-reduces of the gain check, the finiteness flag and the geometry checksum,
nor those every method shares), ms per step and the train-loss curve. Records are merged by
their whole command: a call with other flags adds records beside the earlier ones, never
mixes with them; records from before the command was stored are kept, on their own. (A run
is not repeated for a new commit or machine; each table's heading lists both.)

Statistics (out_dir/study.md): per optimizer, W and set of train flags, every method's runs are
compared with fp32's and the reference's runs of the same seeds (same initialisation, same
data) on the same machine, so what a seed does to every method alike cancels. A pair never spans
two CPUs (every arm of a seed runs on one machine), but a study's seeds may come from several:
their per-seed differences are pooled (a block = a machine's seed), each machine's mean shown
beside the pooled one and flagged where it differs; runs whose machine was not recorded stay
in a group of their own.
  * final val loss: mean over seeds +- the half-width of the 95 % Student t interval;
  * gap to fp32 and gap to the reference (--reference, default the first compressed Euclidean
    method in --comms): the per-seed differences, their mean +- 95 % t half-width (a paired
    t interval);
  * recovered fraction of the reference's gap: per seed f = 1 - gap / reference gap, then the
    mean of f with a 95 % t interval over seeds; with >= 8 seeds a 95 % percentile bootstrap
    of that mean instead, labelled "bootstrap" (with 3 seeds a bootstrap has 27 resamples and
    its cut-offs are just the lowest and highest seed). No fraction is printed when the
    reference's own gap is not established: its paired t interval includes 0 ("reference gap
    not significant"), or some seed's reference gap is <= 0.
A row with one seed says "one seed" where an interval would be. t intervals assume per-seed
values spread roughly normally; with 2 or 3 seeds they are wide (t = 12.7 and 4.30), honestly.

The sweep (--sweep FLAG=V1,V2,...; FLAG: learning_rate or muon_lr) runs fp32 at every value
and writes out_dir/sweep.json and sweep.md: per optimizer and W the mean final val loss of each
value over the seeds all values share, its paired gap to the best value, and the best (lowest
mean; flagged when it lies at an end of the grid). --lr_from sweep.json then passes the best
value of every flag swept for an optimizer to every method of that optimizer at that W (one
flag at a time: each flag's best is the one its own sweep found). The schedule's floor
--min_lr stays as set, so a learning_rate sweep moves the peak only; Muon's lr follows
learning_rate's warm-up and cosine scaled to its own peak, so a muon_lr sweep keeps the shape.

With matplotlib installed, out_dir/loss_OPTIMIZER_simW.png (or _ranksN): the study's train-loss
curves, mean over seeds with a min-max band.

--answer RESULTS[,RESULTS...] prints the which-method-to-run tables under the study's rule
(rule.py: every pair of candidates compared on the seeds they share, Holm-adjusted in the family
docs/study/plan.md gives it, the cheapest candidate no other beats; controls never recommended,
equivalence only by a TOST within --margin); --comparisons the table of every comparison they
rest on, each labelled planned, retrospective or exploratory (plan.py). With --readme FILE
(repeatable) --answer rewrites every generated block FILE holds instead (page.py: the README's
what-to-run table; docs/study/README.md's answer tables, families, findings, comparisons and
machines), and --figure PNG draws the forest plot of the paired differences with its values
beside it (figure.py) - one command for all of it (docs/study/README.md names it).

The package, by what each part is for:
    arms.py         COMMS (method -> train.py flags) and what kind of method each is
    runs.py         each run's command, running it (resumable), its record and provenance
    stats.py        Student t, paired intervals, TOST, Welch, recovered fractions; Fieller's
                    interval of a ratio, Holm's and Benjamini-Hochberg's corrections, the seeds
                    a power needs, the words an interval allows
    report.py       study.md's tables, pooling machines; reading several results files
    compare.py      pairwise comparisons in the study's words (--comparisons)
    plan.py         docs/study/plan.md read: planned, retrospective and exploratory comparisons
    rule.py         the rule, its tests and their families (Holm), both end points
    answer.py       the answer tables (--answer)
    findings.py     what the data show, in words written from the numbers
    figure.py       the forest plot and its values (--figure)
    page.py         the generated blocks of the README and docs/study/README.md (--readme)
    transfer.py     the char-wide replication beside char-study: each hypothesis on both
                    models, each pick held / not shown / reversed (--transfer)
    sweep.py        the learning-rate sweep and --lr_from
    diagnostics.py  gain history, loss plots, the error by stage (--stages), --sensitivity
    cli.py          the command line (python -m nanogeo.lab.study)
"""

from nanogeo.lab.study.answer import answer, answers, choices, recommend  # noqa: F401
from nanogeo.lab.study.arms import BUDGETS, COMMS, EUCLIDEAN, cost, is_control  # noqa: F401
from nanogeo.lab.study.compare import comparisons, words  # noqa: F401
from nanogeo.lab.study.figure import forest, write_figure  # noqa: F401
from nanogeo.lab.study.findings import findings  # noqa: F401
from nanogeo.lab.study.page import (ANSWER_BEGIN, ANSWER_END, COMPARISONS_BEGIN,  # noqa: F401
                                      COMPARISONS_END, SUMMARY_BEGIN, SUMMARY_END, machines,
                                      summary, write_blocks)
from nanogeo.lab.study.diagnostics import (at_endpoint, gain_history, plot,  # noqa: F401
                                             sensitivity, stage_table)
from nanogeo.lab.study.report import group, load_results, study_groups, table  # noqa: F401
from nanogeo.lab.study.runs import (StudyRun, execute, git_commit, machine,  # noqa: F401
                                      merge, provenance, record, write)
from nanogeo.lab.study.stats import (MARGIN, edge, estimate, fieller, holm,  # noqa: F401
                                       mean_ci, paired, recovered, reference_problem,
                                       seeds_for_power, t_quantile, tost, verdict,
                                       welch_differs)
from nanogeo.lab.study.sweep import (lr_flags, parse_sweep, sweep_summary,  # noqa: F401
                                       sweep_table)
from nanogeo.lab.study.cli import main  # noqa: F401,E402
