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

# The OCR reward tests need the tesseract program: `test` installs it when apt-get is usable (root or
# passwordless sudo); otherwise those tests skip.
test: setup
	@command -v tesseract >/dev/null || { S=$$([ "$$(id -u)" = 0 ] || echo sudo -n); $$S apt-get update -qq; \
	  $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tesseract-ocr; } >/dev/null 2>&1 || echo "tesseract-ocr not installed (needs root or passwordless sudo): OCR tests will skip"
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
