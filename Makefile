# Every target creates .venv on first use and installs the package with its pinned deps.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint coverage clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m torchlevels.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

# The bench extra (opacus, a timed reference) on top; the package's torch==2.13.0 pin holds.
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run

coverage: $(STAMP)
	$(BIN)/python -m torchlevels.coverage

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
