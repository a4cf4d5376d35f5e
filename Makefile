# `make run`: set up .venv and train tiny-qwen3 on the built-in corpus (CPU).
# `make test`: set up .venv and run the whole test suite.
# `make test-fast`: the same without the multi-process (dist) and slowest (slow) tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.10"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

.PHONY: setup run test test-fast lint
setup: $(STAMP)

run: $(STAMP)
	$(BIN)/lrmoe train --preset tiny-qwen3 --out runs/tiny-qwen3 --steps 300

# two pytest workers (pytest-xdist): the multi-process tests spend much of their time
# waiting on timeouts and process start-up, which the other worker fills
test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 -m "not slow and not dist" tests

lint: $(STAMP)
	$(BIN)/ruff check src tests
