# Two entry points for a fresh machine: `make test` and `make demo`.
# Both create .venv (CPU torch pinned for speed), install tedebug editable, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# `ruff format --check` covers the whole tree (run `.venv/bin/ruff format .` before committing)
FORMAT_PATHS := .

.PHONY: test demo install lint typecheck
install: $(BIN)/.installed

test: $(BIN)/.installed
	$(BIN)/python -m pytest

# ruff's lint rules, ruff's formatting and the type checker; .ci/run runs this before the tests
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $(FORMAT_PATHS)
	$(MAKE) --no-print-directory typecheck

# mypy on the packages listed under [tool.mypy] in pyproject.toml (incremental: a re-run takes a few seconds)
typecheck: $(BIN)/.installed
	$(BIN)/mypy

demo: $(BIN)/.installed
	$(BIN)/python examples/train_gpt.py
