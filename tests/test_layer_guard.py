"""The test layers' guard (tests/support/layers.py): what a process start needs."""

from __future__ import annotations

import pytest

from tests.support import layers

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("argv", "layer"), [
    (["/cache/k8s-v1.37.2/bin/kube-apiserver", "--secure-port=1"], "cluster"),
    (["/cache/kueue-v0.17.0/bin/kueue", "--config=x"], "cluster"),
    (["python", "-m", "tests.support.controlplane", "--kubeconfig", "k"], "cluster"),
    (["python", "-m", "tests.support.controlplane.daemon", "--stand-ins", "s"], "cluster"),
    (["/cache/bin/kubectl", "kustomize", "deploy"], "integration"),
    (["python", "-m", "moto.server"], "integration"),
    (["ray", "start", "--head"], "e2e"),
])
def test_a_process_start_needs_the_layer_of_what_it_starts(argv: list[str], layer: str) -> None:
    assert layers.classify_command(argv)[0] == layer


def test_an_integration_test_that_starts_the_control_plane_is_told_to_be_a_cluster_test() -> None:
    seen = layers.Seen()
    seen.add(*layers.classify_command(["/x/etcd", "--data-dir=d"]))
    problem = layers.too_much("integration", seen)
    assert problem is not None and "mark it cluster" in problem
    assert layers.too_much("cluster", seen) is None and layers.too_much("e2e", seen) is None
