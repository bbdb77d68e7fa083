# The two set-up commands of the README: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: most tests wait on subprocesses (imports, torchrun, Slurm),
# so two workers keep both cores busy. Each test module stays on one worker (--dist loadscope),
# its module fixtures run once, and tests/conftest.py starts the longest modules first.
TEST_WORKERS ?= 2

.PHONY: demo test lint format clean

$(BIN)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# One pip call so torch==2.13.0 (local CPU wheel) constrains everything else.
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt
	# The recipe itself, editable and without dependencies (pinned above): scripts, benchmarks
	# and torchrun workers import model_utils from wherever they run.
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m scripts.demo

test: $(BIN)/.installed
	bash scripts/install_test_deps.sh $(VENV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
