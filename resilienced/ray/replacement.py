"""When an elastic run's replacement node is expected to join: the daemon's estimate, for the run.

An elastic run that loses a node decides, once the node is gone, whether to restart at once on
the survivors or to wait for the replacement (``trainer.replacement``, in Ray Train's controller).
It needs to know when the replacement will join; the daemon asked for it and is the one that can
say.  After the requeue of an elastic run asked for capacity, :meth:`ReplacementBoard.announce`
writes, into the run's Ray cluster's GCS internal KV (namespace ``resilienced``, the one
``resilienced.ray.gcs`` uses for claims), one record per lost Ray node::

    replacement/<lost node id, hex> = {"lost_instance_id": "i-0...", "capacity": "capacity-block",
        "asked_at": <unix s>, "expected_join_s": 65.0 | null, "basis": "...",
        "replacements": ["i-0..."], "joined_s": null}

``expected_join_s`` is the estimate (:func:`estimate_join`): the median of the last
:data:`HISTORY_USED` join times the daemon measured for launches of that capacity kind in this
cluster, else the configured prior (``--node-join-seconds``), else null (no estimate: the run
shrinks at once).  A requeue that found no capacity writes null too, with the reason.

**Measuring joins.**  A Ray node registers with the GCS when it joins; its ``start_time_ms`` is
that moment.  :meth:`ReplacementBoard.settle` matches each record not yet settled with the first
worker node that registered after its ``asked_at`` (in ray mode, the one labelled
``resilienced.io/replaces=<lost instance id>`` first; several records take the new nodes in
order), writes ``joined_s`` into it and appends it to ``node-join/<capacity>`` (a JSON list, the
newest :data:`HISTORY_KEPT`).  It runs at every announce, for the records of earlier ones, so the
estimate of the next interruption counts the launches before it; the history lives with the
cluster (a daemon restart or another replica reads the same), and a record whose node never came
is settled as never joined after :data:`GIVE_UP_S` (not counted).

The reader is ``trainer/replacement.py`` (the trainer does not import this package): the key, the
namespace and the fields above are the contract between them, in docs/requeue.md.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from resilienced.log import get as get_logger
from resilienced.model import Capacity, JsonValue, RequeueResult, Target
from resilienced.ports import BoardKv, RayControl, RayNode
from resilienced.ray.requeue import REPLACES_LABEL

log = get_logger(__name__)

#: Key prefixes in the GCS KV namespace ``resilienced``.
KEY_PREFIX = "replacement/"
HISTORY_PREFIX = "node-join/"
#: Join times kept per capacity kind, and how many of the newest the estimate takes the median of.
HISTORY_KEPT = 20
HISTORY_USED = 5
#: A record whose node has not joined this long after it was asked for is settled as never joined.
GIVE_UP_S = 3600.0


def estimate_join(history: Sequence[float], prior: float | None) -> tuple[float | None, str]:
    """(seconds a node of this kind takes to join, how that was found) from the measured history."""
    recent = [float(s) for s in history if isinstance(s, (int, float)) and s >= 0][-HISTORY_USED:]
    if recent:
        return round(statistics.median(recent), 1), f"measured: median of the last {len(recent)} join(s)"
    if prior is not None:
        return float(prior), "prior: --node-join-seconds"
    return None, "no estimate: no join measured and no --node-join-seconds"


def first_joined(nodes: Sequence[RayNode], *, after: float, instance_id: str, taken: set[str]) -> RayNode | None:
    """The replacement of ``instance_id``: the first worker node registered after ``after`` (unix s)
    that no other record took: one labelled as its replacement, else one labelled as nobody's,
    else any."""
    fresh = [n for n in nodes if not n.is_head and n.node_id not in taken and n.started_ms is not None
             and n.started_ms / 1000.0 >= after]
    pool = ([n for n in fresh if n.labels.get(REPLACES_LABEL) == instance_id]
            or [n for n in fresh if not n.labels.get(REPLACES_LABEL)] or fresh)
    return min(pool, key=lambda n: n.started_ms or 0, default=None)


def announcement(target: Target, result: RequeueResult) -> dict[str, Any] | None:
    """What :meth:`ReplacementBoard.announce` writes after this requeue, or None (nothing to write).

    Only for an elastic run with lost Ray nodes, and only when this requeue asked for capacity
    (``changes``: a launch, a patch) or found none (``wait``): a second notice for the same lost
    node (``already replaced``) keeps the first record and the time it was asked.
    """
    if target.facts.elastic is not True or result.dry_run:
        return None
    waiting = result.capacity is Capacity.WAIT
    lost = [*target.ray_node_ids, *(target.attributes.get("dead_node_ids") or [])]
    if not lost or not (result.changes or waiting):
        return None
    return {"lost": {node: target.instance_id for node in lost},
            "capacity": None if waiting else result.capacity.value,
            "replacements": list((result.details or {}).get("nodes") or []),
            "why_none": f"no capacity: {result.reason}" if waiting else ""}


class ReplacementAnnouncer:
    """:class:`~resilienced.ports.Replacements`: the board of the run's Ray cluster, reached through
    the mode's way to a run's GCS.

    Args:
        ray_control: the run's GCS (kubernetes mode: per RayCluster; ray mode: the one GCS).
        priors: seconds a node takes to join per capacity kind (``--node-join-seconds``).
    """

    def __init__(self, ray_control: Callable[[Target], Awaitable[RayControl]], *,
                 priors: Mapping[str, float]) -> None:
        self.ray_control = ray_control
        self.priors = dict(priors)

    async def announce(self, target: Target, result: RequeueResult) -> dict[str, JsonValue] | None:
        what = announcement(target, result)
        if what is None:
            return None
        ray = await self.ray_control(target)
        if not isinstance(ray, BoardKv):
            return None  # a Ray control without the internal KV (a stand-in of the cluster tests)
        return await ReplacementBoard(ray, priors=self.priors).announce(**what)


class ReplacementBoard:
    """The replacement records and join history of one Ray cluster (see the module docstring).

    Args:
        kv: the cluster's GCS adapter (``RayGcs``).
        priors: seconds a node takes to join per capacity kind, before any is measured.
        clock: unix seconds.
    """

    def __init__(self, kv: BoardKv, *, priors: Mapping[str, float], clock: Callable[[], float] = time.time) -> None:
        self.kv = kv
        self.priors = dict(priors)
        self.clock = clock

    async def announce(self, *, lost: Mapping[str, str], capacity: str | None, replacements: Sequence[str] = (),
                       why_none: str = "") -> dict[str, Any]:
        """Write the record of each lost node (``{node id: instance id}``); returns what was written.

        ``capacity`` None: no replacement was asked for (``why_none`` says why).
        """
        try:
            await self.settle()
        except Exception as e:  # the history is a help: the record matters more
            log.warning("settling earlier replacement records failed", error=f"{type(e).__name__}: {e}")
        if capacity is None:
            join, basis = None, why_none or "no replacement asked for"
        else:
            join, basis = estimate_join(await self.history(capacity), self.priors.get(capacity))
        now = self.clock()
        for node_id, instance_id in lost.items():
            record = {"lost_instance_id": instance_id, "capacity": capacity, "asked_at": now,
                      "expected_join_s": join, "basis": basis, "replacements": list(replacements),
                      "joined_s": None}
            await self.kv.kv_put(KEY_PREFIX + node_id, json.dumps(record).encode())
        log.info("replacement announced", lost=dict(lost), capacity=capacity, expected_join_s=join, basis=basis)
        return {"expected_join_s": join, "basis": basis, "asked_at": now, "capacity": capacity}

    async def history(self, capacity: str) -> list[float]:
        data = _loads(await self.kv.kv_get(HISTORY_PREFIX + capacity))
        return [float(s) for s in data if isinstance(s, (int, float))] if isinstance(data, list) else []

    async def settle(self) -> list[float]:
        """Measure the joins of earlier records (see the module docstring); the seconds measured."""
        keys = await self.kv.kv_keys(KEY_PREFIX)
        records = [(k, _loads(await self.kv.kv_get(k))) for k in keys]
        open_ = sorted(((k, r) for k, r in records if isinstance(r, dict) and r.get("capacity")
                        and r.get("joined_s") is None and isinstance(r.get("asked_at"), (int, float))),
                       key=lambda kr: kr[1]["asked_at"])
        if not open_:
            return []
        nodes = await self.kv.nodes()
        taken = {str(r.get("joined_node")) for _, r in records if isinstance(r, dict) and r.get("joined_node")}
        measured = []
        for key, record in open_:
            node = first_joined(nodes, after=float(record["asked_at"]), instance_id=str(record.get("lost_instance_id")),
                                taken=taken)
            if node is None:
                if self.clock() - float(record["asked_at"]) > GIVE_UP_S:
                    record["joined_s"] = -1.0  # never joined: settled, not counted
                    await self.kv.kv_put(key, json.dumps(record).encode())
                continue
            taken.add(node.node_id)
            seconds = round(max(0.0, (node.started_ms or 0) / 1000.0 - float(record["asked_at"])), 1)
            record.update(joined_s=seconds, joined_node=node.node_id)
            await self.kv.kv_put(key, json.dumps(record).encode())
            await self._remember(str(record["capacity"]), seconds)
            measured.append(seconds)
        return measured

    async def _remember(self, capacity: str, seconds: float) -> None:
        history = (await self.history(capacity) + [seconds])[-HISTORY_KEPT:]
        await self.kv.kv_put(HISTORY_PREFIX + capacity, json.dumps(history).encode())
        log.info("replacement joined", capacity=capacity, join_s=seconds, history=len(history))


def _loads(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
