"""Style rules of the project's own modules that a reader would otherwise have to police.

Read with ``ast`` from the files of ``resilienced/``, ``handlers/`` and ``trainer/``:

1. one way to log: no ``%``-format log call anywhere (``log.info("step %d", n)``), and no stdlib
   ``logging.getLogger`` in ``resilienced/`` or ``handlers/`` (they log through structlog,
   ``resilienced.log.get``; ``resilienced/log.py`` itself configures the stdlib root so that
   libraries' records come out as the same JSON lines).  ``trainer/`` keeps stdlib logging: it
   runs in the training image, which does not install structlog (deploy/images/trainer-requirements.txt),
   so its calls are key=value text instead;
2. every function of the daemon (``resilienced/``, ``handlers/``) is shorter than 80 lines.

Each rule is also run on a small bad sample, so a checker that finds nothing cannot pass unseen.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LOG_CONFIG = ROOT / "resilienced" / "log.py"
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}
PERCENT = re.compile(r"%(\([^)]*\))?[-#0 +]*(\d+|\*)?(\.(\d+|\*))?[diouxXeEfFgGcrsa]")
MAX_LINES = 80


def files(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]


def percent_log_calls(source: str) -> list[int]:
    """Lines of log calls whose message is a ``%`` template (a string with ``%s``, ``%(x)d``...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS and node.args):
            continue
        message = node.args[1] if node.func.attr == "log" and len(node.args) > 1 else node.args[0]
        if isinstance(message, ast.BinOp) and isinstance(message.op, ast.Mod):
            message = message.left  # log.info("x %s" % y): a %-format all the same
        if isinstance(message, ast.Constant) and isinstance(message.value, str) \
                and PERCENT.search(message.value):
            found.append(node.lineno)
    return found


def stdlib_loggers(source: str) -> list[int]:
    """Lines that make a stdlib logger: ``logging.getLogger(...)`` or ``getLogger(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "getLogger":
                found.append(node.lineno)
    return found


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function of ``MAX_LINES`` lines or more."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 >= MAX_LINES]  # type: ignore[operator]


BAD_LOGS = '''
import logging
log = logging.getLogger(__name__)
log.info("restored step %d from %s", step, path)
log.warning("%s", e)
log.log(logging.INFO, "%(name)s", {"name": 1})
log.info("x %s" % y)
log.info("at 50%", step=1)
log.info("restored", step=step, path=path)
'''


def test_the_log_checkers_find_what_they_look_for() -> None:
    assert percent_log_calls(BAD_LOGS) == [4, 5, 6, 7]
    assert stdlib_loggers(BAD_LOGS) == [3]


def test_no_percent_format_log_call_in_the_projects_modules() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in files("resilienced", "handlers", "trainer")
           for line in percent_log_calls(path.read_text())]
    assert not bad, f"%-format log calls (log key-value fields instead): {bad}"


def test_the_daemon_logs_through_structlog_only() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in files("resilienced", "handlers")
           if path != LOG_CONFIG for line in stdlib_loggers(path.read_text())]
    assert not bad, f"stdlib loggers (use resilienced.log.get(__name__)): {bad}"


def test_the_function_length_checker_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))  # with its def: 80 lines
    short = "\n".join(f"    y{i} = {i}" for i in range(MAX_LINES - 2))  # 79 lines
    found = long_functions(f"def long():\n{body}\n\nasync def short():\n{short}\n")
    assert found == [("long", 1, MAX_LINES)]


def test_every_function_of_the_daemon_is_under_80_lines() -> None:
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({size} lines)"
            for path in files("resilienced", "handlers")
            for name, line, size in long_functions(path.read_text())]
    assert not long, f"functions of {MAX_LINES} lines or more (split them): {long}"


def wait_for_calls(source: str) -> list[int]:
    """Lines that call ``asyncio.wait_for``."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "wait_for"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "asyncio"]


def test_the_wait_for_checker_finds_a_call() -> None:
    assert wait_for_calls("import asyncio\nasync def f(x):\n    return await asyncio.wait_for(x, 1)\n") == [3]


def test_no_asyncio_wait_for_in_the_projects_modules() -> None:
    """Python 3.11's ``asyncio.wait_for`` returns the result when the caller is cancelled in the
    iteration its awaitable completes: the cancellation (Ctrl-C, a shutdown) is lost (CPython
    gh-86296, fixed in 3.12).  ``async with asyncio.timeout(...)`` has no such race."""
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in files("resilienced", "handlers", "trainer")
           for line in wait_for_calls(path.read_text())]
    assert not bad, f"asyncio.wait_for (use async with asyncio.timeout): {bad}"
