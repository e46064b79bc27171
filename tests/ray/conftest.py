"""A real local multi-node Ray cluster (token auth) for the RayGcs / ray-mode tests.

One cluster for the whole ``tests/ray`` package (starting a node takes seconds on two cores):
a head plus one worker labelled with an instance id (``resilienced.local.raycluster.LocalRayCluster``).
Tests that drain or kill nodes add their own nodes first.  Every process started here is
stopped here, also when a test fails; nothing runs ``ray stop``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from resilienced.local.raycluster import LocalRayCluster, LocalRayNode
from tests.support.ray import local_cluster

INSTANCE_LABEL = "resilienced.io/instance-id"
WORKER_INSTANCE = "i-0123456789abcdef0"


@pytest.fixture(scope="package")
def ray_cluster(ray_head: LocalRayCluster) -> Iterator[LocalRayCluster]:
    """The session's head (tests/conftest.py) with a worker labelled ``WORKER_INSTANCE``, which
    is stopped at the end of the package."""
    node = ray_head.add_node(labels={INSTANCE_LABEL: WORKER_INSTANCE}, num_cpus=1)
    try:
        yield ray_head
    finally:
        ray_head.kill_node(node)


@pytest.fixture
def fresh_node(ray_cluster: LocalRayCluster) -> Iterator[object]:
    """A factory of extra worker nodes (for tests that drain or kill them), stopped afterwards."""
    started: list[LocalRayNode] = []

    def add(instance_id: str) -> LocalRayNode:
        node = ray_cluster.add_node(labels={INSTANCE_LABEL: instance_id}, num_cpus=1)
        started.append(node)
        return node

    yield add
    for node in started:
        ray_cluster.kill_node(node)


@pytest.fixture(scope="package")
def loopback_node(ray_cluster: LocalRayCluster) -> Iterator[LocalRayNode]:
    """A worker at another loopback IP (127.0.0.2), with no labels: what the private-IP fallback
    of ray mode needs (a worker started so reports that address as its node manager address)."""
    node = ray_cluster.add_node(labels={}, num_cpus=1, node_ip="127.0.0.2")
    try:
        yield node
    finally:
        ray_cluster.kill_node(node)


@pytest.fixture(scope="package")
def second_cluster() -> Iterator[LocalRayCluster]:
    """Another cluster (head only) with its own token: one daemon talks to both."""
    with local_cluster("rr2-") as cluster:
        yield cluster


from tests.support.ray import busy  # noqa: E402,F401  (re-exported for the tests here)
