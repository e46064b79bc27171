# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
# The interpreter .venv is made with: Debian's python3.11 where it can make a venv, else $(PYTHON).
# Debian builds its CPython with PGO and LTO; the pyenv 3.11.7 that is python3 on this project's
# machines is built without them. make test is bound by its CPU here, and took 7 % less with
# Debian's, back to back on one commit (docs/development.md, "Times", runs 76-77). The deploy
# checkers' venv keeps $(PYTHON) (checkov's dependencies do not resolve on Debian's 3.11.2).
# VENV_PYTHON=... picks another.
VENV_PYTHON ?= $(or $(shell /usr/bin/python3.11 -c 'import ensurepip, sys; print(sys.executable)' 2>/dev/null),$(PYTHON))
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-long test-fast coverage bench chaos redis-server install clean controlplane helm

.DEFAULT_GOAL := test

include deploy/tools.mk

$(STAMP): pyproject.toml
	$(VENV_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned here too: a newer or unpinned torch pulls a multi-GB CUDA build. The hf and
	# lightning extras (the framework callbacks' tests) pull no other torch; plot (matplotlib) draws
	# `resilienced report --plot` and `resilienced drill --plot` (tests/test_plot.py).
	$(PY) -m pip install -q "torch==2.13.0" -e ".[train,test,hf,lightning,plot]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/resilienced drill

# The real Kubernetes control plane the cluster layer runs on: kube-apiserver, etcd, the scheduler,
# the controller-manager, kubectl, kwok, the KubeRay operator and Kueue, built with Go from the
# module proxy into a cache outside the checkout (~/.cache/resilienced/controlplane, keyed by the
# versions and the wrappers in tools/controlplane/): once per machine; a second run builds nothing
# (tests/support/controlplane/build.py; docs/development.md, "The real control plane").
controlplane: $(STAMP)
	$(PY) -m tests.support.controlplane.build

# helm (helm.sh/helm/v4, v4.3.2), built the same way into the same cache, for the chart's checks
# (tests/deploy/test_helm.py, tests/cluster/test_helm.py): once per machine, ~3 min cold.
helm: $(STAMP)
	$(PY) -m tests.support.controlplane.build helm

# The e2e layer (but its long stories: make test-long), the cluster layer and the two others side
# by side (tests/run_layers.py, docs/development.md).
test: $(STAMP) deploy-tools redis-server controlplane helm
	$(PY) tests/run_layers.py

# The long e2e stories that make test leaves out (pytest.mark.long: each names its quick forms in
# make test; docs/development.md, "Long stories"). CI runs make test, then this.
test-long: $(STAMP)
	$(PY) tests/run_layers.py --long

# The unit and integration layers (tests/support/layers.py): no Ray, trainer or drill; two
# processes side by side (tests/run_layers.py --fast).
test-fast: $(STAMP) deploy-tools helm
	$(PY) tests/run_layers.py --fast

# Line coverage of resilienced/, handlers/ and trainer/ over every test (make test's and
# make test-long's), every subprocess included (tests/run_coverage.py; docs/development.md,
# "Coverage"). Slower than make test.
coverage: $(STAMP) deploy-tools redis-server controlplane helm
	$(PY) tests/run_coverage.py

# bench/mass.py: the mass interruption of issue #45 on the real control plane (make controlplane).
bench: $(STAMP) controlplane
	$(PY) bench/intake.py
	$(PY) bench/burst.py
	$(PY) bench/mass.py
	$(PY) bench/checkpoint.py
	$(PY) bench/drill.py
	$(PY) bench/notify.py
	$(PY) bench/settings.py

# The full reliability campaign (docs/reliability.md); its quick form runs in `make test`
# (tests/chaos/test_campaign.py).
chaos: $(STAMP) redis-server
	$(PY) -m tests.chaos.campaign --out chaos-report.json

# The campaign's gcs-restart fault (tests/chaos/gcs.py) runs Ray's GCS fault tolerance on a Redis:
# Debian's redis-server, installed with apt-get when none is on the PATH (as root, as
# deploy/tools.mk installs promtool; elsewhere install it yourself). The campaign starts its own
# on a free port; without one it reports the fault skipped. `make test` installs it too, for
# tests/trainer/test_local_ray_cluster.py's GCS restart (skipped without it).
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "redis-server not found: run as root, or: sudo apt-get install redis-server" >&2; exit 1; \
	  fi; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server; \
	fi
	redis-server --version

clean: deploy-tools-clean
	rm -rf $(VENV) .pytest_cache .hypothesis
