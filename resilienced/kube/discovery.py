"""API discovery: which version of a custom resource the API server serves.

A CRD's versions come and go with the operator's release (Kueue serves ``Workload`` as
``v1beta1`` only up to v0.14 and adds ``v1beta2`` from v0.15), so a client that hard-codes one
version gets 404 on the other releases.  :func:`served_version` asks the server's discovery
endpoint of each candidate group-version (``GET /apis/<group>/<version>``, the
``APIResourceList``; readable by every authenticated user through the built-in
``system:discovery`` ClusterRole, so no RBAC rule is needed) and answers the first that lists
the resource.  :func:`served_as` answers the same for a :class:`CustomResource` (its version, else
its older ones): kubernetes mode starts the watch cache of another project's resource (Volcano
Jobs, Karpenter NodePools and EC2NodeClasses, Kueue's LocalQueues, ClusterQueues and ResourceFlavors) only
where the cluster serves it, since a cache of a resource that is not served would never sync and
the daemon would never become ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubernetes_asyncio import client as k8s

from resilienced.kube.api import KubeStatusError, call


async def served_version(api_client: k8s.ApiClient, *, group: str, plural: str, versions: Sequence[str],
                         request_timeout_s: float = 10.0) -> str | None:
    """The first of ``versions`` (in order of preference) in which the server serves ``plural.group``.

    None when no candidate is served (the CRD is not installed, or only in other versions).
    Connection failures and 5xx raise ``BackendUnavailable`` (retry later), as every call does.
    """
    custom = k8s.CustomObjectsApi(api_client)
    for version in versions:
        try:
            body = await call("get", f"discovery /apis/{group}/{version}", custom.get_api_resources(
                group, version, _preload_content=False, _request_timeout=request_timeout_s))
        except KubeStatusError as e:
            if e.status == 404:  # group-version not served
                continue
            raise
        if any(r.get("name") == plural for r in body.get("resources") or []):
            return version
    return None


@dataclass(frozen=True)
class CustomResource:
    """A custom resource kubernetes mode reads when the cluster serves it (in ``version``, else in
    one of ``older_versions``, in that order: Kueue serves only ``v1beta1`` up to v0.14)."""

    group: str
    version: str
    plural: str
    namespaced: bool
    older_versions: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.plural}.{self.group}"


async def served(api_client: k8s.ApiClient, resource: CustomResource, *, timeout_s: float) -> bool:
    """True when the API server serves ``resource`` (BackendUnavailable when it does not answer)."""
    return await served_as(api_client, resource, timeout_s=timeout_s) is not None


async def served_as(api_client: k8s.ApiClient, resource: CustomResource, *, timeout_s: float) -> str | None:
    """The version in which the API server serves ``resource`` (None: in none of its versions)."""
    return await served_version(api_client, group=resource.group, plural=resource.plural,
                                versions=(resource.version, *resource.older_versions), request_timeout_s=timeout_s)
