"""The replacement's estimate through a real GCS (a local Ray cluster with token auth): what the
daemon writes (``resilienced.ray.replacement``) is what an elastic run's controller reads with
``ray.experimental.internal_kv`` (``trainer.elastic``), and a node that joins is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from resilienced.local.raycluster import LocalRayCluster
from resilienced.ray.gcs import RayGcs
from resilienced.ray.replacement import HISTORY_PREFIX, KEY_PREFIX, ReplacementBoard
from resilienced.ray.requeue import REPLACES_LABEL
from tests.support.kubeoptions import LOCAL_BOUND_S
from trainer import replacement

from .conftest import INSTANCE_LABEL

pytestmark = pytest.mark.e2e

LOST = "e1" * 28


@pytest.fixture
def gcs(ray_cluster: LocalRayCluster) -> Iterator[RayGcs]:
    client = RayGcs(ray_cluster.address, token=ray_cluster.auth_token, timeout=LOCAL_BOUND_S)
    yield client
    with ray_cluster._gcs() as raw:  # leave the shared cluster's KV as it was
        for prefix in (KEY_PREFIX, HISTORY_PREFIX):
            for key in raw.internal_kv_keys(prefix.encode(), namespace=b"resilienced", timeout=LOCAL_BOUND_S):
                raw.internal_kv_del(key, False, namespace=b"resilienced", timeout=LOCAL_BOUND_S)


def read_as_the_controller(cluster: LocalRayCluster, node_id: str) -> bytes | None:
    """``ray.experimental.internal_kv`` in a Ray driver of the cluster, as ``ElasticCallback`` reads it."""
    code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "from ray.experimental import internal_kv\n"
            "from trainer import replacement\n"
            "raw = internal_kv._internal_kv_get(replacement.key(sys.argv[2]), namespace=replacement.NAMESPACE)\n"
            "sys.stdout.write(raw.decode() if raw else 'NONE')\n")
    env = {**os.environ, **cluster.env}
    out = subprocess.run([sys.executable, "-c", code, cluster.address, node_id], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return None if out.stdout == "NONE" else out.stdout.encode()


async def test_what_the_daemon_writes_is_what_the_run_reads(ray_cluster: LocalRayCluster, gcs: RayGcs) -> None:
    said = await ReplacementBoard(gcs, priors={"capacity-block": 75.0}).announce(
        lost={LOST: "i-0aaaaaaaaaaaaaaaa"}, capacity="capacity-block", replacements=["i-0bbbbbbbbbbbbbbbb"])
    raw = read_as_the_controller(ray_cluster, LOST)
    assert raw is not None and json.loads(raw)["lost_instance_id"] == "i-0aaaaaaaaaaaaaaaa"
    expected = replacement.Expected.parse(LOST, raw)
    assert expected.at == pytest.approx(said["asked_at"] + 75.0) and expected.basis.startswith("prior")
    assert read_as_the_controller(ray_cluster, "f0" * 28) is None  # no record: the run shrinks at once


async def test_a_node_that_joins_after_the_ask_is_measured_and_the_next_estimate_counts_it(
        ray_cluster: LocalRayCluster, gcs: RayGcs) -> None:
    board = ReplacementBoard(gcs, priors={"on-demand": 300.0})
    asked = time.time()
    await board.announce(lost={LOST: "i-0cccccccccccccccc"}, capacity="on-demand")
    node = ray_cluster.add_node(labels={INSTANCE_LABEL: "i-0dddddddddddddddd", REPLACES_LABEL: "i-0cccccccccccccccc"},
                                num_cpus=1)
    try:
        joined = time.time()  # add_node returns once the node is ALIVE in the GCS
        assert len(await board.settle()) == 1
        record = json.loads(await gcs.kv_get(KEY_PREFIX + LOST))
        assert record["joined_node"] == node.node_id
        assert 0 <= record["joined_s"] <= joined - asked + 1  # from the ask to the node's start, as the GCS has it
        said = await board.announce(lost={"e2" * 28: "i-0eeeeeeeeeeeeeeee"}, capacity="on-demand")
        assert said["expected_join_s"] == record["joined_s"] and said["basis"].startswith("measured")
    finally:
        ray_cluster.kill_node(node)
