"""Kubernetes mode: KubeRay runs located through watch caches, Nodes cordoned, Events, Lease claims.

Modules, bottom up (each imports only those above it in this list):

``api``      the boundary with kubernetes_asyncio: raw JSON calls, error translation, ``connect``
``locate``   pure rules: providerID, Ray pod labels, owners, checkpoint annotation, GCS address
``cache``    list-then-watch caches (informers) with indices
``tokens``   the Ray auth token of a RayCluster: none, its Secret, or delegated to Kubernetes
``events``   deduplicated core/v1 Events
``leases``   ``KubeLeaseClaims``: ``ports.ClaimStore`` on coordination.k8s.io/v1 Leases
``rbac``     ``RBAC_RULES``: every permission the above needs, and why
``cluster``  ``KubeCluster``: ``ports.Cluster`` (mode ``kubernetes``)

docs/kubernetes.md describes the whole.
"""
