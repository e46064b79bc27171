"""kwok (sigs.k8s.io/kwok v0.8.0) in place of kubelets: Nodes that report Ready and keep a
heartbeat, pods bound to them that report Running with an IP, and pods deleted when asked.

The Stages are kwok's own YAMLs from its module (``build.py`` copies them into the build's
``stages/``): ``node-initialize`` (kustomize/stage/node/fast), ``node-heartbeat``
(kustomize/stage/node/heartbeat), ``pod-ready`` and ``pod-delete`` (kustomize/stage/pod/fast).
Left out on purpose: the fast set's ``pod-complete``, which ends every running pod owned by a Job
at once (kustomize/stage/pod/fast/README.md) and so would end KubeRay's submitter Job, and with
it the RayJob, 30 s later (ray-operator v1.6.0 ``rayjob_controller.go``,
``DefaultSubmitterFinishedTimeout``).  A pod then runs until it is deleted, as a training pod does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import build

if TYPE_CHECKING:
    from .plane import ControlPlane

STAGES = ("node-initialize.yaml", "node-heartbeat.yaml", "pod-ready.yaml", "pod-delete.yaml")
#: The pods' IPs (kwok's --cidr): a range of its own, so no test IP can be taken for a pod's.
POD_CIDR = "10.244.0.1/16"


def start_kwok(plane: ControlPlane) -> None:
    from .plane import _wait, free_port

    assert plane.workdir is not None
    folder = build.built("kwok") / "stages"
    config = plane.workdir / "kwok.yaml"
    config.write_text("\n---\n".join((folder / name).read_text() for name in STAGES))
    kubeconfig = plane.write_kubeconfig(plane.workdir / "kwok.kubeconfig")
    port = free_port()
    process = plane._spawn("kwok", [
        build.program("kwok"), f"--kubeconfig={kubeconfig}", f"--config={config}",
        "--manage-all-nodes=true", f"--server-address=127.0.0.1:{port}", f"--cidr={POD_CIDR}",
        "--node-ip=10.243.0.1",
    ])

    def healthy() -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200

    _wait("/healthz", healthy, process=process)
