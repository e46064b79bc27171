"""The trainer runs in the training image: it imports nothing from the daemon's packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TRAINER = Path(__file__).resolve().parents[2] / "trainer"


@pytest.mark.parametrize("module", sorted(TRAINER.glob("*.py")), ids=lambda p: p.name)
def test_the_trainer_imports_neither_resilienced_nor_handlers(module: Path) -> None:
    imported = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"resilienced", "handlers"}
    assert imported <= {"__future__", "trainer", "torch", "ray", "numpy"} | _stdlib()


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names)
