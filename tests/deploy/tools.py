"""Where tests/deploy finds its tools, and the paths and builds they check.

The tools (kubectl, kubernetes-validate, cfn-lint, checkov, hadolint) live in their own virtual
environment made by ``make deploy-tools`` (deploy/tools.mk): ``$RESILIENCED_TOOLS_BIN`` if set,
else ``<repo>/.venv-tools/bin``.  A missing tool FAILS the test that needs it (locally and in
CI alike): a static check that silently skips is a check nobody runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import layers

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAY = KUBERNETES / "overlays" / "example"
EXAMPLES = DEPLOY / "examples"
STACK = DEPLOY / "aws" / "resilienced.yaml"
FSX_STACK = EXAMPLES / "aws" / "fsx-checkpoints.yaml"
FIS_STACK = DEPLOY / "aws" / "fis-spot-interruption.yaml"
TEMPLATES = (STACK, FSX_STACK, FIS_STACK)
DOCKERFILES = (REPO / "Dockerfile", DEPLOY / "images" / "trainer.Dockerfile")
SCHEMAS = Path(__file__).parent / "schemas"

#: The kustomize targets, by name.
BUILDS = {"base": BASE, "overlay": OVERLAY, "examples": EXAMPLES}


def tools_bin() -> Path:
    return Path(os.environ.get("RESILIENCED_TOOLS_BIN") or REPO / ".venv-tools" / "bin")


def tool(name: str) -> str:
    """The path of a tool, or fail the test saying how to install it."""
    path = tools_bin() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{name} not found at {path}: run `make deploy-tools` (deploy/tools.mk), or set "
                    f"RESILIENCED_TOOLS_BIN to a directory holding it", pytrace=False)
    return str(path)


def run(args: list[str], *, input: str | None = None, timeout: float = 300,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion (bounded); the caller asserts on its status and output."""
    return subprocess.run(args, input=input, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, **(env or {})})


def build(name: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize`` of one target, as parsed objects (rendered once per session).

    Each call counts as the tool's run for the test layers (tests/support/layers.py): whether the
    process starts in this test or an earlier one rendered it depends on the order tests run in."""
    layers.started("integration", f"kubectl kustomize {name} (rendered once per session)")
    return _build(name)


@cache
def _build(name: str) -> tuple[dict[str, Any], ...]:
    done = run([tool("kubectl"), "kustomize", str(BUILDS[name])], timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {BUILDS[name]} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


@cache
def built_text(name: str) -> str:
    return yaml.safe_dump_all(build(name), sort_keys=False)


def load_template(path: Path) -> dict[str, Any]:
    """A CloudFormation template with its short-form tags (!Ref, !Sub ...) kept as {Fn: value}."""
    class Loader(yaml.SafeLoader):
        pass

    def intrinsic(loader: yaml.Loader, suffix: str, node: yaml.Node) -> dict[str, Any]:
        name = suffix if suffix == "Ref" else f"Fn::{suffix}"
        if isinstance(node, yaml.ScalarNode):
            value: Any = loader.construct_scalar(node)
            if suffix == "GetAtt":
                value = value.split(".", 1)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_mapping(node, deep=True)
        return {name: value}

    Loader.add_multi_constructor("!", intrinsic)
    return yaml.load(path.read_text(), Loader=Loader)


def objects(kind: str, *names: str) -> list[dict[str, Any]]:
    """Every built object of ``kind`` in the named builds (default: base and overlay)."""
    return [doc for name in (names or ("base", "overlay")) for doc in build(name) if doc["kind"] == kind]


def one(kind: str, build_name: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in build(build_name) if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {build_name}, found {len(found)}"
    return found[0]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)
