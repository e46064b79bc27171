"""Pod IP <-> Ray node mapping and the token modes against a real local Ray cluster, through RayGcs.

The Ray cluster is three real ``ray start`` processes with token auth: a head at 127.0.0.1 and
two workers at distinct loopback addresses, 127.0.0.2 and 127.0.0.3 (a worker reports its
``--node-ip-address`` as its node manager address), each labelled with the instance id it stands
for.  The emulated API server holds the KubeRay view of the same cluster: a Node per instance,
pods whose ``podIP`` are those loopback addresses, a RayCluster whose ``status.head.serviceIP``
and head container port lead to the real GCS, and the auth Secret.  ``resilienced.localray``
starts every node at 127.0.0.1, where pod IPs could not tell workers apart, hence the processes
are started here.  Only the process groups started here are ever signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from resilienced.errors import RayAuthError
from resilienced.kube import KubeCluster, KubeOptions
from resilienced.model import Target
from resilienced.raygcs import RayGcs
from .conftest import FAST, instance, node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.e2e

INSTANCE_LABEL = "resilienced.io/instance-id"
WORKER_IPS = ("127.0.0.2", "127.0.0.3")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackRay:
    """A head plus workers at distinct loopback IPs, one ``ray start --block`` process group each."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.token = secrets.token_hex(32)
        self.gcs_port = _free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0")

    def start_node(self, ip: str, *, instance_id: str, head: bool = False) -> None:
        ports = [_free_port() for _ in range(6)]
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={ip}",
            f"--num-cpus={0 if head else 1}", "--num-gpus=0", "--object-store-memory=80000000",
            "--disable-usage-stats", f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}", f"--dashboard-agent-grpc-port={ports[3]}",
            f"--runtime-env-agent-port={ports[4]}", f"--metrics-export-port={ports[5]}",
            "--min-worker-port=0", "--max-worker-port=0", f"--labels={INSTANCE_LABEL}={instance_id}",
        ]
        if head:
            cmd += ["--head", f"--port={self.gcs_port}", f"--temp-dir={self.workdir / 'ray'}",
                    "--include-dashboard=false", f"--dashboard-port={_free_port()}"]
        else:
            cmd += [f"--address={self.address}"]
        log = open(self.workdir / f"{ip}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env, cwd=self.workdir, start_new_session=True))
        log.close()

    async def wait_alive(self, count: int, *, timeout: float = 90.0) -> None:
        gcs = RayGcs(self.address, token=self.token, timeout=5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: object = None
        while loop.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a ray start exited; logs in {self.workdir}")
            try:
                nodes = await gcs.nodes()
                if sum(n.alive for n in nodes) >= count:
                    return
                last = nodes
            except Exception as err:  # noqa: BLE001 - the GCS is still starting
                last = err
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{count} Ray nodes not alive within {timeout}s: {last}")

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the group outlives its leader until all are reaped
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                time.sleep(0.05)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LoopbackRay]:
    workdir = Path(tempfile.mkdtemp(prefix="rk-", dir="/tmp"))  # short: Ray's unix sockets live under it
    cluster = LoopbackRay(workdir)
    try:
        cluster.start_node("127.0.0.1", instance_id=instance(100), head=True)
        asyncio.run(cluster.wait_alive(1))
        for n, ip in enumerate(WORKER_IPS, start=1):  # one at a time: concurrent starts time out on 2 cores
            cluster.start_node(ip, instance_id=instance(n))
            asyncio.run(cluster.wait_alive(1 + n))
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _kube_view(kubeapi: KubeApiServer, ray: LoopbackRay, *, auth: dict | None, token: str | None) -> None:
    """The KubeRay objects of that Ray cluster: three Nodes, three pods, the RayJob, RayCluster, Secret."""
    job = kubeapi.create(rayjob("train", annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/train"}))
    kubeapi.seed(
        node("n0", instance(100)), node("n1", instance(1)), node("n2", instance(2)),
        raycluster("train-rc", owner_job=job, service_ip="127.0.0.1", head_ip="10.99.0.1", auth=auth),
        ray_pod("train-head", cluster="train-rc", node_name="n0", ip="10.99.0.1", node_type="head", gcs_port=ray.gcs_port),
        ray_pod("train-w1", cluster="train-rc", node_name="n1", ip=WORKER_IPS[0], group="cpu"),
        ray_pod("train-w2", cluster="train-rc", node_name="n2", ip=WORKER_IPS[1], group="cpu"),
    )
    if token is not None:
        kubeapi.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "train-rc", "namespace": "ml"},
                        "stringData": {"auth_token": token}})


def _real_gcs(address: str, token: str | None) -> RayGcs:
    return RayGcs(address, token=token, timeout=5)


@pytest.fixture
async def kube(api) -> AsyncIterator[KubeCluster]:
    async with KubeCluster(api, ray_control_factory=_real_gcs, replica="r", options=KubeOptions(
            cache=FAST.cache, gcs_timeout_s=30)) as cluster:
        yield cluster


async def test_pod_ips_map_to_the_ray_nodes_of_the_right_instances(
    ray_cluster: LoopbackRay, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token=ray_cluster.token)
    truth = {n.labels[INSTANCE_LABEL]: n.node_id
             for n in await RayGcs(ray_cluster.address, token=ray_cluster.token, timeout=5).nodes() if n.alive}
    location = await kube.locate(instance_ids=[instance(1), instance(2), instance(100)])
    assert location.unresolved == {}
    by_instance = {t.instance_id: t for t in location.targets}
    assert by_instance[instance(1)].ray_node_ids == (truth[instance(1)],)
    assert by_instance[instance(2)].ray_node_ids == (truth[instance(2)],)
    head = by_instance[instance(100)]
    assert head.attributes["head_on_instance"] is True and head.ray_node_ids == ()
    assert {t.ray_address for t in location.targets} == {ray_cluster.address}
    assert {(t.ray_job, t.checkpoint_uri) for t in location.targets} == {("ml/train", "s3://ckpt/train")}

    control = await kube.ray_control(by_instance[instance(1)])
    assert truth[instance(1)] in {n.node_id for n in await control.nodes()}


async def test_a_wrong_token_in_the_secret_is_refused_by_the_real_gcs(
    ray_cluster: LoopbackRay, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token="0" * 64)
    location = await kube.locate(instance_ids=[instance(1)])
    assert location.targets == ()
    reason = location.unresolved[instance(1)]
    assert "the token from its auth Secret was refused" in reason and "rejected the auth token" in reason


async def test_a_cluster_declared_without_auth_whose_gcs_wants_a_token(
    ray_cluster: LoopbackRay, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth=None, token=None)
    location = await kube.locate(instance_ids=[instance(1)])
    assert "has no authOptions.mode=token, but its GCS wants a token" in location.unresolved[instance(1)]


async def test_real_gcs_refuses_a_wrong_token_directly(ray_cluster: LoopbackRay) -> None:
    with pytest.raises(RayAuthError):
        await RayGcs(ray_cluster.address, token="f" * 64, timeout=5).nodes()


async def test_a_drain_through_ray_control_reaches_the_gcs(
    ray_cluster: LoopbackRay, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    """Last in the module: the drained worker may leave the cluster."""
    from datetime import datetime, timedelta, timezone

    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token=ray_cluster.token)
    (target,) = (await kube.locate(instance_ids=[instance(2)])).targets
    assert isinstance(target, Target) and len(target.ray_node_ids) == 1
    control = await kube.ray_control(target)
    deadline = datetime.now(timezone.utc) + timedelta(minutes=2)
    assert await control.drain(target.ray_node_ids[0], deadline=deadline, message="spot interruption (test)")
    drained = {n.node_id: n for n in await control.nodes()}[target.ray_node_ids[0]]
    assert drained.draining_deadline_ms is not None or not drained.alive
