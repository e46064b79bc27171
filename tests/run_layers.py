"""``make test``: the e2e layer in parts and the other two layers, side by side, as pytest processes.

``python tests/run_layers.py [PYTEST ARGS...]`` runs the e2e layer as the parts of
:data:`E2E_PARTS` (one ``pytest -m e2e`` process each; the first one's output as it comes) and
``pytest -m "unit or integration"`` beside them; the other outputs are kept in files and printed
once everything is done. Inside a part the tests run one after the other; the parts share the
machine. An e2e test waits far more than it computes (a trainer's padded steps, a drain's
deadline, Ray's polls: about 40 % of two cores in use, measured with one e2e process), so the
parts overlap their waits. Exit status: 0 when every process passed, else the first non-zero of
(the e2e parts in order, the fast layers). Ctrl-C stops them all. docs/development.md.

When the arguments name tests (a path or a node id), the e2e layer runs as one process on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = {"e2e": "e2e", "unit and integration": "unit or integration"}
ROOT = Path(__file__).resolve().parent.parent

#: The e2e layer's parts: (name, test paths relative to the repository). ``None``: every other
#: e2e test (``tests/`` without the paths of the parts before it). Each part starts its own
#: session fixtures (moto, the trainer tests' Ray cluster); what shares one stays in one part.
#: Sized from ``--durations`` (docs/development.md): about the same time each.
E2E_PARTS: list[tuple[str, list[str] | None]] = [
    ("drill and campaign", ["tests/local", "tests/chaos"]),
    ("trainer on Ray", ["tests/trainer/test_elastic_ray.py", "tests/trainer/test_ray_preemption.py",
                        "tests/trainer/test_framework_callbacks.py", "tests/trainer/test_your_trainer.py"]),
    ("the rest", None),
]


def names_tests(argv: list[str]) -> bool:
    """Whether pytest arguments select tests by path or node id (then the parts do not apply)."""
    return any(not arg.startswith("-") and ("::" in arg or Path(arg.split("::")[0]).exists()) for arg in argv)


def part_args(parts: list[tuple[str, list[str] | None]]) -> list[tuple[str, list[str]]]:
    """Each part's pytest arguments: its paths, or ``tests`` without the paths named before."""
    named: list[str] = []
    out = []
    for name, paths in parts:
        if paths is None:
            out.append((name, [str(ROOT / "tests"), *(f"--ignore={ROOT / p}" for p in named)]))
        else:
            missing = [p for p in paths if not (ROOT / p).exists()]
            if missing:
                raise SystemExit(f"run_layers.py: the e2e part {name!r} names {missing}, which do not exist")
            named.extend(paths)
            out.append((name, [str(ROOT / p) for p in paths]))
    return out


def main(argv: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", *argv]
    parts = [("e2e", [])] if names_tests(argv) else [(f"e2e ({name})", args) for name, args in part_args(E2E_PARTS)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run-layers-") as kept_dir:
        kept = {name: open(Path(kept_dir) / f"{i}.log", "w+b") for i, (name, _) in enumerate(parts[1:])}
        kept["unit and integration"] = open(Path(kept_dir) / "fast.log", "w+b")
        procs: dict[str, subprocess.Popen[bytes]] = {}
        procs["unit and integration"] = subprocess.Popen(
            [*base, "-p", "no:cacheprovider", "-m", LAYERS["unit and integration"]],
            stdout=kept["unit and integration"], stderr=subprocess.STDOUT)
        for i, (name, args) in enumerate(parts):
            cmd = [*base, *args, "-m", LAYERS["e2e"]]
            if i == 0:
                procs[name] = subprocess.Popen(cmd)
            else:  # one cache writer is enough: the others would race on .pytest_cache
                procs[name] = subprocess.Popen([*cmd, "-p", "no:cacheprovider"], stdout=kept[name],
                                               stderr=subprocess.STDOUT)
        codes: dict[str, int] = {}
        took: dict[str, float] = {}
        try:
            pending = dict(procs)
            while pending:
                for name, proc in list(pending.items()):
                    if proc.poll() is not None:
                        codes[name], took[name] = proc.returncode, time.monotonic() - started
                        del pending[name]
                time.sleep(0.2)
        except KeyboardInterrupt:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in procs.values():
                proc.wait()
            return 130
        total_s = time.monotonic() - started
        sys.stdout.flush()
        for name, file in kept.items():
            file.seek(0)
            os.write(sys.stdout.fileno(), f"\n===== {name} (run beside the first e2e part) =====\n".encode())
            while chunk := file.read(1 << 16):
                os.write(sys.stdout.fileno(), chunk)
            file.close()
    e2e = [name for name, _ in parts]
    e2e_code = next((codes[name] for name in e2e if codes[name]), 0)
    print(f"\nmake test: e2e exit {e2e_code} (" + ", ".join(f"{name}: {codes[name]} in {took[name]:.0f} s" for name in e2e)
          + f"), unit and integration exit {codes['unit and integration']} ({took['unit and integration']:.0f} s); "
          f"{total_s:.0f} s in all", flush=True)
    return e2e_code or codes["unit and integration"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
