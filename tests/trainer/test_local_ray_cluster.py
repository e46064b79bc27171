"""``resilienced.local.raycluster``: a real local multi-node Ray cluster that cleans up after itself."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from resilienced.local import raycluster
from resilienced.local.raycluster import LocalRayCluster, LocalRayError
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL

pytestmark = pytest.mark.e2e


def test_nodes_are_listed_with_their_labels(ray_cluster: LocalRayCluster) -> None:
    listed = {n.node_id: n for n in ray_cluster.nodes()}
    assert ray_cluster.head is not None and listed[ray_cluster.head.node_id].is_head
    for node in ray_cluster.workers[:2]:
        info = listed[node.node_id]
        assert info.labels[INSTANCE_ID_LABEL] == node.labels[INSTANCE_ID_LABEL]
        assert info.labels[CAPACITY_TYPE_LABEL] == "spot"
    assert ray_cluster.address.startswith("127.0.0.1:")
    assert ray_cluster.env["RAY_AUTH_MODE"] == "token" and ray_cluster.env["RAY_AUTH_TOKEN"] == ray_cluster.auth_token


@pytest.mark.parametrize(
    "labels",
    [{CAPACITY_TYPE_LABEL: "reserved"}, {INSTANCE_ID_LABEL: "i-1,2"}, {"": "x"}],
    ids=["unknown-capacity-type", "comma-in-value", "empty-key"],
)
def test_a_bad_label_is_refused_before_anything_starts(ray_cluster: LocalRayCluster, labels) -> None:
    before = len(ray_cluster.workers)
    with pytest.raises(ValueError, match="label"):
        ray_cluster.add_node(labels=labels)
    assert len(ray_cluster.workers) == before


def test_stop_leaves_no_process_and_no_temp_dir_also_after_a_failed_start() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    try:
        failed = LocalRayCluster(workdir=workdir / "a", start_timeout_s=0.01)
        with pytest.raises(LocalRayError, match="not listed ALIVE"):
            failed.start()
        assert failed.processes() == [] and not (workdir / "a" / "ray").exists()

        with LocalRayCluster(workdir=workdir / "b") as cluster:
            assert cluster.processes()  # the head's GCS, raylet, agents...
        assert cluster.processes() == [] and not (workdir / "b" / "ray").exists()
        cluster.stop()  # idempotent
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def ray_start_that_gives_up_on_its_raylet(real_popen, *, times: int, head: bool = False):
    """``LocalRayCluster._popen`` whose first ``times`` worker starts (``head``: head starts) exit as
    ``ray start`` does when its raylet did not register within Ray's 30 s (ray/_private/node.py),
    then real ones.  Records each failed start's log name and GCS port."""
    failed = []

    def popen(cmd, environment, log_path):
        if ("--head" in cmd) == head and len(failed) < times:
            failed.append((log_path.name, next((a for a in cmd if a.startswith("--port=")), "")))
            cmd = [sys.executable, "-c", "import sys; sys.exit('Exception: The current node timed out during startup."
                   " This could happen because some of the raylet failed to startup or the GCS has become overloaded.')"]
        return real_popen(cmd, environment, log_path)

    return popen, failed


@pytest.mark.parametrize("times", [raycluster.NODE_START_ATTEMPTS - 1, raycluster.NODE_START_ATTEMPTS])
def test_a_worker_whose_raylet_ray_gave_up_on_is_started_again_a_bounded_number_of_times(times: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    try:
        with LocalRayCluster(workdir=workdir / "c") as cluster:
            cluster._popen, failed = ray_start_that_gives_up_on_its_raylet(cluster._popen, times=times)
            if times < raycluster.NODE_START_ATTEMPTS:
                node = cluster.add_node(labels={"k": "v"})
                assert node.running() and [n.node_id for n in cluster.nodes() if n.alive and not n.is_head] == [node.node_id]
                assert cluster.workers == [node]
            else:
                with pytest.raises(LocalRayError, match="timed out during startup") as info:
                    cluster.add_node(labels={"k": "v"})
                assert cluster.workers == []
                # the error carries the end of the (running) GCS's log, which goes with the cluster
                gcs_tail = str(info.value).split("the GCS's log (gcs_server.out), last 12 lines:\n", 1)[1]
                assert gcs_tail.strip() and "(no log)" not in gcs_tail
            assert len(failed) == times
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("times", [raycluster.NODE_START_ATTEMPTS - 1, raycluster.NODE_START_ATTEMPTS])
def test_a_head_whose_raylet_ray_gave_up_on_is_started_again_on_a_new_gcs_port(times: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    cluster = LocalRayCluster(workdir=workdir / "h")
    try:
        cluster._popen, failed = ray_start_that_gives_up_on_its_raylet(cluster._popen, times=times, head=True)
        if times < raycluster.NODE_START_ATTEMPTS:
            cluster.start()
            assert cluster.head is not None and cluster.head.running()
            assert [n.node_id for n in cluster.nodes() if n.alive] == [cluster.head.node_id]
            ports = [port for _, port in failed] + [f"--port={cluster.gcs_port}"]
            assert cluster.address == f"127.0.0.1:{cluster.gcs_port}"
        else:
            with pytest.raises(LocalRayError, match="timed out during startup"):
                cluster.start()
            assert cluster.processes() == [] and not (workdir / "h" / "ray").exists()
            ports = [port for _, port in failed]
        assert len(failed) == times and len(set(ports)) == len(ports)  # each attempt on its own port
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_workdir_too_long_for_rays_sockets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too long"):
        LocalRayCluster(workdir=tmp_path / ("x" * 60))


def test_without_a_redis_address_no_node_gets_gcs_fault_tolerance_settings(ray_cluster: LocalRayCluster) -> None:
    assert ray_cluster.head is not None
    for node in (ray_cluster.head, *ray_cluster.workers):
        assert "RAY_REDIS_ADDRESS" not in node.environment
        assert "RAY_external_storage_namespace" not in node.environment
        assert node.environment.get("RAY_gcs_rpc_server_reconnect_timeout_s") is None


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server (GCS fault tolerance)")
def test_a_redis_backed_cluster_survives_its_gcs_killed_and_its_head_restarted() -> None:
    import os
    import signal

    from tests.support.redis import redis_server

    workdir = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    try:
        with redis_server() as address, LocalRayCluster(workdir=workdir, redis_address=address) as cluster:
            assert cluster.head is not None
            assert cluster.head.environment["RAY_REDIS_ADDRESS"] == address
            worker = cluster.add_node(labels={INSTANCE_ID_LABEL: "i-0restart"})
            assert worker.environment["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
            with cluster._gcs() as gcs:
                gcs.internal_kv_put(b"key", b"value", True, b"test")
            old_head = cluster.head
            gcs_pid = next(pid for pid in cluster.processes(old_head)
                           if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server")
            os.kill(gcs_pid, signal.SIGKILL)
            assert old_head.process.wait(timeout=30) == 1  # `ray start --block` ends the head with its GCS
            head = cluster.restart_head()
            assert head.node_id != old_head.node_id and head.command == old_head.command
            listed = {n.node_id: n for n in cluster.nodes()}
            assert listed[head.node_id].alive and listed[head.node_id].is_head
            assert listed[worker.node_id].alive and worker.running()
            with cluster._gcs() as gcs:
                assert gcs.internal_kv_get(b"key", b"test") == b"value"
        assert cluster.processes() == []
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_terminated_node_leaves_the_gcs_itself_and_a_killed_one_is_found_by_its_health_checks(
        ray_cluster: LocalRayCluster) -> None:
    """``terminate_node`` plays EC2's default terminate (a graceful OS shutdown: SIGTERM, then
    SIGKILL): the raylet unregisters, so the GCS knows at once (an elastic restart waits for that);
    ``kill_node`` is a power cut, which the GCS learns only when the node misses its heartbeats."""
    from ray.core.generated.common_pb2 import NodeDeathInfo

    def death(node_id: str) -> tuple[str, str] | None:
        with ray_cluster._gcs() as raw:
            info = {(k if isinstance(k, str) else k.hex()): v for k, v in raw.get_all_node_info(timeout=10).items()}
        node = info[node_id]
        return None if node.state == 0 else (NodeDeathInfo.Reason.Name(node.death_info.reason),
                                             node.death_info.reason_message)

    for end, reason in ((ray_cluster.terminate_node, "EXPECTED_TERMINATION"),
                        (ray_cluster.kill_node, "UNEXPECTED_TERMINATION")):
        node = ray_cluster.add_node(labels={INSTANCE_ID_LABEL: f"i-0{reason[:10].lower().replace('_', '')}"}, num_cpus=1)
        end(node)
        ray_cluster.wait_for(lambda nodes: not any(n.alive for n in nodes if n.node_id == node.node_id),
                             timeout_s=60, what=f"{node.name} dead")
        seen = death(node.node_id)
        assert seen is not None, f"{node.name}: no death info"
        if reason == "EXPECTED_TERMINATION" and seen[0] != reason:
            # every process got SIGTERM at once: when the runtime env agent exits before the raylet
            # has left, the raylet exits on its own as fate-sharing with it and says so to the GCS
            # (seen in run 97, docs/development.md): the raylet still told the GCS itself, at once
            assert seen[0] == "UNEXPECTED_TERMINATION" and "fate-shares" in seen[1], seen
            continue
        assert seen[0] == reason and "fate-shares" not in seen[1], seen


class _Reaped:
    """A ``ray start`` this process has reaped, whose pid the kernel has given to another process
    since (pids are reused: pid_max is 32768 here, and the suite starts thousands of processes)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, -9

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def test_a_node_stopped_before_is_never_signalled_by_a_pid_that_may_be_another_process_s_now(
        ray_cluster: LocalRayCluster) -> None:
    """Stopping a node again (the cluster's stop after a kill, a terminate after a drain) finds
    what is left of it by its marker only.  Before, it sent SIGKILL to the group id and the
    process tree of the old pid: on a loaded machine that id was another test's Ray head."""
    import os
    import signal
    import subprocess
    import time

    node = ray_cluster.add_node(labels={INSTANCE_ID_LABEL: "i-0pidreuse"}, num_cpus=1)
    ray_cluster.kill_node(node)
    assert ray_cluster.processes(node) == []
    foreign = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a session of its own
    try:
        with_child = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
        try:
            end = time.monotonic() + 30  # the shell forks its child (run 100 looked before it had)
            while not raycluster._descendants(with_child.pid):
                assert time.monotonic() < end, "the shell never started its child"
                time.sleep(0.01)
            for other in (foreign, with_child):  # the group id and the process tree of the old pid
                node.process = _Reaped(other.pid)
                ray_cluster.sigterm_node(node)
                ray_cluster.terminate_node(node, grace_s=0.1)
                ray_cluster.kill_node(node)
                assert other.poll() is None, f"the process now at pid {other.pid} was signalled"
            assert len(raycluster._descendants(with_child.pid)) == 1  # its child lives too
        finally:
            os.killpg(with_child.pid, signal.SIGKILL)  # not reaped yet: the group is still its
            with_child.wait()
    finally:
        foreign.kill()
        foreign.wait()
