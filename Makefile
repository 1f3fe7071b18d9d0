# One virtual environment (.venv) for everything; every target creates it if needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install install-dev run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-dev: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"

# Until the serving cluster lands (issue 4), `run` exercises what exists: the registry on a
# private loopback Redis server.
run: install
	$(BIN)/prefixmesh registry-bench --backend redis --lookups 1000

lint: install-dev
	$(BIN)/ruff check .

test: install-dev lint
	$(BIN)/python -m pytest -q

bench: install-dev
	$(BIN)/prefixmesh registry-bench --backend memory --json bench-registry-memory.json
	$(BIN)/prefixmesh registry-bench --backend redis --json bench-registry-redis.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
