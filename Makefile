# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast bench chaos install clean

.DEFAULT_GOAL := test

include deploy/tools.mk

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned here too: a newer or unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[train,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/resilienced drill

test: $(STAMP) deploy-tools
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not e2e"

bench: $(STAMP)
	$(PY) bench/intake.py
	$(PY) bench/burst.py
	$(PY) bench/checkpoint.py
	$(PY) bench/drill.py
	$(PY) bench/notify.py

# The full reliability campaign (docs/reliability.md); its quick form runs in `make test`
# (tests/chaos/test_campaign.py).
chaos: $(STAMP)
	$(PY) -m tests.chaos.campaign --out chaos-report.json

clean: deploy-tools-clean
	rm -rf $(VENV) .pytest_cache .hypothesis
