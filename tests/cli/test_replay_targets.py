"""``replay --dry-run --json`` with a cluster: each actionable row's ``targets`` and ``unresolved``.

Kubernetes mode runs against the emulated API server over HTTP with the real kubernetes_asyncio
client (a kubeconfig written by the emulator's helper); replay runs in-process through
``resilienced.app.cli.main`` on a worker thread (it has its own event loop) while the emulator serves
on the test's loop.  EC2 is botocore's Stubber behind replay's ``ec2_client`` seam (moto has no
capacity calls), or a port nobody listens on.  The GCS side is a real local Ray cluster
(``LocalRayCluster``, a worker at 127.0.0.2 so that its pod IP tells it apart) in the e2e tests,
or a port nobody listens on.  "It only reads" is checked on each side: the emulator's request
log holds only get/list/watch, the Stubber saw only Describe* calls, and no Ray node drains.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession
from botocore.stub import Stubber

from resilienced.app import cli
from resilienced.app import replay as replay_module
from resilienced.local.aws import FAKE_CREDENTIALS
from resilienced.local.raycluster import LocalRayCluster
from tests.intake import payloads
from tests.kube.conftest import KARPENTER_RESOURCES, instance, node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.e2e

READ_VERBS = {"get", "list", "watch"}
INSTANCE_LABEL = "resilienced.io/instance-id"
P5 = {"node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": "us-east-1a"}
SPOT = {**P5, "karpenter.sh/capacity-type": "spot"}
BLOCK = "cr-0123456789abcdef0"
OTHER_BLOCK = "cr-0fedcba9876543210"
ON_BLOCK = {**P5, "karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK}
CONTRACT = ["instance_id", "node", "ray_cluster", "ray_job", "ray_node_ids", "checkpoint_uri",
            "capacity", "reason"]
NO_REGION_ENV = ("RESILIENCED_REGION", "AWS_REGION", "AWS_DEFAULT_REGION", "RESILIENCED_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL", "RESILIENCED_KUBECONFIG",
                 "RESILIENCED_RAY_ADDRESS")


def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def no_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """EC2 and the cluster only as each test says (the environment could name them too)."""
    for name in NO_REGION_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def kubeapi() -> AsyncIterator[KubeApiServer]:
    server = KubeApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def files(tmp_path: Path, *events: dict | bytes) -> list[str]:
    paths = []
    for n, event in enumerate(events):
        path = tmp_path / f"{n:02d}.json"
        path.write_bytes(event if isinstance(event, bytes) else json.dumps(event).encode())
        paths.append(str(path))
    return paths


async def replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict], str]:
    """``resilienced replay --dry-run --json ARGS`` in-process, on a thread (it runs its own loop)."""
    code = await asyncio.to_thread(cli.main, ["replay", "--dry-run", "--json", *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


async def closed(kubeapi: KubeApiServer) -> None:
    """Bounded wait until replay's watches are gone from the server (its caches were stopped)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while kubeapi.open_watches:
        assert loop.time() < deadline, "replay left watches open"
        await asyncio.sleep(0.02)


def kube_view(kubeapi: KubeApiServer, *, gcs_port: int, worker_labels: dict[str, str],
              worker_ips: tuple[str, str] = ("10.0.1.1", "10.0.1.2"), token: str | None = None) -> None:
    """A RayJob's RayCluster: head on n0, a worker on each of n1 (instance 1) and n2 (instance 2)."""
    job = kubeapi.create(rayjob("train", annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/train"}))
    kubeapi.seed(
        node("n0", instance(100), labels=P5),
        node("n1", instance(1), labels=worker_labels), node("n2", instance(2), labels=worker_labels),
        raycluster("train-rc", owner_job=job, service_ip="127.0.0.1", head_ip="10.99.0.1",
                   auth={"mode": "token"} if token else None),
        ray_pod("train-head", cluster="train-rc", node_name="n0", ip="10.99.0.1", node_type="head",
                gcs_port=gcs_port),
        ray_pod("train-w1", cluster="train-rc", node_name="n1", ip=worker_ips[0]),
        ray_pod("train-w2", cluster="train-rc", node_name="n2", ip=worker_ips[1]),
    )
    if token is not None:
        kubeapi.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "train-rc", "namespace": "ml"},
                        "stringData": {"auth_token": token}})


# --------------------------------------------------------------------------- EC2 under the Stubber
class StubbedEc2:
    """Replaces ``replay.ec2_client``: a real aiobotocore client whose calls the Stubber answers.

    ``expect`` queues (operation, response, expected params); every call's operation name is
    kept in ``calls``; leaving replay with an expected call not made fails the test.
    """

    def __init__(self) -> None:
        self.expected: list[tuple[str, dict, dict]] = []
        self.calls: list[str] = []
        self.regions: list[str] = []

    def expect(self, operation: str, response: dict, params: dict) -> None:
        self.expected.append((operation, response, params))

    @asynccontextmanager
    async def __call__(self, *, region: str, endpoint_url: str | None) -> AsyncIterator[Any]:
        self.regions.append(region)
        async with AioSession().create_client("ec2", region_name=region, aws_access_key_id="testing",
                                              aws_secret_access_key="testing") as client:
            client.meta.events.register("before-parameter-build.ec2",
                                       lambda model, **_: self.calls.append(model.name))
            with Stubber(client) as stubber:
                for operation, response, params in self.expected:
                    stubber.add_response(operation, response, params)
                yield client
                stubber.assert_no_pending_responses()


@pytest.fixture
def ec2(monkeypatch: pytest.MonkeyPatch) -> StubbedEc2:
    stub = StubbedEc2()
    monkeypatch.setattr(replay_module, "ec2_client", stub)
    return stub


def block(reservation_id: str, *, available: int) -> dict:
    now = datetime.now(UTC)
    return {
        "CapacityReservationId": reservation_id, "InstanceType": "p5.48xlarge",
        "AvailabilityZone": "us-east-1a", "ReservationType": "capacity-block", "State": "active",
        "AvailableInstanceCount": available, "TotalInstanceCount": 4, "StartDate": now - timedelta(days=1),
        "EndDate": now + timedelta(days=3), "InstancePlatform": "Linux/UNIX", "Tenancy": "default",
        "InstanceMatchCriteria": "targeted",
    }


# --------------------------------------------------------------------------- kubernetes mode
async def test_an_unreachable_gcs_still_gives_the_target_without_ray_node_ids_and_says_why(
    kubeapi: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = free_port()
    kube_view(kubeapi, gcs_port=dead, worker_labels=SPOT)
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    inputs = files(tmp_path, payloads.spot(instance(1)), payloads.state_change("stopping", instance(7)),
                   payloads.rebalance(instance(2)), b"not json")

    code, rows, err = await replay(capsys, "--kubeconfig", str(kubeconfig), *inputs)

    assert code == 0, err
    spot, gone, rebalance, invalid = rows
    (target,) = spot["targets"]
    assert list(target)[:8] == CONTRACT
    assert {k: target[k] for k in CONTRACT[:6]} == {
        "instance_id": instance(1), "node": "n1", "ray_cluster": "ml/train-rc", "ray_job": "ml/train",
        "ray_node_ids": [], "checkpoint_uri": "s3://ckpt/train"}
    assert f"127.0.0.1:{dead}" in target["gcs_error"] and "Ray node ids are unknown" in target["gcs_error"]
    assert target["capacity"] == "spot"
    assert "EC2 not configured (no --region): decided with no Capacity Blocks known" in target["reason"]
    assert spot["unresolved"] == {}
    assert gone["targets"] == []
    assert gone["unresolved"] == {instance(7): f"no Kubernetes Node has spec.providerID aws:///<az>/{instance(7)}"}
    (notified,) = rebalance["targets"]
    assert notified["node"] == "n2" and notified["capacity"] is None
    assert notified["reason"] == "no capacity decision: the plan does not requeue (steps: notify)"
    assert invalid["kind"] == "invalid" and "targets" not in invalid and "unresolved" not in invalid
    assert {r.verb for r in kubeapi.requests} <= READ_VERBS
    assert {("list", "nodes"), ("list", "pods"), ("list", "rayjobs.ray.io")} <= set(kubeapi.counts())
    await closed(kubeapi)


async def test_an_event_whose_instances_resolve_to_no_run_is_not_actionable_and_says_why(
    kubeapi: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kube_view(kubeapi, gcs_port=free_port(), worker_labels=SPOT)
    kubeapi.seed(node("n3", instance(3), labels=SPOT))  # a Node that runs no Ray pod
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    inputs = files(tmp_path, payloads.spot(instance(7)), payloads.spot(instance(3)),
                   payloads.health((instance(1), instance(7)), start="Mon, 01 Jan 2024 06:00:00 GMT"))

    code, [absent, idle, partly], err = await replay(capsys, "--kubeconfig", str(kubeconfig), *inputs)

    assert code == 0, err
    no_node = f"no Kubernetes Node has spec.providerID aws:///<az>/{instance(7)}"
    assert (absent["actionable"], absent["steps"], absent["targets"]) == (False, [], [])
    assert absent["reason"] == (f"nothing to act on: no instance of the event resolves to a run "
                                f"({instance(7)}: {no_node})")
    assert idle["actionable"] is False and idle["steps"] == []
    assert f"Node n3 ({instance(3)}) runs no Ray pods" in idle["reason"]
    assert partly["actionable"] is True and partly["reason"] is None
    assert [t["instance_id"] for t in partly["targets"]] == [instance(1)]
    assert partly["unresolved"] == {instance(7): no_node}

    text = replay_module.table([absent, partly], replay_module.TARGET_COLUMNS)
    header, absent_line, partly_line = text.splitlines()
    assert header.split()[-3:] == ["TARGETS", "UNRESOLVED", "REASON"]
    assert " no " in absent_line and "signal" not in absent_line and "nothing to act on" in absent_line
    assert " yes " in partly_line and f"{instance(1)}>ml/train:spot" in partly_line
    assert f"{instance(7)} ({no_node})" in partly_line
    await closed(kubeapi)


async def test_a_capacity_block_expiry_finds_the_blocks_instances_and_decides_once_per_run_on_ec2(
    kubeapi: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], ec2: StubbedEc2
) -> None:
    kube_view(kubeapi, gcs_port=free_port(), worker_labels=ON_BLOCK)
    ec2.expect("describe_instances",
               {"Reservations": [{"Instances": [{"InstanceId": instance(1)}, {"InstanceId": instance(2)}]}]},
               {"Filters": [{"Name": "capacity-reservation-id", "Values": [BLOCK]},
                            {"Name": "instance-state-name", "Values": ["pending", "running"]}],
                "MaxResults": 100})
    ec2.expect("describe_capacity_reservations",
               {"CapacityReservations": [block(BLOCK, available=0), block(OTHER_BLOCK, available=2)]},
               {"Filters": [{"Name": "state", "Values": ["active"]},
                            {"Name": "instance-type", "Values": ["p5.48xlarge"]}], "MaxResults": 100})
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    (expiry,) = files(tmp_path, payloads.block_expiry(BLOCK))

    code, [row], err = await replay(capsys, "--kubeconfig", str(kubeconfig), "--region", "us-east-2",
                                    "--prefer-blocks", "true", expiry)

    assert code == 0, err
    assert row["instance_ids"] == [] and row["capacity_reservation_id"] == BLOCK
    assert [(t["instance_id"], t["node"], t["ray_job"]) for t in row["targets"]] == [
        (instance(1), "n1", "ml/train"), (instance(2), "n2", "ml/train")]
    decisions = {(t["capacity"], t.get("reservation_id"), t["reason"]) for t in row["targets"]}
    assert len(decisions) == 1  # one run, one decision, shared by its targets
    capacity, reservation, reason = decisions.pop()
    assert (capacity, reservation) == ("capacity-block", OTHER_BLOCK), reason
    assert "EC2" not in reason  # EC2 answered: nothing missing to report
    assert row["unresolved"] == {}
    assert ec2.regions == ["us-east-2"]
    assert ec2.calls == ["DescribeInstances", "DescribeCapacityReservations"]
    assert {r.verb for r in kubeapi.requests} <= READ_VERBS
    await closed(kubeapi)


def karpenter(kubeapi: KubeApiServer, *, selected: tuple[str, ...]) -> None:
    """Karpenter's CRDs served, a Spot NodePool (the workers' own) and a reserved one whose
    EC2NodeClass lists ``selected`` in status.capacityReservations (shape of
    aws/karpenter-provider-aws pkg/apis/v1/ec2nodeclass_status.go, v1.6+)."""
    for rtype in KARPENTER_RESOURCES:
        kubeapi.register(rtype)

    def pool(name: str, capacity: str, nodeclass: str, *extra: dict) -> dict:
        return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name}, "spec": {
            "template": {"spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": nodeclass},
                "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity]},
                                 *extra]}}}}

    def nodeclass(name: str, ids: tuple[str, ...]) -> dict:
        return {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": name},
                "spec": {"capacityReservationSelectorTerms": [{"tags": {"karpenter.sh/discovery": "train"}}]},
                "status": {"capacityReservations": [
                    {"id": i, "instanceType": "p5.48xlarge", "availabilityZone": "us-east-1a",
                     "ownerID": "123456789012", "instanceMatchCriteria": "targeted",
                     "reservationType": "capacity-block", "state": "active"} for i in ids]}}

    kubeapi.seed(pool("spot", "spot", "spot-class"),
                 pool("blocks", "reserved", "block-class",
                      {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]}),
                 pool("other-type", "reserved", "elsewhere",
                      {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p4d.24xlarge"]}),
                 nodeclass("spot-class", ()), nodeclass("block-class", selected), nodeclass("elsewhere", (OTHER_BLOCK,)))


@pytest.mark.parametrize("selected, capacity, reservation", [
    ((BLOCK,), "capacity-block", BLOCK), ((), "on-demand", None)], ids=["one-selected", "none-selected"])
async def test_a_block_no_ec2nodeclass_selects_is_passed_over_and_the_reason_says_so(
    kubeapi: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], ec2: StubbedEc2,
    selected: tuple[str, ...], capacity: str, reservation: str | None,
) -> None:
    kube_view(kubeapi, gcs_port=free_port(), worker_labels={**SPOT, "karpenter.sh/nodepool": "spot"})
    karpenter(kubeapi, selected=selected)
    # OTHER_BLOCK has the most room, but only an EC2NodeClass of a p4d NodePool lists it.
    ec2.expect("describe_capacity_reservations",
               {"CapacityReservations": [block(BLOCK, available=2), block(OTHER_BLOCK, available=4)]},
               {"Filters": [{"Name": "state", "Values": ["active"]},
                            {"Name": "instance-type", "Values": ["p5.48xlarge"]}], "MaxResults": 100})
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")

    code, [row], err = await replay(capsys, "--kubeconfig", str(kubeconfig), "--region", "us-east-1",
                                    "--interruption-threshold", "1",
                                    *files(tmp_path, payloads.spot(instance(1), time=datetime.now(UTC).strftime(
                                        "%Y-%m-%dT%H:%M:%SZ"))))  # a fresh notice: Spot is out

    assert code == 0, err
    (target,) = row["targets"]
    assert (target["capacity"], target.get("reservation_id")) == (capacity, reservation), target["reason"]
    # The workers' own NodePool allows only spot: it cannot launch reserved capacity, so it is not
    # among the sources (issue #21, reserved_capacity_resolver.go).
    assert (f"{OTHER_BLOCK} is selected by no EC2NodeClass of the run (blocks/block-class): "
            "Karpenter cannot launch into it") in target["reason"]
    assert ({(r.verb, r.resource) for r in kubeapi.requests if "karpenter" in r.resource}
            == {("list", "nodepools.karpenter.sh"), ("watch", "nodepools.karpenter.sh"),
                ("list", "ec2nodeclasses.karpenter.k8s.aws"), ("watch", "ec2nodeclasses.karpenter.k8s.aws")})
    await closed(kubeapi)


async def test_ec2_that_does_not_answer_leaves_a_decision_with_no_blocks_known_and_says_so(
    kubeapi: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    kube_view(kubeapi, gcs_port=free_port(), worker_labels=SPOT)
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    inputs = files(tmp_path, payloads.spot(instance(1)), payloads.block_expiry(BLOCK))

    code, [spot, expiry], err = await replay(
        capsys, "--kubeconfig", str(kubeconfig), "--region", "us-east-1",
        "--endpoint-url", f"http://127.0.0.1:{free_port()}", *inputs)

    assert code == 0, err
    (target,) = spot["targets"]
    assert target["capacity"] == "spot"
    assert "EC2 did not answer" in target["reason"] and "DescribeCapacityReservations" in target["reason"]
    assert "decided with no Capacity Blocks known" in target["reason"]
    assert expiry["targets"] == []
    assert "cannot list the reservation's instances" in expiry["unresolved"][BLOCK]
    assert "DescribeInstances" in expiry["unresolved"][BLOCK]


async def test_an_api_server_that_does_not_answer_at_start_up_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_module, "KUBE_READY_TIMEOUT_S", 0.5)
    server = KubeApiServer()  # never started: its port is one nobody listens on
    server.port = free_port()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    code, rows, err = await replay(capsys, "--kubeconfig", str(kubeconfig), *files(tmp_path, payloads.spot()))
    assert code == 1 and rows == []
    assert "resilienced: error: kubernetes: caches not synced within 0.5s" in err


# --------------------------------------------------------------------------- usage
@pytest.mark.parametrize("args, message", [
    (["--kubeconfig", "/no/such/kubeconfig"],
     "--dry-run: replay acts only with --dry-run when a cluster is given; use `resilienced run` to act"),
    (["--ray-address", "127.0.0.1:1"], "--dry-run: replay acts only with --dry-run"),
    (["--dry-run", "--kubeconfig", "k", "--ray-address", "127.0.0.1:1"],
     "--ray-address: give --kubeconfig (kubernetes mode) or --ray-address (ray mode), not both"),
    (["--dry-run", "--ray-address", "nohost"], "--ray-address: Ray GCS address 'nohost' is not host:port"),
    (["--dry-run", "--ray-address", "127.0.0.1:1", "--checkpoint-uri", "/tmp/x"], "--checkpoint-uri: expected s3://"),
    (["--dry-run", "--kubeconfig", "k", "--interruption-threshold", "0"], "--interruption-threshold: must be between"),
    (["--dry-run", "--kubeconfig", "k", "--region", "Mars"], "--region: 'Mars' is not an AWS region name"),
], ids=["kube-without-dry-run", "ray-without-dry-run", "both-modes", "bad-address", "bad-checkpoint-uri",
        "bad-policy", "bad-region"])
def test_cluster_flags_usage_errors_exit_2_before_anything_is_contacted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = cli.main(["replay", *args, *files(tmp_path, payloads.spot())])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"resilienced: error: {message}" in err


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "acting"])
def test_without_cluster_flags_rows_have_no_targets_whatever_the_environment_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, dry_run: list[str]
) -> None:
    monkeypatch.setenv("RESILIENCED_RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # a daemon's environment
    monkeypatch.setenv("RESILIENCED_KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    code = cli.main(["replay", *dry_run, "--json", *files(tmp_path, payloads.spot())])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["actionable"] is True
    assert "targets" not in row and "unresolved" not in row


def test_table_output_shows_each_target(tmp_path: Path) -> None:
    rows = [{"source_file": "a.json", "kind": "spot_interruption", "actionable": True, "reason": None,
             "targets": [{"instance_id": "i-1", "node": "n1", "ray_cluster": "ml/rc", "ray_job": "ml/train",
                          "capacity": "spot"},
                         {"instance_id": "i-2", "node": "10.0.0.2", "ray_cluster": None, "ray_job": None,
                          "capacity": None}]}]
    text = replay_module.table(rows, replay_module.TARGET_COLUMNS)
    header, line = text.splitlines()
    assert header.split()[-3:] == ["TARGETS", "UNRESOLVED", "REASON"]
    assert "i-1>ml/train:spot,i-2>10.0.0.2:-" in line


# --------------------------------------------------------------------------- a real Ray cluster
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[LocalRayCluster, dict[str, str]]]:
    """Head, a worker labelled instance 1 at 127.0.0.2, one labelled instance 2 at 127.0.0.1.

    Yields the cluster and instance id -> Ray node id of its worker.
    """
    workdir = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's sockets live under it
    cluster = LocalRayCluster(workdir=workdir)
    try:
        cluster.start()
        one = cluster.add_node(labels={INSTANCE_LABEL: instance(1)}, node_ip="127.0.0.2")
        two = cluster.add_node(labels={INSTANCE_LABEL: instance(2)})
        yield cluster, {instance(1): one.node_id, instance(2): two.node_id}
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def assert_nothing_drains(cluster: LocalRayCluster) -> None:
    nodes = cluster.nodes()
    assert len(nodes) == 3
    assert all(n.alive and not n.draining and n.draining_deadline_ms is None for n in nodes), nodes


@pytest.mark.e2e
async def test_kubernetes_mode_maps_a_worker_pod_to_its_real_ray_node(
    ray_cluster: tuple[LocalRayCluster, dict[str, str]], kubeapi: KubeApiServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster, node_ids = ray_cluster
    kube_view(kubeapi, gcs_port=cluster.gcs_port, worker_labels=SPOT, worker_ips=("127.0.0.2", "10.0.1.2"),
              token=cluster.auth_token)
    kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")

    code, [row], err = await replay(capsys, "--kubeconfig", str(kubeconfig),
                                    *files(tmp_path, payloads.spot(instance(1))))

    assert code == 0, err
    (target,) = row["targets"]
    assert target["ray_node_ids"] == [node_ids[instance(1)]]
    assert (target["node"], target["ray_job"], target["checkpoint_uri"]) == ("n1", "ml/train", "s3://ckpt/train")
    assert target["capacity"] == "spot" and "gcs_error" not in target
    assert {r.verb for r in kubeapi.requests} <= READ_VERBS
    assert ("get", "secrets") in kubeapi.counts()  # the token came from the RayCluster's Secret
    assert_nothing_drains(cluster)
    await closed(kubeapi)


@pytest.mark.e2e
def test_ray_mode_finds_workers_by_their_instance_label(
    ray_cluster: tuple[LocalRayCluster, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, node_ids = ray_cluster
    token = tmp_path / "token"
    token.write_text(cluster.auth_token + "\n")
    inputs = files(tmp_path, payloads.spot(instance(1)), payloads.spot(instance(2)),
                   payloads.state_change("stopping", instance(7)))

    code = cli.main(["replay", "--dry-run", "--json", "--ray-address", cluster.address, "--ray-token-file",
                     str(token), "--checkpoint-uri", "s3://ckpt/run", "--instance-type", "p5.48xlarge",
                     *inputs])
    out, err = capsys.readouterr()

    assert code == 0, err
    one, two, gone = (json.loads(line) for line in out.splitlines())
    address = {n.node_id: n.address for n in cluster.nodes()}  # 127.0.0.1 shows as the host's address
    expected = {iid: address[node_id] for iid, node_id in node_ids.items()}
    assert expected[instance(1)] == "127.0.0.2"
    for row in (one, two):
        (target,) = row["targets"]
        iid = target["instance_id"]
        assert {k: target[k] for k in CONTRACT[:6]} == {
            "instance_id": iid, "node": expected[iid], "ray_cluster": None, "ray_job": None,
            "ray_node_ids": [node_ids[iid]], "checkpoint_uri": "s3://ckpt/run"}
        assert target["capacity"] == "spot" and "EC2 not configured (no --region)" in target["reason"]
        assert row["unresolved"] == {}
    assert gone["targets"] == []
    assert "no Ray node labelled resilienced.io/instance-id=" + instance(7) in gone["unresolved"][instance(7)]
    assert_nothing_drains(cluster)


@pytest.mark.e2e
def test_ray_mode_with_a_wrong_token_exits_1_naming_the_refusal(
    ray_cluster: tuple[LocalRayCluster, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _ = ray_cluster
    token = tmp_path / "token"
    token.write_text("0" * 64)
    code = cli.main(["replay", "--dry-run", "--json", "--ray-address", cluster.address, "--ray-token-file",
                     str(token), *files(tmp_path, payloads.spot(instance(1)))])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "rejected the auth token given" in err
