"""Optional custom resources: whether the cluster serves one, so its cache starts only where it does.

Custom resources of other projects (Volcano Jobs, Karpenter NodePools and EC2NodeClasses) are
not in every cluster.  A watch cache of a resource the server does not serve would never sync, and
kubernetes mode would never become ready; so :func:`served` asks the discovery endpoint
``GET /apis/<group>/<version>`` first (404: the group/version is not served; otherwise the
resource must be listed in its ``resources``).  Discovery is allowed to every authenticated user
(the ``system:discovery`` ClusterRole): it needs no RBAC rule of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes_asyncio import client as k8s

from resilienced.kube.api import KubeStatusError, call


@dataclass(frozen=True)
class CustomResource:
    """A custom resource kubernetes mode reads when the cluster serves it."""

    group: str
    version: str
    plural: str
    namespaced: bool

    @property
    def key(self) -> str:
        return f"{self.plural}.{self.group}"


async def served(api_client: k8s.ApiClient, resource: CustomResource, *, timeout_s: float) -> bool:
    """True when the API server serves ``resource`` (BackendUnavailable when it does not answer)."""
    custom = k8s.CustomObjectsApi(api_client)
    try:
        body = await call(verb="get", resource=f"/apis/{resource.group}/{resource.version}",
                          request=custom.get_api_resources(resource.group, resource.version,
                                                           _preload_content=False,
                                                           _request_timeout=timeout_s))
    except KubeStatusError as err:
        if err.status == 404:
            return False
        raise
    return any(r.get("name") == resource.plural for r in body.get("resources") or [])
