# The two set-up commands of the README: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: one more than the cores (2 to 8), since a fifth of a
# worker's time is waiting (benchmarks/results/2026-12-05-make-test.md). Each test module stays on
# one worker (--dist loadscope); tests/conftest.py starts the longest modules first.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 > 8 ? 8 : n + 1 < 2 ? 2 : n + 1 )))

.PHONY: demo test lint format clean

# Built once per machine and copied from ~/.cache/llama-fp8/venvs after that (VENV_CACHE=
# builds it from the wheels): tools/make_venv.sh says why.
$(BIN)/.installed: requirements.txt requirements-dev.txt pyproject.toml tools/make_venv.sh
	bash tools/make_venv.sh $(PY) $(VENV)
	touch $@
	@echo "make: environment ready: commands in README.md and docs/ run .venv/bin/python"

demo: $(BIN)/.installed
	@echo "make demo: trains the tiny preset twice on CPU (--fp8=0, then --fp8=1, emulated) and"
	@echo "           compares them; each run's log says how long it has left"
	$(BIN)/python -m scripts.demo

# The suite's Debian packages install while pip builds the venv (each waits on the network or
# one core, not on the other).
test:
	@bash tools/install_test_deps.sh & deps=$$!; \
		$(MAKE) --no-print-directory $(BIN)/.installed; venv=$$?; \
		wait $$deps || exit $$?; exit $$venv
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
