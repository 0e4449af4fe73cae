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

# `ruff format --check` covers only these files (already in ruff's format) until the code base is reformatted once
# with `ruff format` after the open branches are merged; from then on FORMAT_PATHS is `.` (the whole tree).
FORMAT_PATHS := tedebug/config/__init__.py tedebug/config/errors.py tedebug/config/parsing.py \
	tedebug/config/schedule.py tedebug/config/validation_rounds.py tedebug/quantization/__init__.py \
	tedebug/quantization/formats.py tedebug/sinks/__init__.py tedebug/sinks/batch.py tedebug/sinks/record_file.py \
	tedebug/sinks/tb_crc.py tedebug/stats/__init__.py

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
