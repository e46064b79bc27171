"""The emulated Kubernetes API over HTTP, with RBAC limited to what the requeuers declare."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from resilienced.requeue.rbac import RBAC_RULES
from tests.support.kubeapi import RESOURCES, KubeApiServer, RbacRule


def rbac_of_requeue() -> list[RbacRule]:
    return [RbacRule(verbs=frozenset(rule.verbs), api_groups=frozenset(rule.api_groups),
                     resources=frozenset(rule.resources)) for rule in RBAC_RULES]


@pytest.fixture
async def kubeapi() -> AsyncIterator[KubeApiServer]:
    """The server; only the requests RBAC_RULES allows succeed (403 otherwise)."""
    async with KubeApiServer(token="requeue-test", rbac=rbac_of_requeue()) as server:
        yield server



def kueue_serving(*versions: str) -> KubeApiServer:
    """A server whose Kueue serves Workloads only in ``versions`` (v0.14: v1beta1; v0.15+: both)."""
    resources = [replace(t, versions=versions) if t.key == "workloads.kueue.x-k8s.io" else t for t in RESOURCES]
    resources = [t for t in resources if t.versions]
    return KubeApiServer(token="requeue-test", rbac=rbac_of_requeue(), resources=resources)
