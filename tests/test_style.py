"""Style rules of the project's own modules that a reader would otherwise have to police.

Read with ``ast`` from the files of ``resilienced/``, ``handlers/`` and ``trainer/``:

1. one way to log: no ``%``-format log call anywhere (``log.info("step %d", n)``), and no stdlib
   ``logging.getLogger`` in ``resilienced/`` or ``handlers/`` (they log through structlog,
   ``resilienced.log.get``; ``resilienced/log.py`` itself configures the stdlib root so that
   libraries' records come out as the same JSON lines).  ``trainer/`` keeps stdlib logging: it
   runs in the training image, which does not install structlog (deploy/images/trainer-requirements.txt),
   so its calls are key=value text instead;
2. every function of the daemon (``resilienced/``, ``handlers/``) is shorter than 80 lines;
3. ``Any`` stays rare in the daemon's annotations: none in ``model.py``, ``ports.py``,
   ``recovery/`` and ``requeue/`` (the values and seams a notice is followed through), at most
   :data:`MAX_ANY` in the rest of ``resilienced/`` (outside ``local/``, the stand-ins); JSON read
   from outside is ``model.JsonValue``, a value checked before use ``object``.  Issue #22 counted
   368 of about 2,900 annotations;
4. one way to tell time: the current time is ``resilienced.clock.utcnow`` and a time read from
   text goes through ``resilienced.clock.parse_time``: no ``datetime.now(...)`` or
   ``datetime.utcnow()`` outside ``clock.py``, no ``def utcnow`` of a module's own, and no
   ``.replace("Z", "+00:00")`` before ``fromisoformat`` (Python 3.11 reads the ``Z``).

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
#: The most annotations of ``resilienced/`` (outside ``local/``) that may name ``Any``.
MAX_ANY = 100
#: Where no annotation may name ``Any``.
NO_ANY = ("resilienced/model.py", "resilienced/ports.py", "resilienced/recovery", "resilienced/requeue")
CLOCK = ROOT / "resilienced" / "clock.py"


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


def any_annotations(source: str) -> list[int]:
    """Lines of the annotations (parameters, returns, annotated assignments) that name ``Any``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            annotations = [p.annotation for p in params if p is not None and p.annotation is not None]
            annotations += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        else:
            continue
        found += [ann.lineno for ann in annotations if any(
            (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
            for n in ast.walk(ann))]
    return found


def daemon_any() -> dict[str, list[int]]:
    """file (relative) -> lines naming ``Any``, for ``resilienced/`` outside ``local/``."""
    out = {}
    for path in files("resilienced"):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith("resilienced/local/") and (lines := any_annotations(path.read_text())):
            out[relative] = lines
    return out


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


BAD_ANY = '''
from typing import Any
import typing
def f(a: Any, *b: int, c: dict[str, Any] | None = None, **d: typing.Any) -> list[Any]:
    x: Any = a
    y: int = 1
    return [x, y]
'''


def test_the_any_counter_finds_every_kind_of_annotation() -> None:
    assert any_annotations(BAD_ANY) == [4, 4, 4, 4, 5]


def test_no_any_in_the_models_the_ports_the_recovery_and_the_requeue() -> None:
    found = {path: lines for path, lines in daemon_any().items()
             if any(path == where or path.startswith(where + "/") for where in NO_ANY)}
    assert found == {}, "type these (model.JsonValue for JSON, object for a value checked before use)"


def test_any_stays_rare_in_the_daemons_annotations() -> None:
    count = sum(len(lines) for lines in daemon_any().values())
    assert count <= MAX_ANY, f"{count} annotations name Any (at most {MAX_ANY}): {daemon_any()}"


def own_clocks(source: str) -> list[int]:
    """Lines that read the clock or a ``Z`` time by hand: ``datetime.now(...)``,
    ``datetime.utcnow()``, ``def utcnow``, ``<text>.replace("Z", "+00:00")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "utcnow":
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in ("now", "utcnow") and isinstance(func.value, ast.Name) and func.value.id == "datetime":
                found.append(node.lineno)
            elif func.attr == "replace" and [getattr(a, "value", None) for a in node.args] == ["Z", "+00:00"]:
                found.append(node.lineno)
    return sorted(found)


BAD_CLOCKS = '''
from datetime import datetime, timezone
def utcnow():
    return datetime.now(timezone.utc)
when = datetime.fromisoformat(text.replace("Z", "+00:00"))
then = datetime.utcnow()
fine = moment.replace(tzinfo=timezone.utc)
'''


def test_the_clock_checker_finds_each_hand_made_clock() -> None:
    assert own_clocks(BAD_CLOCKS) == [3, 4, 5, 6]


def test_the_daemon_tells_time_through_resilienced_clock() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in files("resilienced", "handlers")
           if path != CLOCK for line in own_clocks(path.read_text())]
    assert not bad, f"use resilienced.clock.utcnow / parse_time: {bad}"


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
