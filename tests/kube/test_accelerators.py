"""What a run's worker pods request of accelerators (kube.locate.accelerators_requested) and what a
Ray cluster's worker nodes offer (ray.cluster.accelerators_of): the ledger's GPU-seconds."""

from __future__ import annotations

import pytest

from resilienced.kube.locate import accelerators_requested
from resilienced.ports import RayNode
from resilienced.ray.cluster import accelerators_of

pytestmark = pytest.mark.unit


def pod(*containers: dict) -> dict:
    return {"spec": {"containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)]}}


def test_requests_else_limits_of_every_accelerator_kind_summed_over_the_pods() -> None:
    pods = [pod({"requests": {"nvidia.com/gpu": "8", "cpu": "90"}}),
            pod({"limits": {"nvidia.com/gpu": 8}}),  # a limit alone sets the request
            pod({"requests": {"aws.amazon.com/neuroncore": "2"}}, {"limits": {"memory": "1Gi"}})]
    assert accelerators_requested(pods) == 18.0
    assert accelerators_requested([pod({"requests": {"cpu": "4"}}), {"spec": {}}]) is None
    assert accelerators_requested([pod({"requests": {"nvidia.com/gpu": "1k"}})]) is None  # not a plain number


def test_the_ray_clusters_alive_worker_gpus() -> None:
    nodes = [RayNode("h", "10.0.0.1", {}, True, is_head=True, resources={"GPU": 8.0}),
             RayNode("a", "10.0.0.2", {}, True, resources={"GPU": 8.0, "CPU": 96.0}),
             RayNode("b", "10.0.0.3", {}, True, resources={"GPU": 8.0}),
             RayNode("c", "10.0.0.4", {}, False, resources={"GPU": 8.0})]
    assert accelerators_of(nodes) == 16.0
    assert accelerators_of([RayNode("a", "x", {}, True, resources={"CPU": 1.0})]) is None
