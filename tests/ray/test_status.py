"""``resilienced status`` in ray mode against the real local Ray cluster: a real Recovery writes
its run claim to the GCS KV (a rebalance recommendation under the notify policy: no drain, so
the shared cluster is left as it was), and ``status`` reads it back over the GCS."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from resilienced.app import cli
from resilienced.intake import pipeline as intake
from resilienced.local.raycluster import LocalRayCluster
from resilienced.model import Result
from resilienced.ray.claims import RayKvClaims
from resilienced.ray.cluster import RayModeCluster
from resilienced.recovery.responder import Recovery
from resilienced.ops.run_record import FIELDS
from resilienced.settings import IntakeSettings

from .conftest import WORKER_INSTANCE
from .test_cluster import URI, gcs

pytestmark = pytest.mark.e2e


def rebalance(event_id: str) -> str:
    return json.dumps({
        "version": "0", "id": event_id, "detail-type": "EC2 Instance Rebalance Recommendation",
        "source": "aws.ec2", "account": "123456789012", "region": "us-east-1",
        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "resources": [], "detail": {"instance-id": WORKER_INSTANCE}})


async def test_status_reads_what_a_recovery_recorded_in_the_gcs(ray_cluster: LocalRayCluster,
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    event_id = f"5e0c1a2b-0000-4000-8000-{int(datetime.now().timestamp() * 1000) % 10**12:012d}"
    plan = intake.read(rebalance(event_id), IntakeSettings()).plan
    assert plan.actionable, plan.reason
    ray = gcs(ray_cluster)
    recovery = Recovery(cluster=RayModeCluster(ray=ray, checkpoint_uri=URI),
                        claims=RayKvClaims(kv=ray), ray_control=lambda target: ray)
    outcome = await recovery.act(plan, holder="replica-a/m1")
    assert outcome.result is Result.DONE, outcome.reason
    token = tmp_path / "token"
    token.write_text(ray_cluster.auth_token)

    code = await asyncio.to_thread(cli.main, ["status", "--ray-address", ray_cluster.address,
                                              "--ray-token-file", str(token), "--json"])
    out, err = capsys.readouterr()

    assert code == 0, err
    parsed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = [row for row in parsed if set(row) == set(FIELDS)]  # the test's own logs set aside
    (row,) = [r for r in rows if r["event_id"] == event_id]
    assert (row["kind"], row["instances"], row["run"], row["outcome"]) == (
        "rebalance_recommendation", [WORKER_INSTANCE], ray_cluster.address, "done")
    assert (row["checkpoint_step"], row["durable"], row["capacity"]) == (None, None, None)
