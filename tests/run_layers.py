"""``make test``: the e2e layer in parts and the other two layers, side by side, as pytest processes.

``python tests/run_layers.py [PYTEST ARGS...]`` runs the e2e layer but its ``long`` stories as the
parts of :data:`E2E_PARTS` (one ``pytest -m "e2e and not long"`` process each; the first one's
output as it comes) and ``pytest -m "unit or integration"`` beside them, as the two parts of
:data:`FAST_PARTS`; the other outputs are kept in files and printed once everything is done.
Inside a part the tests run one after the other; the parts share the machine. An e2e test waits far more than it computes (a
trainer's padded steps, a drain's deadline, Ray's polls: about 40 % of two cores in use,
measured with one e2e process), so the parts overlap their waits. Exit status: 0 when every
process passed, else the first non-zero of (the e2e parts in order, the fast layers). Ctrl-C
stops them all. docs/development.md.

The ``cluster`` layer (the daemon on the real control plane) runs as one more process beside them
(``pytest -m cluster``), in ``make test`` and ``--all``.

``--long`` (``make test-long``) runs only the ``long`` stories, as the parts of :data:`LONG_PARTS`;
``--fast`` (``make test-fast``) only the unit and integration layers, as the parts of :data:`FAST_PARTS`;
``--all`` (``make coverage``) runs every test: the parts of :data:`E2E_PARTS` with the long stories
in them, and the fast layers. When the arguments name tests (a path or a node id), the e2e layer,
long stories included, runs as one process on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

#: What the fast parts run: the unit and integration layers.
FAST_SELECTION = "unit or integration"
#: What the cluster part runs (one process beside the others, in ``make test`` and ``--all``): the
#: ``cluster`` layer, the daemon on the real control plane (tests/support/controlplane), wherever
#: its tests are (tests/cluster, and the stand-ins' contracts run against the real server).
CLUSTER_SELECTION = "cluster"
#: What each mode runs of the e2e layer (the fast layers run beside it, but in ``--long``).
E2E_SELECTION = {"": "e2e and not long", "--long": "e2e and long", "--all": "e2e"}
ROOT = Path(__file__).resolve().parent.parent

#: The e2e layer's parts: (name, test paths relative to the repository). ``None``: every other
#: e2e test (``tests/`` without the paths of the parts before it). Each part starts its own
#: session fixtures (moto, the trainer tests' Ray cluster); what shares one stays in one part.
#: Sized from ``--durations`` (docs/development.md): about the same time each.
E2E_PARTS: list[tuple[str, list[str] | None]] = [
    # the replay CLI's and the Kubernetes view's own Ray clusters here too: the rest ended last (Dec 4,
    # runs 75-77: 60 s after this part), these two modules took about 50 s of it
    ("drill and Ray clusters", ["tests/local", "tests/trainer/test_local_ray_cluster.py",
                                "tests/cli/test_replay_targets.py", "tests/kube/test_ray_e2e.py"]),
    # the modules on local ranks first: the Ray modules' session cluster starts after them, not
    # before, and is not kept idle while they run
    ("trainer", ["tests/trainer/test_local_resume.py", "tests/trainer/test_elastic_units.py",
                 "tests/trainer/test_resilience_api.py", "tests/trainer/test_elastic_ray.py",
                 "tests/trainer/test_ray_preemption.py", "tests/trainer/test_framework_callbacks.py",
                 "tests/trainer/test_your_trainer.py"]),
    ("the rest", None),
]


#: The unit and integration layers' parts (``make test`` and ``--all``): two processes of whole
#: modules, so that they end with the e2e parts instead of alone after them (on their own they
#: wait more than they compute: about 35 % of two cores). A long test's quick forms are checked
#: where both are collected: the last part collects the whole suite (``part_args``' ``collect_all``).
FAST_PARTS: list[tuple[str, list[str] | None]] = [
    ("intake, recovery, benchmarks, deploy", ["tests/intake", "tests/recovery", "tests/bench", "tests/deploy"]),
    ("the rest", None),
]

#: ``make test-long``'s parts: the long stories (``pytest.mark.long``), in three processes.
LONG_PARTS: list[tuple[str, list[str] | None]] = [
    ("elastic", ["tests/trainer/test_elastic_ray.py"]),
    ("drill", ["tests/local"]),
    ("the other long stories", None),
]


def names_tests(argv: list[str]) -> bool:
    """Whether pytest arguments select tests by path or node id (then the parts do not apply)."""
    return any(not arg.startswith("-") and ("::" in arg or Path(arg.split("::")[0]).exists()) for arg in argv)


def part_args(parts: list[tuple[str, list[str] | None]], *,
              collect_all: bool = False) -> list[tuple[str, list[str]]]:
    """Each part's pytest arguments: its paths, or ``tests`` without the paths named before.

    ``collect_all``: the last part collects all of ``tests`` and deselects what the parts before
    it run (``--deselect``, a node id prefix) instead of leaving it uncollected (``--ignore``), so
    that one session sees every module: the long stories' quick forms are checked against the
    whole suite (tests/conftest.py) in every make test and make test-fast.
    """
    named: list[str] = []
    out = []
    for name, paths in parts:
        if paths is None:
            if collect_all:
                rest = [f"--deselect={p}/" if (ROOT / p).is_dir() else f"--deselect={p}" for p in named]
            else:
                rest = [f"--ignore={ROOT / p}" for p in named]
            out.append((name, [str(ROOT / "tests"), *rest]))
        else:
            missing = [p for p in paths if not (ROOT / p).exists()]
            if missing:
                raise SystemExit(f"run_layers.py: the e2e part {name!r} names {missing}, which do not exist")
            named.extend(paths)
            out.append((name, [str(ROOT / p) for p in paths]))
    return out


@dataclass(frozen=True)
class Plan:
    """What one run starts: ``mode`` ("", "--long", "--fast", "--all"), the pytest arguments left, and the
    processes: the e2e parts and the fast layers' parts (none in ``--long``), each a name and its
    paths and ``-m`` selection."""

    mode: str
    argv: list[str]
    parts: list[tuple[str, list[str]]]
    fast: list[tuple[str, list[str]]]
    cluster: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)


def plan(argv: list[str]) -> Plan:
    """The processes a run starts for ``argv`` (this script's arguments)."""
    mode = next((flag for flag in ("--long", "--all", "--fast") if flag in argv), "")
    argv = [arg for arg in argv if arg not in ("--long", "--all", "--fast")]
    selection = E2E_SELECTION.get(mode, "")
    named = names_tests(argv)
    if mode == "--fast":  # make test-fast: the fast layers alone
        parts = []
    elif named:  # what is named runs, long stories included (but --long: only those)
        parts = [("e2e", ["-m", "e2e" if mode != "--long" else selection])]
    else:
        parts = [(f"e2e ({name})", [*args, "-m", selection])
                 for name, args in part_args(LONG_PARTS if mode == "--long" else E2E_PARTS)]
    fast_selection = ["-m", FAST_SELECTION]
    if named:
        fast = [("unit and integration", fast_selection)]
    else:
        fast = [(f"unit and integration ({name})", [*args, *fast_selection])
                for name, args in part_args(FAST_PARTS, collect_all=True)]
    cluster = [] if mode in ("--long", "--fast") else [
        ("cluster", ["-m", CLUSTER_SELECTION] if named else [str(ROOT / "tests"), "-m", CLUSTER_SELECTION])]
    return Plan(mode=mode, argv=argv, parts=parts, fast=[] if mode == "--long" else fast, cluster=cluster)


def main(argv: list[str]) -> int:
    run = plan(argv)
    base = [sys.executable, "-m", "pytest", *run.argv]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run-layers-") as kept_dir:
        everything = [*run.parts, *run.cluster, *run.fast]
        kept = {name: open(Path(kept_dir) / f"{i}.log", "w+b") for i, (name, _) in enumerate(everything[1:])}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for i, (name, args) in enumerate(everything):
            cmd = [*base, *args]
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
                        if name == "cluster" and proc.returncode == 5 and names_tests(run.argv):
                            codes[name] = 0  # the tests named include no cluster test
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

    def first_failure(names: list[str]) -> int:
        return next((codes[name] for name in names if codes[name]), 0)

    def each(names: list[str]) -> str:
        return ", ".join(f"{name}: {codes[name]} in {took[name]:.0f} s" for name in names)

    e2e, fast = [name for name, _ in run.parts], [name for name, _ in run.fast]
    cluster = [name for name, _ in run.cluster]
    command = {"": "make test", "--long": "make test-long", "--fast": "make test-fast", "--all": "all"}[run.mode]
    said = [f"e2e exit {first_failure(e2e)} ({each(e2e)})"] if e2e else []
    if cluster:
        said.append(f"cluster exit {first_failure(cluster)} ({each(cluster)})")
    if fast:
        said.append(f"unit and integration exit {first_failure(fast)} ({each(fast)})")
    summary = f"\n{command}: " + ", ".join(said)
    print(f"{summary}; {total_s:.0f} s in all", flush=True)
    return first_failure(e2e) or first_failure(cluster) or first_failure(fast)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
