"""Fixtures of the trainer tests: running ``python -m trainer``, reference losses, a Ray cluster.

Every process a test starts is stopped by the test (fixtures with ``finally``), also on failure:
trainer runs are waited for with a timeout and killed (their whole process group) if they
overrun; the Ray cluster is a :class:`~resilienced.local.raycluster.LocalRayCluster` stopped at the end of
the session.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from resilienced.local.raycluster import LocalRayCluster, LocalRayNode
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL
from tests.support.ray import FAST_DEATH
from trainer.journal import read_jsonl  # the trainer's own reader of its journal

REPO = Path(__file__).resolve().parents[2]

#: A model small enough that a local run is mostly process start-up.
SMALL = ["--d-model", "32", "--n-heads", "4", "--seq-len", "16"]


@dataclass
class TrainerRun:
    """One ``python -m trainer`` process and the files it writes."""

    out: Path
    proc: subprocess.Popen[bytes] | None = None
    returncode: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "ck"

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "metrics.jsonl")

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "events.jsonl")

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    @property
    def log(self) -> str:
        path = self.out / "trainer.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def losses(self) -> dict[int, float]:
        """Step -> loss, the last line of each step winning."""
        return {m["step"]: m["loss"] for m in self.metrics}

    def step_counts(self) -> collections.Counter[int]:
        return collections.Counter(m["step"] for m in self.metrics)

    def start(self, args: list[str], *, env: dict[str, str] | None = None) -> "TrainerRun":
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = [
            sys.executable, "-m", "trainer",
            "--checkpoint-dir", str(self.checkpoint_dir),
            "--metrics-out", str(self.out / "metrics.jsonl"),
            "--events-out", str(self.out / "events.jsonl"),
            *args,
        ]
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(self.out / "trainer.log", "ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"trainer did not finish within {timeout}s: {' '.join(self.args)}\n{self.log}")
        return self.returncode

    def wait_until(self, predicate: Callable[["TrainerRun"], bool], *, timeout: float, what: str) -> None:
        """Poll until ``predicate(self)`` holds; fail naming ``what`` (with the log) if not."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"trainer exited ({self.proc.returncode}) before {what}\n{self.log}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.log}")
            time.sleep(0.1)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


class TrainerRuns:
    """Starts trainer runs (by default all writing to one output dir); kills leftovers at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.runs: list[TrainerRun] = []

    def start(self, args: list[str], *, out: Path | None = None, env: dict[str, str] | None = None) -> TrainerRun:
        run = TrainerRun(out or self.out).start(args, env=env)
        self.runs.append(run)
        return run

    def run(self, args: list[str], *, expect: int = 0, timeout: float = 240, **kwargs: Any) -> TrainerRun:
        """Start a run and wait for it; fail (with its log) unless it exits with ``expect``."""
        run = self.start(args, **kwargs)
        code = run.wait(timeout)
        assert code == expect, f"trainer exited {code}, expected {expect}\n{run.log}"
        return run

    def kill_all(self) -> None:
        for run in self.runs:
            run.kill()


@pytest.fixture
def trainer_runs(tmp_path: Path) -> Iterator[TrainerRuns]:
    runs = TrainerRuns(tmp_path / "run")
    try:
        yield runs
    finally:
        runs.kill_all()


#: Steps of every reference run; tests compare the steps they train.
REFERENCE_STEPS = 84


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[int, float]]:
    """Step -> loss of an uninterrupted local run (``--ray-address local``), once per flag set.

    Only the flags that change the numbers are taken (model, seed, world size, dropout...):
    checkpoint cadence, async saves and padding change nothing a step computes.
    """
    cache: dict[tuple[str, ...], dict[int, float]] = {}

    def losses(args: list[str]) -> dict[int, float]:
        key = tuple(args)
        if key not in cache:
            run = TrainerRun(tmp_path_factory.mktemp("reference")).start(
                ["--ray-address", "local", "--steps", str(REFERENCE_STEPS), "--checkpoint-every", "0", *args]
            )
            try:
                code = run.wait(240)
            finally:
                run.kill()
            assert code == 0, f"reference run failed ({code})\n{run.log}"
            assert run.step_counts() == {step: 1 for step in range(1, REFERENCE_STEPS + 1)}
            cache[key] = run.losses()
        return cache[key]

    return losses


def same_steps(expected: dict[int, float], got: dict[int, float]) -> dict[int, float]:
    """The reference restricted to the steps a run trained."""
    return {step: expected[step] for step in got}


# ---------------------------------------------------------------------- Ray
#: Drain window of ``ray start --block`` on SIGTERM in the test cluster (Ray's default is 30 s).
DRAIN_TIMEOUT_S = 8


def node_labels(n: int, capacity: str = "spot") -> dict[str, str]:
    return {INSTANCE_ID_LABEL: f"i-{n:017x}", CAPACITY_TYPE_LABEL: capacity}


@pytest.fixture(scope="session")
def ray_session_cluster() -> Iterator[LocalRayCluster]:
    """A head (no CPUs) and two 1-CPU spot nodes, shared by the Ray tests; always stopped."""
    workdir = Path(tempfile.mkdtemp(prefix="tr", dir="/tmp"))
    cluster = LocalRayCluster(
        workdir=workdir, env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S), **FAST_DEATH}
    )
    try:
        cluster.start()
        for n in (1, 2):
            cluster.add_node(labels=node_labels(n))
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


_replacements = itertools.count(1000)


def alive_workers(cluster: LocalRayCluster) -> list[LocalRayNode]:
    """Worker nodes this cluster started that run and that the GCS lists alive, not draining."""
    alive = {n.node_id for n in cluster.nodes() if n.alive and not n.draining}
    return [n for n in cluster.workers if n.running() and n.node_id in alive]


def exactly_workers(cluster: LocalRayCluster, count: int, *, fresh: bool = False) -> None:
    """The shared cluster with exactly ``count`` alive worker nodes, nothing draining or spare;
    ``fresh``: every worker started anew (after a failed test, whatever it left on them goes)."""
    if fresh:
        for node in list(cluster.workers):
            cluster.kill_node(node)
    for node in [n for n in cluster.workers if n not in alive_workers(cluster)]:
        cluster.kill_node(node)  # drained or dead: gone, as its instance is
    while len(alive_workers(cluster)) < count:
        cluster.add_node(labels=node_labels(next(_replacements)))
    for extra in alive_workers(cluster)[count:]:
        cluster.kill_node(extra)
    cluster.wait_for(lambda nodes: sum(1 for n in nodes if n.alive and not n.is_head) == count,
                     timeout_s=60, what=f"{count} alive worker nodes")


@pytest.fixture
def ray_cluster(ray_session_cluster: LocalRayCluster, request: pytest.FixtureRequest) -> Iterator[LocalRayCluster]:
    """The shared cluster as every Ray test expects it: two alive 1-CPU worker nodes.

    A test drains, kills and adds nodes; whatever it leaves is put back before the next one, and
    after a failed test the workers are started anew, so that one failure cannot take the next
    tests' resources (its actors, a drained node) and fail them too.
    """
    exactly_workers(ray_session_cluster, 2)
    yield ray_session_cluster
    failed = any(getattr(request.node, f"rep_{when}", None) is not None
                 and getattr(request.node, f"rep_{when}").failed for when in ("setup", "call"))
    exactly_workers(ray_session_cluster, 2, fresh=failed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Each phase's report on the item (``rep_setup``, ``rep_call``), for ``ray_cluster``'s teardown."""
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())
