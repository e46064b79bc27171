"""``make coverage``: line coverage of resilienced/, handlers/ and trainer/ over the whole suite,
subprocesses included (the daemon, the drill, ``python -m trainer``, its ranks, Ray's workers).

``python tests/run_coverage.py [--out DIR] [-- TEST COMMAND...]`` runs the test command (default:
``python tests/run_layers.py --all``: what ``make test`` and ``make test-long`` run) with
coverage.py started in every Python process of this interpreter's environment, then combines the
data and prints the report (also written to ``DIR/coverage.txt``; DIR defaults to
``out/coverage``). Exit status: the test command's (128 + N when signal N ended it, as a shell
says), or 1 when it passed but no data was recorded.

How every process is measured: coverage.py's own ``.pth`` file starts it in every Python process
of this environment when ``COVERAGE_PROCESS_START`` names a configuration, and a ``.pth`` file of
ours (:data:`PTH_NAME`, calling ``tests/coverage_hook.py`` copied beside it as :data:`HOOK_NAME`)
adds the periodic save of Ray's workers; without the variable neither does anything. The test
command gets that variable, and every Python process it starts inherits it (Ray's workers inherit
their raylet's environment, which is the ``ray start`` process's). Each process writes its own
data file (``parallel``): at exit, also through ``os._exit`` (``patch = _exit``) or on SIGTERM
(``sigterm``), and a Ray worker, which Ray ends below Python, every second.
A process killed with SIGKILL (a node the tests kill as an instance is lost) keeps only what it
saved before, and a Ray worker loses its last second: the figures are a lower bound.

Our two files stay in the environment (``make clean`` removes it); without the variable they
cost one ``os.environ`` lookup per interpreter start. docs/development.md, "Coverage".
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The measured packages (the issue's three; tests/ and examples/ are not measured).
PACKAGES = ("resilienced", "handlers", "trainer")
PTH_NAME = "zz-resilienced-coverage.pth"
HOOK_NAME = "resilienced_coverage_hook.py"
PTH_LINE = ("import os; os.environ.get('COVERAGE_PROCESS_START') and "
            "__import__('resilienced_coverage_hook').start()\n")


def rcfile_text(out: Path) -> str:
    sources = ", ".join(str(ROOT / name) for name in PACKAGES)
    return (
        "[run]\n"
        "parallel = true\n"
        f"data_file = {out / '.coverage'}\n"
        f"source = {sources}\n"
        "patch = _exit\n"
        "sigterm = true\n"
        "disable_warnings = no-data-collected, module-not-measured, couldnt-parse\n"
        "[report]\n"
        "skip_empty = true\n"
        "precision = 1\n"
    )


def install_hook() -> None:
    """The start-up hook and its ``.pth`` file, in this interpreter's site-packages (a virtual
    environment's own)."""
    if sys.prefix == sys.base_prefix:
        raise SystemExit("run_coverage.py: run it with the virtual environment's python (make coverage); "
                         "it writes a .pth file into site-packages")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    (site_packages / HOOK_NAME).write_text((ROOT / "tests" / "coverage_hook.py").read_text())
    (site_packages / PTH_NAME).write_text(PTH_LINE)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests/run_coverage.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "coverage",
                        help="where the data, the configuration and the report go (default: out/coverage)")
    parser.add_argument("command", nargs="*", help="the test command (after --); default: tests/run_layers.py --all")
    args = parser.parse_args(argv)
    try:
        import coverage  # noqa: F401
    except ImportError:
        raise SystemExit("run_coverage.py: coverage is not installed (the test extra has it: make install)") from None
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(".coverage*"):
        old.unlink()
    rcfile = out / "coveragerc"
    rcfile.write_text(rcfile_text(out))
    install_hook()
    command = args.command or [sys.executable, str(ROOT / "tests" / "run_layers.py"), "--all"]
    env = {**os.environ, "COVERAGE_PROCESS_START": str(rcfile)}
    code = subprocess.call(command, cwd=ROOT, env=env)
    code = 128 - code if code < 0 else code
    if not list(out.glob(".coverage.*")):
        print(f"run_coverage.py: no coverage data in {out}", file=sys.stderr)
        return code or 1
    print(report(out, rcfile))
    return code


def report(out: Path, rcfile: Path) -> str:
    """Combine the processes' data files, write ``out/coverage.txt`` (every file, then one total
    per package) and return its text with a heading."""
    import coverage

    processes = len(list(out.glob(".coverage.*")))
    cov = coverage.Coverage(data_file=str(out / ".coverage"), config_file=str(rcfile))
    cov.combine(strict=True)
    cov.save()
    text = io.StringIO()
    cov.report(file=text)
    totals = []
    for name in PACKAGES:
        try:
            percent = cov.report(include=[f"{ROOT / name}/*"], file=io.StringIO())
        except coverage.exceptions.NoDataError:
            totals.append(f"{name + '/':14} no line run")
        else:
            totals.append(f"{name + '/':14} {percent:5.1f}%")
    body = text.getvalue() + "\n" + "\n".join(totals) + "\n"
    (out / "coverage.txt").write_text(body)
    return f"\n===== line coverage ({processes} process data files; {out / 'coverage.txt'}) =====\n{body}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
