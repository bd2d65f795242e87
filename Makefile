# Every target sets itself up: `make demo` and `make test` work on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy lightning_loaders adapters examples benchmarks

test: lint
	$(PY) -m pytest

demo: setup
	$(PY) examples/quickstart.py

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache lightning_logs
