"""The Dockerfiles: hadolint finds nothing (not even a warning); the daemon image installs
exactly pyproject.toml's base dependencies, pinned, without torch; the trainer image pins what
the "train" extra pins."""

from __future__ import annotations

import json
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .tools import DEPLOY, DOCKERFILES, REPO, run, tool
import pytest

pytestmark = pytest.mark.integration

DAEMON = REPO / "Dockerfile"
TRAINER = DEPLOY / "images" / "trainer.Dockerfile"


def _pins(path) -> dict[str, Requirement]:
    reqs = [Requirement(line.split("#")[0].strip()) for line in path.read_text().splitlines()
            if line.split("#")[0].strip()]
    return {canonicalize_name(r.name): r for r in reqs}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _instructions(path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


def test_hadolint_finds_nothing_in_either_dockerfile() -> None:
    done = run([tool("hadolint"), "--format", "json", *map(str, DOCKERFILES)], timeout=120)
    findings = json.loads(done.stdout or "[]")
    assert findings == [] and done.returncode == 0, json.dumps(findings, indent=1) + done.stderr


def test_the_daemon_image_pins_every_base_dependency_and_no_torch() -> None:
    pins = _pins(DEPLOY / "images" / "daemon-requirements.txt")
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in pins.values())
    for dependency in map(Requirement, _project()["dependencies"]):
        pinned = pins.get(canonicalize_name(dependency.name))
        assert pinned is not None, f"{dependency.name} is not in daemon-requirements.txt"
        version = next(iter(pinned.specifier)).version
        assert dependency.specifier.contains(version), f"{pinned} does not satisfy {dependency}"
    assert "torch" not in pins and "resilienced" not in pins


def test_the_trainer_image_pins_what_the_train_extra_pins() -> None:
    pins = _pins(DEPLOY / "images" / "trainer-requirements.txt")
    train = {canonicalize_name(r.name): r for r in map(Requirement, _project()["optional-dependencies"]["train"])}
    assert set(pins) == set(train)
    for name, requirement in train.items():
        version = next(iter(pins[name].specifier)).version
        assert requirement.specifier.contains(version), f"{pins[name]} does not satisfy {requirement}"
    (base,) = [arg for op, arg in _instructions(TRAINER) if op == "FROM"]
    ray = next(iter(train["ray"].specifier)).version
    assert base == f"rayproject/ray:{ray}-py311-gpu", "the Ray image must be the pinned Ray version"


def test_the_daemon_image_is_multi_stage_slim_non_root_with_one_pinned_base() -> None:
    steps = _instructions(DAEMON)
    froms = [arg for op, arg in steps if op == "FROM"]
    assert len(froms) == 2 and froms[0] == f"{froms[1]} AS builder"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", froms[1])
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    users = [arg for op, arg in final if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d{3,}:[1-9]\d{3,}", users[-1]), "a numeric non-root USER"
    copies = [arg for op, arg in final if op == "COPY"]
    assert copies == ["--from=builder /opt/resilienced /opt/resilienced"], "only the built environment"
    assert not [arg for op, arg in final if op == "RUN" and re.search(r"apt|gcc|make|build-essential", arg)]
    assert ("ENTRYPOINT", '["resilienced"]') in final and ("CMD", '["run"]') in final


def test_dockerignore_admits_only_what_the_dockerfiles_copy() -> None:
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines[0] == "*"
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for path in DOCKERFILES:
        for op, arg in _instructions(path):
            if op == "COPY" and "--from=" not in arg:
                copied.update(a for a in arg.split()[:-1] if not a.startswith("--"))
    assert copied == admitted
