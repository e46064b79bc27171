"""The real control plane itself: each component answers and does its part.

These are the plane's own checks, before any daemon runs on it: the API server's version and
RBAC, kwok's Nodes, the scheduler's binding and its ``Unschedulable`` message, the
controller-manager's garbage collection, the KubeRay operator's RayCluster and pods, Kueue's
Workload and admission, and ``python -m tests.support.controlplane`` (ready, then a clean stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.controlplane import ControlPlane
from tests.support.controlplane.build import KUBE_VERSION
from tests.support.controlplane.rest import RestError
from tests.support.controlplane.world import GPU, World, can, karpenter_labels, kwok_node

pytestmark = pytest.mark.cluster


def pod(name: str, *, selector: dict[str, str] | None = None, gpus: int = 1) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": selector or {},
                     "containers": [{"name": "c", "image": "busybox",
                                     "resources": {"requests": {GPU: str(gpus)}, "limits": {GPU: str(gpus)}}}]}}


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def test_the_api_server_is_the_pinned_release_and_authorizes_by_rbac(daemon_identity: ControlPlane, world: World) -> None:
    plane = daemon_identity
    assert plane.admin.request("GET", "/version")["gitVersion"] == KUBE_VERSION
    assert can(plane, verb="patch", resource="nodes")
    assert can(plane, verb="create", resource="leases", group="coordination.k8s.io", namespace="resilienced")
    assert not can(plane, verb="create", resource="leases", group="coordination.k8s.io", namespace=world.namespace)
    assert not can(plane, verb="delete", resource="nodes")
    assert not can(plane, verb="*", resource="*", group="*")
    assert not can(plane, verb="get", resource="secrets", namespace=world.namespace)


def test_kwok_readies_a_node_and_the_scheduler_binds_a_pod_that_kwok_runs(world: World) -> None:
    world.nodes(kwok_node("cp-spot-1", "i-0000000000000a001", karpenter_labels("spot")))
    world.create(pod("p", selector={"karpenter.sh/capacity-type": "spot"}))
    running = world.wait("the pod Running", lambda: (p := world.get("v1", "pods", "p")) and
                         p["status"].get("phase") == "Running" and p)
    assert running["spec"]["nodeName"] == "cp-spot-1"
    assert running["status"]["podIP"].startswith("10.244.")


def test_the_scheduler_leaves_a_pod_without_a_fitting_node_unschedulable_with_its_reason(world: World) -> None:
    world.nodes(kwok_node("cp-spot-2", "i-0000000000000a002", karpenter_labels("spot"), gpus=1))
    world.create(pod("wants-block", selector={"karpenter.sh/capacity-type": "reserved"}))
    world.create(pod("too-big", selector={"karpenter.sh/capacity-type": "spot"}, gpus=8))
    for name, words in (("wants-block", "didn't match Pod's node affinity/selector"),
                        ("too-big", f"Insufficient {GPU}")):
        seen = world.wait(f"{name} Unschedulable", lambda n=name: condition(
            world.get("v1", "pods", n) or {}, "PodScheduled").get("reason") == "Unschedulable"
            and world.get("v1", "pods", n))
        message = condition(seen, "PodScheduled")["message"]
        assert words in message, message
        assert not seen["spec"].get("nodeName")


def test_the_controller_manager_collects_what_an_owner_leaves(world: World) -> None:
    owner = world.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    world.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dependent", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]}})
    world.admin.request("DELETE", f"/api/v1/namespaces/{world.namespace}/configmaps/owner")
    world.wait("the dependent collected", lambda: world.get("v1", "configmaps", "dependent") is None)


def test_the_command_starts_the_plane_says_ready_and_stops_it_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    env = {**os.environ, "RESILIENCED_CP_KEEP": ""}
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.controlplane", "--kubeconfig", str(kubeconfig),
                             "--components", "apiserver"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("ready: etcd, kube-apiserver at https://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        assert kubeconfig.exists()
        url = line.split(" at ")[1].split()[0]
        plane_pids = subprocess.run(["pgrep", "-f", "--", f"--secure-port={url.rsplit(':', 1)[1]}"],
                                    capture_output=True, text=True).stdout.split()
        assert plane_pids, "the API server's process is not found"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert proc.stdout is not None and "stopped" in proc.stdout.read()
        left = subprocess.run(["pgrep", "-f", "--", f"--secure-port={url.rsplit(':', 1)[1]}"],
                              capture_output=True, text=True).stdout.split()
        assert not left, f"processes left running: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_command_refuses_an_unknown_component(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.support.controlplane", "--kubeconfig", str(tmp_path / "k"),
                           "--components", "apiserver,kubelet"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    assert "unknown component(s) kubelet" in done.stderr


def test_kueue_refuses_a_podset_change_while_the_workload_holds_quota(world: World) -> None:
    """Kueue's webhook (v0.17.0 pkg/webhooks/workload_webhook.go ``ValidateWorkloadUpdate``): the
    PodSets of a Workload holding quota are immutable (403, its words below); once it holds none
    they may change.  The emulator's Kueue (tests/requeue/kueue_sim.py ``workload_webhook``) is
    held to the same words."""
    from tests.cluster.stage import queue_world, rayjob
    from tests.requeue.kueue_sim import PODSET_REFUSAL

    rayjob(world, queue=queue_world(world))
    wl = world.wait("the Workload admitted", lambda: next(
        (w for w in world.list("kueue.x-k8s.io/v1beta2", "workloads")
         if condition(w, "QuotaReserved").get("status") == "True"), None))
    name = wl["metadata"]["name"]
    podsets = wl["spec"]["podSets"]
    index = next(i for i, ps in enumerate(podsets) if ps["name"] == "gpu")
    changed = [*podsets[:index], worker_selector(podsets[index], {"x": "y"}), *podsets[index + 1:]]
    with pytest.raises(RestError) as refused:
        world.patch("kueue.x-k8s.io/v1beta2", "workloads", name, {"spec": {"podSets": changed}})
    assert (refused.value.status, refused.value.body["reason"]) == (403, "Forbidden"), refused.value
    words = PODSET_REFUSAL.fullmatch(refused.value.body["message"])
    assert words is not None and int(words.group(1)) == index, refused.value.body["message"]
    # deactivated, Kueue evicts it and releases the quota: the same change is taken
    world.patch("kueue.x-k8s.io/v1beta2", "workloads", name, {"spec": {"active": False}})
    world.wait("the quota released", lambda: condition(
        world.get("kueue.x-k8s.io/v1beta2", "workloads", name) or {}, "QuotaReserved").get("status") != "True")
    taken = world.patch("kueue.x-k8s.io/v1beta2", "workloads", name, {"spec": {"podSets": changed}})
    assert taken["spec"]["podSets"][index]["template"]["spec"]["nodeSelector"] == {"x": "y"}


def worker_selector(podset: dict, selector: dict[str, str]) -> dict:
    template = podset["template"]
    return {**podset, "template": {**template, "spec": {**template["spec"], "nodeSelector": selector}}}
