"""Ray mode: Ray clusters without Kubernetes (e.g. launched on EC2), and the local drill.

:class:`RayModeCluster` implements :class:`~resilienced.ports.Cluster` for one Ray cluster:

* ``locate`` maps an EC2 instance id to the Ray nodes on it.  First by a node label
  (``resilienced.io/instance-id`` by default: start each node with
  ``ray start --labels=resilienced.io/instance-id=$(ec2-metadata -i)``), else by private IP: the
  instance's private addresses from EC2 ``DescribeInstances`` compared with each node's
  ``node_manager_address``.  The whole Ray cluster is the run, so a target's ``run_key`` is the
  GCS address; ``ray_cluster``/``ray_job`` are None.
* ``cordon`` does nothing: a draining Ray node already takes no new work (the GCS stops
  scheduling on it once the drain is accepted), and there is no scheduler above Ray to tell.
* ``record`` writes a log line (there are no Kubernetes Events to attach it to).

:class:`RayKvClaims` implements :class:`~resilienced.ports.ClaimStore` on the GCS internal KV of
the cluster, for several daemon replicas watching one Ray cluster.  The GCS KV has no
compare-and-set, only an atomic put-if-absent, so a claim is a chain of generations: the record
of generation ``g`` lives at ``claims/<quoted key>/<g>`` and the newest generation is the claim.
Taking over an expired generation ``g`` means creating ``g + 1`` with put-if-absent: of two
replicas that both see ``g`` expired exactly one creates ``g + 1``, so a takeover never has two
winners.  Only the holder of a generation rewrites it (renew, complete, release); a holder whose
generation was superseded sees the newer one and backs off.  What is left: a holder that renews
*after* its TTL ran out and *while* another replica is taking over may believe for one call that it
still holds the claim; the next renew (or complete) finds the newer generation.  Expiry times are
wall-clock unix seconds written by the replicas, so their clocks must agree to well under a TTL
(NTP does this).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from resilienced.errors import BackendUnavailable
from resilienced.model import Target
from resilienced.ports import Claim, Location, RayControl, RayNode
from resilienced.sqs import translate  # the shared AWS error translation

log = logging.getLogger(__name__)

#: The node labels of ray mode (``ray start --labels=...``); the local drill uses them too.
#: The EC2 instance a Ray node runs on:
INSTANCE_ID_LABEL = "resilienced.io/instance-id"
#: ``spot`` | ``capacity-block`` | ``on-demand``: the pool the node came from.
CAPACITY_TYPE_LABEL = "resilienced.io/capacity-type"
#: The Capacity Block (``cr-...``) a node runs in, when it does.
RESERVATION_LABEL = "resilienced.io/capacity-reservation-id"
#: The node's instance type and zone (else ``--instance-type``; zone unknown).
INSTANCE_TYPE_LABEL = "resilienced.io/instance-type"
ZONE_LABEL = "resilienced.io/zone"
#: ``true`` on a run's worker nodes: the run is elastic (docs/requeue.md "Elastic runs"): losing the
#: node asks for a replacement only, the other workers keep training.
ELASTIC_LABEL = "resilienced.io/elastic"


class RayModeCluster:
    """``ports.Cluster`` for one Ray cluster without Kubernetes.

    Args:
        ray: the cluster's GCS adapter (:class:`resilienced.raygcs.RayGcs`).
        checkpoint_uri: the run's S3 prefix (``s3://bucket/prefix``) from configuration, put on
            every target; None when nobody said where checkpoints go.
        ray_address: the GCS address put on targets (default: ``ray.address``).
        ec2: an aiobotocore EC2 client (owned by the caller) for the private-IP fallback; None
            turns the fallback off (only labelled nodes are found).
        instance_label: the node label key holding the EC2 instance id.
    """

    mode = "ray"

    def __init__(
        self,
        *,
        ray: RayControl,
        checkpoint_uri: str | None,
        ray_address: str | None = None,
        ec2: Any | None = None,
        instance_label: str = INSTANCE_ID_LABEL,
        instance_type: str | None = None,
    ) -> None:
        if not instance_label or not isinstance(instance_label, str):
            raise ValueError("instance_label must be a non-empty node label key")
        self._ray = ray
        self._ec2 = ec2
        self.checkpoint_uri = checkpoint_uri
        self.ray_address = ray_address if ray_address is not None else getattr(ray, "address", None)
        self.instance_label = instance_label
        self.instance_type = instance_type

    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        """The Ray nodes on each instance (label first, then private IP).

        ``capacity_reservation_id`` is not used: the instances of a reservation are resolved
        before this call.  A target's ``ray_node_ids`` are its *alive* worker nodes (those to
        drain; a head node on the instance is flagged ``attributes["head_on_instance"]`` and never
        drained); nodes found dead are listed in ``attributes["dead_node_ids"]`` (the instance
        is gone, the run still needs requeueing from its newest checkpoint).
        """
        wanted = list(dict.fromkeys(instance_ids))
        if not wanted:
            return Location(targets=(), unresolved={})
        nodes = await self._ray.nodes()
        targets: list[Target] = []
        unresolved: dict[str, str] = {}
        by_label: dict[str, list[RayNode]] = {}
        for node in nodes:
            iid = node.labels.get(self.instance_label)
            if iid:
                by_label.setdefault(iid, []).append(node)
        rest = [iid for iid in wanted if iid not in by_label]
        addresses = await self._private_addresses(rest) if rest and self._ec2 is not None else {}
        for iid in wanted:
            if iid in by_label:
                targets.append(self._target(iid, by_label[iid], matched_by="label"))
                continue
            if self._ec2 is None:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid}, and no EC2 lookup "
                    "is configured for the private-IP fallback"
                )
                continue
            ips = addresses.get(iid)
            if ips is None:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid}, and EC2 does not know "
                    "the instance"
                )
                continue
            on_ip = [n for n in nodes if n.address in ips]
            if not on_ip:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid} or at its private "
                    f"address{'es' if len(ips) > 1 else ''} {', '.join(sorted(ips)) or '(none)'}"
                )
                continue
            targets.append(self._target(iid, on_ip, matched_by="private-ip"))
        return Location(targets=tuple(targets), unresolved=unresolved)

    def _target(self, instance_id: str, nodes: list[RayNode], *, matched_by: str) -> Target:
        alive = [n for n in nodes if n.alive]
        dead = [n for n in nodes if not n.alive]
        shown = alive or dead
        return Target(
            instance_id=instance_id,
            node=shown[0].address if shown else None,
            ray_cluster=None,
            ray_job=None,
            # Never the head: a drained idle head raylet leaves at once (seen here), taking the
            # driver with it; the head's instance going away ends the cluster in any case.
            ray_node_ids=tuple(n.node_id for n in alive if not n.is_head),
            checkpoint_uri=self.checkpoint_uri,
            ray_address=self.ray_address,
            attributes={
                "matched_by": matched_by,
                "dead_node_ids": [n.node_id for n in dead],
                "head_on_instance": any(n.is_head for n in alive),
                **self._capacity_facts(shown),
            },
        )

    def _capacity_facts(self, nodes: list[RayNode]) -> dict[str, Any]:
        """What the capacity decision needs, from the node labels (else the configured type)."""
        node_labels = nodes[0].labels if nodes else {}
        facts: dict[str, Any] = {}
        instance_type = node_labels.get(INSTANCE_TYPE_LABEL) or self.instance_type
        if instance_type:
            facts["instance_type"] = instance_type
        for key, label in (("availability_zone", ZONE_LABEL), ("capacity_type", CAPACITY_TYPE_LABEL),
                           ("reservation_id", RESERVATION_LABEL)):
            if node_labels.get(label):
                facts[key] = node_labels[label]
        facts["elastic"] = str(node_labels.get(ELASTIC_LABEL, "")).strip().lower() == "true"
        return facts

    async def _private_addresses(self, instance_ids: list[str]) -> dict[str, set[str]]:
        """instance id -> its private IPv4 addresses, for the instances EC2 knows.

        A filter on ``instance-id`` (not ``InstanceIds``): an unknown id is then just absent
        instead of failing the whole call with ``InvalidInstanceID.NotFound``.
        """
        out: dict[str, set[str]] = {}
        for start in range(0, len(instance_ids), 200):  # at most 200 values per filter
            chunk = instance_ids[start:start + 200]
            token: str | None = None
            while True:
                kwargs: dict[str, Any] = {"Filters": [{"Name": "instance-id", "Values": chunk}]}
                if token:
                    kwargs["NextToken"] = token
                try:
                    page = await self._ec2.describe_instances(**kwargs)
                except Exception as e:
                    raise translate(e, operation="DescribeInstances", backend="ec2") from e
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        ips = out.setdefault(inst["InstanceId"], set())
                        if inst.get("PrivateIpAddress"):
                            ips.add(inst["PrivateIpAddress"])
                        for eni in inst.get("NetworkInterfaces", []):
                            for addr in eni.get("PrivateIpAddresses", []):
                                if addr.get("PrivateIpAddress"):
                                    ips.add(addr["PrivateIpAddress"])
                token = page.get("NextToken")
                if not token:
                    break
        return out

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> None:
        """Nothing to do in ray mode: a draining Ray node takes no new work already."""
        log.info(
            "ray mode: no cordon for %s (%s): the drain keeps new work off its Ray nodes",
            target.instance_id, reason,
        )

    async def record(
        self, target: Target, *, reason: str, message: str, warning: bool = False,
        once: str | None = None,
    ) -> None:
        (log.warning if warning else log.info)(
            "%s: %s [instance %s, ray %s, nodes %s]",
            reason, message, target.instance_id, target.ray_address, ",".join(target.ray_node_ids),
        )


# --------------------------------------------------------------------------- claims
class GcsKv(Protocol):
    """The internal-KV calls :class:`RayKvClaims` needs (``RayGcs`` has them)."""

    async def kv_put_if_absent(self, key: str, value: bytes) -> bool: ...

    async def kv_put(self, key: str, value: bytes) -> None: ...

    async def kv_get(self, key: str) -> bytes | None: ...

    async def kv_keys(self, prefix: str) -> list[str]: ...

    async def kv_del(self, key: str) -> bool: ...


_PREFIX = "claims/"


class RayKvClaims:
    """``ports.ClaimStore`` on a Ray cluster's GCS internal KV (namespace ``resilienced``).

    Same rules as :class:`resilienced.claims.MemoryClaims`: a free or expired claim is taken, the
    same holder renews, another live holder or a remembered ``done`` wins.  Records are JSON
    ``{"holder", "state": "held"|"done"|"released", "expires": unix s, "details"}``.

    Args:
        kv: the cluster's :class:`resilienced.raygcs.RayGcs`.
        done_ttl_seconds: how long a done claim is remembered (the dedupe window).
        clock: wall-clock unix seconds (shared by replicas; injectable for tests).
    """

    def __init__(self, *, kv: GcsKv, done_ttl_seconds: float = 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._kv = kv
        self._done_ttl = done_ttl_seconds
        self._clock = clock

    # ------------------------------------------------------------------ port
    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Claim | None:
        _check(key, holder)
        for _ in range(5):  # a lost race means someone else acted: look again, a few times
            gen, record = await self._current(key)
            now = self._clock()
            held = {"holder": holder, "state": "held", "expires": now + ttl_seconds, "details": {}}
            if record is None and gen == 0:
                if await self._kv.kv_put_if_absent(self._gen_key(key, 1), _dump(held)):
                    return Claim(key=key, holder=holder, state="held")
                continue
            live = record is not None and record["expires"] > now
            if live and record["state"] == "done":
                return None
            if live and record["state"] == "held" and record["holder"] != holder:
                return None
            if live and record["holder"] == holder:
                # renew our own generation, then make sure nobody superseded it meanwhile
                await self._kv.kv_put(self._gen_key(key, gen), _dump(held))
                newer, _ = await self._current(key)
                if newer != gen:
                    return None
                return Claim(key=key, holder=holder, state="held")
            # free: expired, released or unreadable -> take over with the next generation
            if await self._kv.kv_put_if_absent(self._gen_key(key, gen + 1), _dump(held)):
                await self._prune(key, below=gen)
                if record is not None and record["state"] == "held":
                    log.info("claim %s: took over from %s (expired)", key, record["holder"])
                return Claim(key=key, holder=holder, state="held")
        raise BackendUnavailable("ray-gcs", f"claim {key}: lost the race five times in a row")

    async def get(self, key: str) -> Claim | None:
        _check(key, "(reader)")
        _, record = await self._current(key)
        if record is None or record["expires"] <= self._clock() or record["state"] == "released":
            return None
        return Claim(key=key, holder=record["holder"], state=record["state"],
                     details=record.get("details") or {})

    async def complete(self, key: str, *, holder: str, details: Mapping[str, Any]) -> None:
        _check(key, holder)
        gen, record = await self._current(key)
        done = {"holder": holder, "state": "done", "expires": self._clock() + self._done_ttl,
                "details": dict(details)}
        if record is not None and record["holder"] != holder and record["expires"] > self._clock():
            return  # taken over after our TTL ran out: the new holder decides
        if record is not None and record["holder"] == holder:
            await self._kv.kv_put(self._gen_key(key, gen), _dump(done))
            return
        await self._kv.kv_put_if_absent(self._gen_key(key, gen + 1), _dump(done))

    async def release(self, key: str, *, holder: str) -> None:
        _check(key, holder)
        gen, record = await self._current(key)
        if record is not None and record["holder"] == holder and record["state"] == "held":
            released = dict(record, state="released", expires=0.0)
            await self._kv.kv_put(self._gen_key(key, gen), _dump(released))

    async def done(self, prefix: str = "") -> list[Claim]:
        """Every remembered done claim whose key starts with ``prefix`` (reads only)."""
        found = []
        bases = {k[:k.rindex("/") + 1] for k in await self._kv.kv_keys(
            _PREFIX + urllib.parse.quote(prefix, safe=""))}
        for base in sorted(bases):
            key = urllib.parse.unquote(base[len(_PREFIX):-1])
            claim = await self.get(key)
            if claim is not None and claim.state == "done":
                found.append(claim)
        return found

    # ------------------------------------------------------------------ storage
    @staticmethod
    def _base(key: str) -> str:
        return _PREFIX + urllib.parse.quote(key, safe="") + "/"

    def _gen_key(self, key: str, gen: int) -> str:
        return f"{self._base(key)}{gen:012d}"

    async def _current(self, key: str) -> tuple[int, dict[str, Any] | None]:
        """(newest generation, its record); (0, None) when there is none.

        An unreadable record counts as free (it is logged): a claim is an optimisation against
        double work, and a corrupt one must not block an event forever.
        """
        base = self._base(key)
        gens = []
        for k in await self._kv.kv_keys(base):
            tail = k[len(base):]
            if tail.isdigit():
                gens.append(int(tail))
        if not gens:
            return 0, None
        gen = max(gens)
        raw = await self._kv.kv_get(self._gen_key(key, gen))
        if raw is None:  # pruned between list and get: look again next round
            return gen, None
        try:
            record = json.loads(raw.decode("utf-8"))
            if not (isinstance(record, dict) and isinstance(record.get("holder"), str)
                    and record.get("state") in ("held", "done", "released")
                    and isinstance(record.get("expires"), (int, float))):
                raise ValueError("not a claim record")
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("claim %s generation %d is unreadable (%s); treating it as free", key, gen, e)
            return gen, None
        return gen, record

    async def _prune(self, key: str, *, below: int) -> None:
        for gen in range(max(1, below - 3), below):
            await self._kv.kv_del(self._gen_key(key, gen))


def _dump(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, default=str).encode("utf-8")


def _check(key: str, holder: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"claim key {key!r} must be a non-empty string")
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"claim holder {holder!r} must be a non-empty string")
