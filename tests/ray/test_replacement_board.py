"""The daemon's estimate of when an elastic run's replacement joins (``resilienced.ray.replacement``):
pure code against an in-memory stand-in of the GCS KV and node table.  The real GCS, and the run's
side reading what the daemon wrote: test_replacement_gcs.py."""

from __future__ import annotations

import json

import pytest

from resilienced.ports import RayNode
from resilienced.ray.replacement import GIVE_UP_S, HISTORY_PREFIX, KEY_PREFIX, ReplacementBoard, estimate_join
from resilienced.ray.requeue import REPLACES_LABEL
from trainer.replacement import Expected

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0
LOST = "ab" * 28


class Gcs:
    """The KV and node list of one cluster, in memory; a clock the test moves."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.node_list: list[RayNode] = []
        self.now = T0

    async def kv_put(self, key: str, value: bytes) -> None:
        self.kv[key] = bytes(value)

    async def kv_get(self, key: str) -> bytes | None:
        return self.kv.get(key)

    async def kv_keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.kv if k.startswith(prefix))

    async def nodes(self) -> list[RayNode]:
        return list(self.node_list)

    def join(self, node_id: str, *, at: float, labels: dict[str, str] | None = None) -> None:
        self.node_list.append(RayNode(node_id=node_id, address="10.0.0.9", labels=labels or {}, alive=True,
                                      started_ms=int(at * 1000)))

    def record(self, node_id: str = LOST) -> dict:
        return json.loads(self.kv[KEY_PREFIX + node_id])


def board(gcs: Gcs, **priors: float) -> ReplacementBoard:
    return ReplacementBoard(gcs, priors={k.replace("_", "-"): v for k, v in priors.items()}, clock=lambda: gcs.now)


@pytest.mark.parametrize(("history", "prior", "expected"), [
    ([], None, (None, "no estimate")),
    ([], 90.0, (90.0, "prior")),
    ([70.0], 90.0, (70.0, "measured: median of the last 1")),
    ([500.0, 10.0, 60.0, 70.0, 80.0, 65.0], 90.0, (65.0, "measured: median of the last 5")),  # 500 is too old
    ([-1.0, 40.0], None, (40.0, "measured: median of the last 1")),  # a node that never joined is not a time
], ids=["nothing", "prior", "one-measured", "median-of-recent", "never-joined-ignored"])
def test_the_estimate_is_the_median_of_recent_joins_else_the_prior(history, prior, expected) -> None:
    seconds, basis = estimate_join(history, prior)
    assert seconds == expected[0] and basis.startswith(expected[1])


async def test_an_announce_writes_what_the_run_reads() -> None:
    gcs = Gcs()
    said = await board(gcs, capacity_block=60.0).announce(lost={LOST: "i-0aaaaaaaaaaaaaaaa"},
                                                          capacity="capacity-block", replacements=["i-0bbb"])
    assert said == {"expected_join_s": 60.0, "basis": "prior: --node-join-seconds", "asked_at": T0,
                    "capacity": "capacity-block"}
    record = gcs.record()
    assert (record["lost_instance_id"], record["replacements"], record["joined_s"]) == ("i-0aaaaaaaaaaaaaaaa", ["i-0bbb"], None)
    # the run's reader (trainer/replacement.py): the replacement is expected at asked_at + 60
    assert Expected.parse(LOST, gcs.kv[KEY_PREFIX + LOST]).at == T0 + 60.0


async def test_no_capacity_says_no_replacement_is_coming() -> None:
    gcs = Gcs()
    await board(gcs, spot=60.0).announce(lost={LOST: "i-0a"}, capacity=None, why_none="no capacity: wait")
    expected = Expected.parse(LOST, gcs.kv[KEY_PREFIX + LOST])
    assert expected.at is None and expected.basis == "no capacity: wait"


async def test_the_next_estimate_counts_the_joins_of_earlier_launches() -> None:
    """The first launch has only the prior (90 s); its node joins 42 s after it was asked for; the
    next announce measures that join first and estimates from it, per capacity kind."""
    gcs = Gcs()
    b = board(gcs, capacity_block=90.0, on_demand=120.0)
    await b.announce(lost={LOST: "i-0a"}, capacity="capacity-block")
    gcs.join("11" * 28, at=T0 - 5)  # registered before the ask: not the replacement
    gcs.join("cd" * 28, at=T0 + 42, labels={REPLACES_LABEL: "i-0a"})
    gcs.now = T0 + 600
    other = "ef" * 28
    said = await b.announce(lost={other: "i-0c"}, capacity="capacity-block")
    assert said["expected_join_s"] == 42.0 and said["basis"].startswith("measured")
    assert (gcs.record()["joined_s"], gcs.record()["joined_node"]) == (42.0, "cd" * 28)
    assert json.loads(gcs.kv[HISTORY_PREFIX + "capacity-block"]) == [42.0]
    said = await b.announce(lost={"99" * 28: "i-0d"}, capacity="on-demand")
    assert said["expected_join_s"] == 120.0  # another kind: its own prior


async def test_two_replacements_take_the_new_nodes_in_order_and_an_unlabelled_node_counts() -> None:
    gcs = Gcs()
    b = board(gcs, spot=60.0)
    await b.announce(lost={LOST: "i-0a"}, capacity="spot")
    gcs.now = T0 + 10
    await b.announce(lost={"cd" * 28: "i-0c"}, capacity="spot")
    gcs.join("01" * 28, at=T0 + 30)  # KubeRay's pods carry no replaces label
    gcs.join("02" * 28, at=T0 + 55)
    gcs.now = T0 + 100
    assert await b.settle() == [30.0, 45.0]
    assert gcs.record()["joined_node"] == "01" * 28 and gcs.record("cd" * 28)["joined_node"] == "02" * 28
    assert await b.settle() == []  # settled once


async def test_a_replacement_that_never_joins_is_given_up_and_not_counted() -> None:
    gcs = Gcs()
    b = board(gcs, spot=60.0)
    await b.announce(lost={LOST: "i-0a"}, capacity="spot")
    gcs.now = T0 + GIVE_UP_S + 1
    assert await b.settle() == []
    assert gcs.record()["joined_s"] == -1.0 and HISTORY_PREFIX + "spot" not in gcs.kv
    gcs.join("01" * 28, at=T0 + GIVE_UP_S + 2)
    assert await b.settle() == []  # no longer open


def elastic_target(*, elastic: bool | None = True, alive: tuple[str, ...] = (LOST,), dead: tuple[str, ...] = ()):
    from resilienced.model import RunFacts, Target

    return Target(instance_id="i-0aaaaaaaaaaaaaaaa", node="10.0.0.1", ray_cluster=None, ray_job=None,
                  ray_node_ids=alive, checkpoint_uri=None, ray_address="10.0.0.1:6379",
                  attributes={"dead_node_ids": list(dead)}, facts=RunFacts(elastic=elastic))


def requeued(capacity: str, *, changes: tuple[str, ...] = ("launched 1 node",), dry_run: bool = False,
             nodes: tuple[str, ...] = ()):
    from resilienced.model import Capacity, CapacityDecision, RequeueResult

    return RequeueResult(run_key="10.0.0.1:6379", kind="ray", capacity=Capacity(capacity), reason="no room anywhere",
                         changes=changes, dry_run=dry_run, details={"nodes": list(nodes)},
                         decision=CapacityDecision(Capacity(capacity), "decided"))


@pytest.mark.parametrize(("target", "result", "written"), [
    (elastic_target(), requeued("capacity-block", nodes=("i-0new",)),
     {"lost": {LOST: "i-0aaaaaaaaaaaaaaaa"}, "capacity": "capacity-block", "replacements": ["i-0new"], "why_none": ""}),
    (elastic_target(alive=(), dead=(LOST,)), requeued("on-demand"),  # a state change: the node is dead already
     {"lost": {LOST: "i-0aaaaaaaaaaaaaaaa"}, "capacity": "on-demand", "replacements": [], "why_none": ""}),
    (elastic_target(), requeued("wait", changes=()),
     {"lost": {LOST: "i-0aaaaaaaaaaaaaaaa"}, "capacity": None, "replacements": [],
      "why_none": "no capacity: no room anywhere"}),
    (elastic_target(), requeued("capacity-block", changes=()), None),  # already replaced: keep the first record
    (elastic_target(elastic=None), requeued("capacity-block"), None),  # a gang
    (elastic_target(), requeued("capacity-block", dry_run=True), None),
    (elastic_target(alive=()), requeued("capacity-block"), None),  # no Ray node to name
], ids=["launched", "state-change", "no-capacity", "already-replaced", "not-elastic", "dry-run", "no-node"])
def test_a_replacement_is_announced_when_this_requeue_asked_for_it_or_found_none(target, result, written) -> None:
    from resilienced.ray.replacement import announcement

    assert announcement(target, result) == written
