"""Test layers, and the check that each test's layer follows from what it starts.

Every test carries exactly one layer marker (the closest wins: a function's over its module's):

* ``unit``: pure code and in-process fakes; it starts no process and opens no network socket
  (a Unix socket pair, as an asyncio loop makes, is not the network);
* ``integration``: moto, the emulated Kubernetes API, local HTTP servers, tools run as
  processes (kubectl, promtool, cfn-lint...); no Ray, no trainer, no drill;
* ``cluster``: the real Kubernetes control plane built from source (tests/support/controlplane:
  kube-apiserver, etcd, the scheduler, the controller-manager, kwok, the KubeRay operator, Kueue),
  with moto; no Ray, no trainer, no drill;
* ``e2e``: a Ray cluster, the trainer (its ranks too), the drill, the campaign.

:class:`LayerGuard` watches every test through a Python audit hook (``sys.addaudithook``:
``subprocess.Popen``, ``os.system``/``os.posix_spawn``/``os.fork``/``os.exec``, and ``socket.connect``
/ ``socket.bind`` on an IP socket) and through :func:`started`, which test support calls where the
hook cannot see (ranks forked by a multiprocessing forkserver started earlier).  A test that does
more than its layer allows fails, naming what it started.  A whole module that did less than its
layer in a run that ran all of it (an ``integration`` module that never touched a process or the
network, an ``e2e`` module that never started Ray, the trainer or the drill) fails the session
too, so the layers of ``make test-fast`` stay what they say.

Set ``RESILIENCED_LAYERS_REPORT=FILE`` to write what each module was seen to do (JSON).

A ``long`` test (``@pytest.mark.long(*quick)``) is an ``e2e`` story that ``make test`` leaves to
``make test-long`` (CI runs both; docs/development.md, "Long stories"); ``quick`` names the tests
of ``make test`` that make its claim at less cost.  :func:`long_problems` keeps that true: a long
test is ``e2e``, names at least one quick form, and each one it names is collected and not long.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LAYERS = ("unit", "integration", "cluster", "e2e")
_RANK = {name: rank for rank, name in enumerate(LAYERS)}
#: Command words that mean Ray, the trainer or the drill (an ``e2e`` start).
_E2E_WORDS = ("ray", "raylet", "gcs_server", "redis-server")
_E2E_MODULES = ("trainer", "resilienced drill", "tests.chaos")
#: The real control plane's programs (tests/support/controlplane/build.py): a ``cluster`` start.
_CLUSTER_WORDS = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok",
                  "ray-operator", "kueue")


def classify_command(argv: Sequence[str]) -> tuple[str, str]:
    """(layer a process start needs, a short description) for ``argv``."""
    words = [str(a) for a in argv]
    line = " ".join(words)
    names = {os.path.basename(w) for w in words[:3]}
    if (names & set(_E2E_WORDS) or "ray/core/src" in line or "ray/_private" in line
            or "import ray" in line or "ray.init(" in line):
        return "e2e", f"Ray ({line[:120]})"
    if names & set(_CLUSTER_WORDS) or " tests.support.controlplane" in f" {line}":
        return "cluster", f"the real control plane ({line[:120]})"
    if "-m" in words:
        module = words[words.index("-m") + 1] if words.index("-m") + 1 < len(words) else ""
        rest = " ".join(words[words.index("-m") + 1:words.index("-m") + 3])
        if (module == "trainer" or rest.startswith("resilienced drill") or module.startswith("tests.chaos")
                or module == "ray" or module.startswith("ray.")):
            return "e2e", f"{rest} ({line[:120]})"
    return "integration", f"a process ({line[:120]})"


@dataclass
class Seen:
    """What one test was seen to start: the highest layer needed, and why."""

    rank: int = 0
    why: list[str] = field(default_factory=list)

    def add(self, layer: str, why: str) -> None:
        if _RANK[layer] > self.rank:
            self.rank = _RANK[layer]
        if len(self.why) < 5 and why not in self.why:
            self.why.append(why)


class LayerGuard:
    """Records, per test, what it started; see the module docstring."""

    def __init__(self) -> None:
        self.current: Seen | None = None
        self._lock = threading.Lock()

    def install(self) -> None:
        sys.addaudithook(self._audit)

    def begin(self) -> Seen:
        with self._lock:
            self.current = Seen()
            return self.current

    def end(self) -> None:
        with self._lock:
            self.current = None

    def note(self, layer: str, why: str) -> None:
        with self._lock:
            if self.current is not None:
                self.current.add(layer, why)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.current is None:
            return
        if event == "subprocess.Popen":
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[0] or "", str(args[1])]
            self.note(*classify_command(argv))
        elif event in ("os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty"):
            self.note("integration", f"a process ({event})")
        elif event in ("socket.connect", "socket.bind"):
            sock, address = args[0], args[1]
            family = getattr(sock, "family", None)
            if family in (socket.AF_INET, socket.AF_INET6):
                self.note("integration", f"the network ({event} {address})")


GUARD = LayerGuard()
#: Fixtures whose use is an ``e2e`` start even when a test before started them (shared clusters).
E2E_FIXTURES = frozenset({"ray_head", "ray_cluster", "second_cluster", "trainer_runs"})
#: Fixtures whose use is a ``cluster`` start even when a test before started them (the real control
#: plane, one per test process: tests/cluster/conftest.py).
CLUSTER_FIXTURES = frozenset({"plane", "control_plane"})


def started(layer: str, why: str) -> None:
    """Tell the guard the running test started something its audit hook cannot see."""
    GUARD.note(layer, why)


def layer_of(markers: Sequence[str]) -> str | None:
    """The closest layer marker of a test (``markers``: closest first), None without one."""
    for name in markers:
        if name in _RANK:
            return name
    return None


def too_much(layer: str, seen: Seen) -> str | None:
    """Why a test of ``layer`` did more than its layer allows, or None."""
    if seen.rank <= _RANK[layer]:
        return None
    return (f"a test marked {layer!r} started what needs {LAYERS[seen.rank]!r}: {'; '.join(seen.why)}; "
            f"mark it {LAYERS[seen.rank]} (tests/support/layers.py)")


#: The marker of a story that ``make test`` leaves to ``make test-long``.
LONG = "long"


def long_problems(items: Sequence[tuple[str, str | None, tuple[str, ...] | None]]) -> list[str]:
    """What is wrong with the ``long`` tests among ``items``: ``(node id, layer, quick)``, ``quick``
    the quick forms a long test names (None for a test that is not long).

    A quick form is a node id, or a test function's id that matches each of its parameter sets.
    One is checked only where its module was collected in this session (``make test``'s fast
    layers collect every module, so every make test checks them all).
    """
    problems = []
    modules = {nodeid.split("::")[0] for nodeid, _, _ in items}
    longs = {nodeid for nodeid, _, quick in items if quick is not None}
    for nodeid, layer, quick in items:
        if quick is None:
            continue
        if layer != "e2e":
            problems.append(f"{nodeid}: marked long but its layer is {layer!r}: only e2e stories are long")
        if not quick:
            problems.append(f"{nodeid}: marked long without a quick form: name the tests of make test that "
                            "make its claim (pytest.mark.long('tests/...::test_...'))")
        for form in quick:
            if form.split("::")[0] not in modules:
                continue
            matches = [n for n, _, _ in items if n == form or n.startswith(form + "[")]
            if not matches:
                problems.append(f"{nodeid}: its quick form {form} is not a collected test")
            elif all(n in longs for n in matches):
                problems.append(f"{nodeid}: its quick form {form} is long too: make test does not run it")
    return problems


@dataclass
class ModuleRecord:
    layer_ranks: set[int] = field(default_factory=set)
    seen_rank: int = 0
    why: list[str] = field(default_factory=list)
    tests: int = 0
    ran: int = 0


def too_little(records: dict[str, ModuleRecord]) -> list[str]:
    """Modules (all of whose tests ran) marked above what any of their tests did."""
    problems = []
    for module, record in sorted(records.items()):
        if record.ran < record.tests or not record.layer_ranks:
            continue
        lowest = min(record.layer_ranks)
        if record.seen_rank < lowest:
            problems.append(f"{module}: marked {LAYERS[lowest]!r} but none of its tests started what that "
                            f"needs (it needs {LAYERS[record.seen_rank]!r}); mark it "
                            f"{LAYERS[record.seen_rank]}")
    return problems


def write_report(path: str, records: dict[str, ModuleRecord]) -> None:
    with open(path, "w") as f:
        json.dump({m: {"marked": sorted(LAYERS[r] for r in rec.layer_ranks), "seen": LAYERS[rec.seen_rank],
                       "why": rec.why, "tests": rec.tests, "ran": rec.ran}
                   for m, rec in sorted(records.items())}, f, indent=1)
