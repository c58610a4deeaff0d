# corechat: `make serve` runs the service, `make test` runs the tests, both from a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_MODEL_DIR ?= $(HOME)/.cache/corechat/demo-qwen2.5-0.5b
DEMO_PRESET ?= qwen2.5-0.5b
SYSTEM_PACKAGES := redis-server prometheus nginx chromium chromium-driver systemd
APT_MARKER := $(VENV)/.apt-$(shell echo $(SYSTEM_PACKAGES) | md5sum | cut -c1-8)

.PHONY: setup system-deps serve demo-model test bench bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) requirements.txt requirements-dev.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed

# Debian packages the tests start for real (Redis, and what the deploy and browser tests check).
system-deps: $(APT_MARKER)

$(APT_MARKER): | $(PY)
	@missing=""; for pkg in $(SYSTEM_PACKAGES); do dpkg -s $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
	touch $@

demo-model: setup
	@if [ -z "$(MODEL)" ]; then $(PY) -m service.devmodel $(DEMO_MODEL_DIR) --preset $(DEMO_PRESET) >/dev/null; fi

# Serve on the embedded default: the demo model (random weights!) unless MODEL is set.
serve: demo-model
	MODEL="$${MODEL:-$(DEMO_MODEL_DIR)}" $(VENV)/bin/gunicorn -c gunicorn.conf.py

test: setup system-deps
	$(PY) -m pytest -q

# The benchmark (minutes; builds the 0.5B dev model once under ~/.cache/corechat); see README, Performance.
bench: setup system-deps
	$(PY) bench/run.py

# Every benchmark scenario on the tiny model with few repetitions: keeps the benchmark working in CI.
bench-quick: setup system-deps
	$(PY) bench/run.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
