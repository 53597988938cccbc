"""
Command-line flags for train.py and the tools that share its configuration (nanogeo.lab.capture,
nanogeo.lab.profile): every field of a config dataclass is a flag, `--name=value` or `--name value`
(a bare `--name` sets a boolean). A preset fills defaults; explicit flags win; unknown flags,
bad values and out-of-range numbers are a ConfigError whose message names the fix.
"""
import dataclasses
import json
import os
import sys

import compress
import model as model_lib
from nanogeo.parallel.communicator import (Options, COLLECTIVES, FEEDBACK_STAGES, SUM_ORDERS,
                                           WHITEN_SIDES)
from nanogeo.geometry import hadamard, layers
from nanogeo.wire import collective, nvfp4


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the fix."""


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# train.py's per-preset defaults for the training loop (the model shapes live in model.PRESETS)
# and the allowed values of its string flags.
TRAIN_PRESETS = {
    "cpu-tiny": dict(batch_size=8, block_size=128, learning_rate=3e-3, max_iters=200,
                     warmup_iters=20),
    # many simulated ranks on one CPU: train.py --preset=char-study --simulate_workers=32
    # (the final val loss: the mean of 3 evaluations on 16 x 4 x 64 = 4096 tokens per rank)
    # Muon's peak from the fp32 sweep at W = 32, 300 steps (BENCHMARKS.md section 14: 3e-2 best
    # of 5e-4 ... 1e-1). AdamW's sweep found a plateau 1e-2 ... 3e-2; learning_rate stays 3e-3
    # here because it is also the peak of Muon's AdamW groups (embeddings, gains), which its
    # sweep ran at - a study passes AdamW's best explicitly (nanogeo.lab.study --lr_from)
    "char-study": dict(data_dir="data/shakespeare_char", batch_size=4, block_size=64,
                       learning_rate=3e-3, min_lr=3e-4, muon_lr=3e-2, max_iters=2000,
                       warmup_iters=100, eval_interval=250, eval_iters=16, final_evals=3,
                       log_interval=50),
    # char-study's loop for its wider sibling (transfer checks of the studies)
    "char-wide": dict(data_dir="data/shakespeare_char", batch_size=4, block_size=64,
                      learning_rate=3e-3, min_lr=3e-4, muon_lr=3e-2, max_iters=2000,
                      warmup_iters=100, eval_interval=250, eval_iters=16, final_evals=3,
                      log_interval=50),
    "llama-300m": dict(batch_size=4, block_size=2048, grad_accum=2, learning_rate=1.5e-3,
                       min_lr=1.5e-4, max_iters=20000, warmup_iters=1000, eval_interval=500,
                       eval_iters=20, ckpt_interval=1000),
    "llama-600m": dict(batch_size=4, block_size=2048, grad_accum=2, learning_rate=1e-3,
                       min_lr=1e-4, max_iters=20000, warmup_iters=1000, eval_interval=500,
                       eval_iters=20, ckpt_interval=1000),
    # the paper's recipe: Muon (lr 5e-4 -> 5e-5, momentum 0.9, 5 Newton-Schulz steps, weight
    # decay 0.1) with AdamW (0.9, 0.95) on embeddings and gains, clip 1.0; 16K tokens per rank-step
    "paper-300m": dict(batch_size=2, block_size=4096, grad_accum=2, optimizer="muon",
                       learning_rate=5e-4, min_lr=5e-5, max_iters=20000, warmup_iters=1000,
                       eval_interval=500, eval_iters=20, ckpt_interval=1000),
    "paper-600m": dict(batch_size=4, block_size=2048, grad_accum=2, optimizer="muon",
                       learning_rate=5e-4, min_lr=5e-5, max_iters=20000, warmup_iters=1000,
                       eval_interval=500, eval_iters=20, ckpt_interval=1000),
}

TRAIN_CHOICES = {"comm": ("auto", "fp32", "bf16", "fp8", "geofp8", "subspace", "hadamard"),
                 "device": ("auto", "cpu", "cuda"), "fmt": collective.FORMATS,
                 "collective": COLLECTIVES, "sum_order": SUM_ORDERS,
                 "whiten_factor": layers.WHITEN_FACTORS, "whiten_sides": WHITEN_SIDES,
                 "whiten_solver": layers.WHITEN_SOLVERS,
                 "hadamard_sides": hadamard.HADAMARD_SIDES,
                 "geo_judge": compress.JUDGES, "preset": tuple(model_lib.PRESETS),
                 "optimizer": ("adamw", "muon"),
                 "muon_adjust_lr": ("original", "match_rms_adamw"),
                 "stage2_fmt": ("", *collective.FORMATS), "nvfp4_scale": nvfp4.NVFP4_SCALES,
                 "stochastic_stages": tuple(collective.ROUNDING_STAGES),
                 "feedback_stages": FEEDBACK_STAGES, "impl": ("fast", "reference")}


def parse_value(field, text):
    """One flag's text -> the field's type (bool, int, float or str)."""
    kind = field.type
    if kind is bool:
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ConfigError(f"--{field.name} expects true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{field.name} expects {kind.__name__}, got {text!r}") from None


def parse_config(argv, config_class, presets, choices, doc):
    """--key=value (or --key value) flags -> config. The preset fills defaults, explicit flags
    override them. `doc` is what --help prints above the flags (the calling module's docstring)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    given = {}
    argv = list(argv)
    while argv:
        arg = argv.pop(0)
        if arg in ("-h", "--help"):
            print(doc)
            print("flags (default):")
            for f in fields.values():
                print(f"  --{f.name}={f.default}")
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --key=value")
        key, has_value, value = arg[2:].partition("=")
        if key not in fields:
            close = [k for k in fields if k.startswith(key[:3])]
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"unknown flag --{key}{hint}; see --help for the list")
        if not has_value:   # --key value, or a bare boolean --key
            is_bool = fields[key].type is bool
            if argv and not argv[0].startswith("--") and (not is_bool or argv[0].lower() in TRUE_WORDS + FALSE_WORDS):
                value = argv.pop(0)
            elif is_bool:
                value = "true"
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE")
        given[key] = parse_value(fields[key], value)
    preset = given.get("preset", config_class.preset)
    if preset not in presets:
        raise ConfigError(f"unknown --preset={preset}; choose one of {', '.join(presets)}")
    config = config_class(**{**presets[preset], **given})
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ConfigError(f"--{key}={getattr(config, key)} is not one of "
                              f"{', '.join(a or repr(a) for a in allowed)}")
    positive = ("max_iters", "batch_size", "block_size", "grad_accum", "eval_interval",
                "eval_iters", "final_evals", "log_interval", "geo_rank", "whiten_rank",
                "scale_sync_every", "muon_ns_steps")
    for key in positive:
        if hasattr(config, key) and getattr(config, key) < 1:
            raise ConfigError(f"--{key} must be >= 1, got {getattr(config, key)}")
    if getattr(config, "tail_evals", 0) < 0:
        raise ConfigError(f"--tail_evals must be >= 0 (0: off), got {config.tail_evals}")
    if getattr(config, "bucket_mb", 0) < 0:
        raise ConfigError(f"--bucket_mb must be >= 0 (MiB per bucket; 0: the whole model as "
                          f"one bucket), got {config.bucket_mb}")
    if getattr(config, "learning_rate", 1) <= 0:  # every group's lr is a multiple of it
        raise ConfigError(f"--learning_rate must be > 0, got {config.learning_rate}")
    stray = [k for k in given if k.startswith("muon_")]
    if stray and getattr(config, "optimizer", None) != "muon":
        raise ConfigError(f"--{stray[0]} applies only with --optimizer=muon")
    if hasattr(config, "block"):
        parse_block(config.block)
    return config


def parse_block(text):
    """--block: an element count, 'row' or 'tensor'."""
    if text in ("row", "tensor"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"--block={text} must be a positive integer, row or tensor")


def parse_geo_layers(text):
    """--geo_layers -> Options fields: 'gain', 'all', 'fragile:K' (the K matrices whose FP8
    sums saturate most during the warm-up) or a file listing weight names (nanogeo.lab.profile)."""
    if text in ("gain", "all"):
        return {"select": text}
    if text.startswith("fragile:"):
        k = text.partition(":")[2]
        if not k.isdigit() or int(k) < 1:
            raise ConfigError(f"--geo_layers={text}: use fragile:K with K >= 1, "
                              "e.g. fragile:4")
        return {"select": "fragile", "top_k": int(k)}
    if not os.path.isfile(text):
        raise ConfigError(f"--geo_layers={text}: not gain, all, fragile:K or an existing file; "
                          "write one with `python -m nanogeo.lab.profile`")
    with open(text) as f:
        names = json.load(f)["selected"] if text.endswith(".json") else f.read().split()
    return {"select": "list", "geo_layers": tuple(names)}


GEOMETRY = {"fp8": "euclidean", "geofp8": "geofp8", "subspace": "subspace", "hadamard": "hadamard"}


def geo_options(cfg, vocab_size=0, vocabulary=()):
    """Options from the training flags (shared with the DDP hook and tools). One vocabulary:
    every flag that names an Options field is that field (--geo_refresh is geo_refresh, ...);
    --comm picks the geometry, --block and --geo_layers are parsed. `vocabulary`: the weights
    that stay Euclidean as the vocabulary's (hooks.vocabulary_layers); `vocab_size`: the same by
    shape, for callers that know shapes only."""
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Options)
             if hasattr(cfg, f.name) and f.name not in ("geometry", "block", "geo_layers")}
    try:
        return Options(**flags, geometry=GEOMETRY[cfg.comm], block=parse_block(cfg.block),
                       vocab_size=vocab_size, vocabulary=tuple(vocabulary),
                       **parse_geo_layers(cfg.geo_layers))
    except ValueError as e:     # a combination Options rejects; its message names the fix
        raise ConfigError(str(e)) from None
