"""A real local multi-node Ray cluster (token auth) for the RayGcs / ray-mode tests.

One cluster for the whole ``tests/ray`` package (starting a node takes seconds on two cores):
a head plus one worker labelled with an instance id (``resilienced.localray.LocalRayCluster``).
Tests that drain or kill nodes add their own nodes first.  Every process started here is
stopped here, also when a test fails; nothing runs ``ray stop``.
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

from resilienced.localaws import free_port
from resilienced.localray import LocalRayCluster, LocalRayNode

INSTANCE_LABEL = "resilienced.io/instance-id"
WORKER_INSTANCE = "i-0123456789abcdef0"


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[LocalRayCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="rr-", dir="/tmp"))  # short: Ray's sockets live under it
    cluster = LocalRayCluster(workdir=workdir)
    try:
        cluster.start()
        cluster.add_node(labels={INSTANCE_LABEL: WORKER_INSTANCE}, num_cpus=1)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def fresh_node(ray_cluster: LocalRayCluster) -> Iterator[object]:
    """A factory of extra worker nodes (for tests that drain or kill them), stopped afterwards."""
    started: list[LocalRayNode] = []

    def add(instance_id: str) -> LocalRayNode:
        node = ray_cluster.add_node(labels={INSTANCE_LABEL: instance_id}, num_cpus=1)
        started.append(node)
        return node

    yield add
    for node in started:
        ray_cluster.kill_node(node)


class LoopbackNode:
    """A worker at another loopback IP (``ray start --node-ip-address=127.0.0.2``), no labels.

    ``LocalRayCluster`` starts every node at 127.0.0.1 (which Ray reports as the machine's own
    address); a node with its own IP is what the private-IP fallback of ray mode needs.
    """

    def __init__(self, cluster: LocalRayCluster, ip: str) -> None:
        self.ip = ip
        self.log = cluster.workdir / "logs" / f"loopback-{ip}.log"
        ports = [free_port() for _ in range(6)]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        env.update(cluster.env)
        env.pop("RAY_ADDRESS", None)
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={ip}",
            f"--address={cluster.address}", "--num-cpus=1", "--num-gpus=0",
            "--object-store-memory=80000000", "--disable-usage-stats",
            f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}", f"--dashboard-agent-grpc-port={ports[3]}",
            f"--runtime-env-agent-port={ports[4]}", f"--metrics-export-port={ports[5]}",
            "--min-worker-port=0", "--max-worker-port=0",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=cluster.workdir, start_new_session=True)
        try:
            cluster.wait_for(
                lambda nodes: any(n.address == ip and n.alive for n in nodes),
                timeout_s=90, what=f"a node at {ip}",
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the group outlives its leader until all are reaped
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)


@pytest.fixture(scope="package")
def loopback_node(ray_cluster: LocalRayCluster) -> Iterator[LoopbackNode]:
    node = LoopbackNode(ray_cluster, "127.0.0.2")
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="package")
def second_cluster() -> Iterator[LocalRayCluster]:
    """Another cluster (head only) with its own token: one daemon talks to both."""
    workdir = Path(tempfile.mkdtemp(prefix="rr2-", dir="/tmp"))
    cluster = LocalRayCluster(workdir=workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


from tests.support.ray import busy  # noqa: E402,F401  (re-exported for the tests here)
