"""The real Kubernetes control plane for the ``cluster`` tests, built from source.

* ``build``: the Go builds of kube-apiserver, kube-controller-manager, kube-scheduler, etcd,
  kubectl, kwok, the KubeRay operator and Kueue (``make controlplane``), cached once per machine;
* ``plane``: :class:`ControlPlane`, which starts them on 127.0.0.1 and stops them;
* ``crds``, ``kwok``, ``operators``: what each component needs to run outside a cluster;
* ``world``: the daemon's identity as deployed, kwok Nodes, a test's namespace;
* ``daemon``: the daemon as deployed, in a process of its own, with the recording GCS stand-in;
* ``python -m tests.support.controlplane --kubeconfig FILE [--components ...]``: the same plane
  in the foreground, for a person (docs/development.md, "The real control plane").
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMPONENTS", "ControlPlane", "StartError"]


def __getattr__(name: str) -> Any:  # lazy: ``python -m ...build`` runs without importing the plane
    if name in __all__:
        from . import plane

        return getattr(plane, name)
    raise AttributeError(name)
