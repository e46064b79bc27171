"""``resilienced.local.raycluster``: a real local multi-node Ray cluster that cleans up after itself."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from resilienced.local.raycluster import (
    CAPACITY_TYPE_LABEL,
    INSTANCE_ID_LABEL,
    LocalRayCluster,
    LocalRayError,
)

pytestmark = pytest.mark.e2e


def test_nodes_are_listed_with_their_labels(ray_cluster: LocalRayCluster) -> None:
    listed = {n.node_id: n for n in ray_cluster.nodes()}
    assert ray_cluster.head is not None and listed[ray_cluster.head.node_id].is_head
    for node in ray_cluster.workers[:2]:
        info = listed[node.node_id]
        assert info.labels[INSTANCE_ID_LABEL] == node.labels[INSTANCE_ID_LABEL]
        assert info.labels[CAPACITY_TYPE_LABEL] == "spot"
    assert ray_cluster.address.startswith("127.0.0.1:")
    assert ray_cluster.env["RAY_AUTH_MODE"] == "token" and ray_cluster.env["RAY_AUTH_TOKEN"] == ray_cluster.auth_token


@pytest.mark.parametrize(
    "labels",
    [{CAPACITY_TYPE_LABEL: "reserved"}, {INSTANCE_ID_LABEL: "i-1,2"}, {"": "x"}],
    ids=["unknown-capacity-type", "comma-in-value", "empty-key"],
)
def test_a_bad_label_is_refused_before_anything_starts(ray_cluster: LocalRayCluster, labels) -> None:
    before = len(ray_cluster.workers)
    with pytest.raises(ValueError, match="label"):
        ray_cluster.add_node(labels=labels)
    assert len(ray_cluster.workers) == before


def test_stop_leaves_no_process_and_no_temp_dir_also_after_a_failed_start() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    try:
        failed = LocalRayCluster(workdir=workdir / "a", start_timeout_s=0.01)
        with pytest.raises(LocalRayError, match="not listed ALIVE"):
            failed.start()
        assert failed.processes() == [] and not (workdir / "a" / "ray").exists()

        with LocalRayCluster(workdir=workdir / "b") as cluster:
            assert cluster.processes()  # the head's GCS, raylet, agents...
        assert cluster.processes() == [] and not (workdir / "b" / "ray").exists()
        cluster.stop()  # idempotent
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_workdir_too_long_for_rays_sockets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too long"):
        LocalRayCluster(workdir=tmp_path / ("x" * 60))
