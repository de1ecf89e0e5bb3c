# One command sets up and runs: `make train` (main job) and `make test` (the suite).
# The virtualenv lives in .venv; torch is pinned to the CPU build this machine kind ships.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train demo test test-slow clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(BIN)/flowloop train

demo: setup
	$(BIN)/flowloop eval --split heldout --json runs/demo/eval.json --grid runs/demo/heldout_grid.png
	$(BIN)/flowloop generate "two red circles" --out runs/demo/samples

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
