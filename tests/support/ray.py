"""Test support for real local Ray clusters: start one (:func:`local_cluster`), and keep a node
busy so that a drain keeps it alive (:func:`busy`).

An idle Ray node that is drained exits at once (seen here); a node running a task stays draining
until the deadline, as a training worker's node does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilienced.local.raycluster import LocalRayCluster
from tests.support import layers


#: The GCS's health checks of the test clusters: a killed node (a power cut: its raylet cannot
#: unregister) is known dead after 3 failed checks 1 s apart instead of Ray's 5 checks 3 s apart
#: (``health_check_period_ms``, ``health_check_failure_threshold``, ray_config_def.h, Ray 2.60).
#: Each check still waits ``health_check_timeout_ms`` (10 s) for an answer, so a live node on a
#: loaded machine is not taken for dead. What a test that kills a node waits for, about 12 s less.
FAST_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


@contextlib.contextmanager
def local_cluster(prefix: str) -> Iterator[LocalRayCluster]:
    """A started local cluster (a head with no CPUs), stopped and removed at the end."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: Ray's sockets live under it
    cluster = LocalRayCluster(workdir=workdir, env=FAST_DEATH)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def session_head(request: pytest.FixtureRequest) -> LocalRayCluster:
    """The session's head-only cluster (``ray_head``, tests/conftest.py) for a fixture that asks
    for it by name (``request.getfixturevalue``): the layer check sees a fixture's use by name
    only when the test names it, and a test that uses the head is ``e2e`` even when another test
    started it."""
    layers.started("e2e", "the session's Ray head (tests/conftest.py, ray_head)")
    return request.getfixturevalue("ray_head")


BUSY_DRIVER = """
import sys, time, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=1)
class Holder:
    def ping(self):
        return "pong"

detached = sys.argv[3] == "detached"
options = {"lifetime": "detached"} if detached else {}
holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(sys.argv[2], soft=False),
                        **options).remote()
assert ray.get(holder.ping.remote(), timeout=120) == "pong"
print("READY", flush=True)
sys.stdin.read()  # hold the node busy until the test closes stdin or kills us
if detached:  # a detached actor outlives its driver: end it
    ray.kill(holder)
"""


@contextlib.contextmanager
def busy(cluster: LocalRayCluster, node_id: str, *, timeout: float = 120.0, detached: bool = False) -> Iterator[None]:
    """Keep a node busy (an actor holding its CPU, from a driver process) while inside.

    ``detached``: the actor is a detached one (``lifetime="detached"``), which Ray keeps when its
    driver's job ends. Needed across a restart of the head (``LocalRayCluster.restart_head``):
    the driver's job is attached to the node of the raylet it connected to, the head's here,
    and a restarted GCS marks the old head node dead and every job with a driver on it finished
    (Ray 2.60 ``gcs_job_manager.cc``, "Node is dead, marking all jobs with drivers on this node
    as finished", seen in ``gcs_server.out``), which ends the job's non-detached actors. On
    leaving, stdin is closed and the driver kills the actor (``ray.kill``), 30 s at most.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(cluster.env)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", BUSY_DRIVER, cluster.address, node_id,
                             "detached" if detached else "attached"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=cluster.workdir, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        lines = []
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.strip() == "READY":
                break
        else:
            raise TimeoutError("the busy driver did not get its actor placed in time")
        if not lines or lines[-1].strip() != "READY":
            raise RuntimeError("the busy driver failed:\n" + "".join(lines[-30:]))
        yield
    finally:
        if detached and proc.poll() is None:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        if proc.poll() is None:  # not reaped: its pid, the group's id, is not another's yet
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
