"""What the capacity decision is asked about one run, and where those facts come from.

A :class:`CapacityRequest` is built from the located :class:`~resilienced.model.Target` and the
:class:`~resilienced.model.Event`.  The target carries the facts in ``Target.attributes`` under
the keys below (the locate step fills what it knows; kubernetes mode reads them from the Node's
labels and from the annotations the requeuers leave on the RayJob/RayCluster, see
:data:`ANNOTATION_CAPACITY` ...).  Missing facts have safe defaults: one instance, unknown AZ,
unknown current capacity (treated like Spot), never moved, unknown remaining time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from resilienced.capacity.decision import Capacity, Pool, Selectable
from resilienced.model import Event, Kind, Target

# ---- Target.attributes keys (all optional; str values unless said otherwise)
ATTR_INSTANCE_TYPE = "instance_type"  # e.g. "p5.48xlarge" (Node label node.kubernetes.io/instance-type)
ATTR_AVAILABILITY_ZONE = "availability_zone"  # e.g. "us-east-1a" (topology.kubernetes.io/zone)
ATTR_CAPACITY_TYPE = "capacity_type"  # "spot" | "capacity-block" | "on-demand" (karpenter.sh/capacity-type, reserved -> capacity-block)
ATTR_RESERVATION_ID = "reservation_id"  # the block the run is on (karpenter.k8s.aws/capacity-reservation-id)
ATTR_MOVED_AT = "capacity_moved_at"  # ISO-8601 time of the run's last move (annotation below)
ATTR_INSTANCE_COUNT = "instance_count"  # int: instances the whole run (gang) uses
ATTR_LOST_INSTANCE_IDS = "lost_instance_ids"  # list of the run's instance ids this event takes away
ATTR_RUN_NEEDS_SECONDS = "run_needs_seconds"  # float: how much longer the run needs capacity
ATTR_VOLCANO_JOB = "volcano_job"  # "namespace/name" of a batch.volcano.sh Job running the run
ATTR_ELASTIC = "elastic"  # bool: the run continues at a smaller size (annotation resilienced.io/elastic)
ATTR_ELASTIC_FALLBACK = "elastic_fallback"  # str: why an elastic run is nevertheless requeued as a gang
ATTR_ELASTIC_ERROR = "elastic_error"  # str: the resilienced.io/elastic annotation is malformed (named)
# Only where the cluster serves EC2NodeClasses (absent: any block of the account will do):
ATTR_SELECTABLE = "selectable_reservations"  # list of cr- ids Karpenter can launch the run into
ATTR_SELECTABLE_FROM = "selectable_from"  # list of "nodepool/ec2nodeclass" those ids were read from
# the last requeue resilienced applied to the run (from its annotations below): the event it was
# for, the capacity and the block; a delivery that takes the same event over keeps it
ATTR_REQUEUED_FOR = "requeued_for"
ATTR_REQUEUED_CAPACITY = "requeued_capacity"
ATTR_REQUEUED_RESERVATION = "requeued_reservation_id"

# ---- annotations the Kubernetes requeuers write on the RayJob / RayCluster / Volcano Job
ANNOTATION_CAPACITY = "resilienced.io/capacity-type"
ANNOTATION_RESERVATION = "resilienced.io/capacity-reservation-id"
ANNOTATION_MOVED_AT = "resilienced.io/capacity-moved-at"
ANNOTATION_REQUEUED_FOR = "resilienced.io/requeued-for"  # "<event id>" of the last requeue applied
# ---- read from the RayJob / RayCluster (written by the user)
ANNOTATION_ELASTIC = "resilienced.io/elastic"  # "true": requeue only the lost workers (docs/requeue.md)
# ---- written by the elastic requeue on the RayCluster: {lost instance id: worker group replacing it}
ANNOTATION_ELASTIC_REPLACED = "resilienced.io/elastic-replaced"

_KARPENTER_TO_CAPACITY = {"spot": "spot", "reserved": "capacity-block", "on-demand": "on-demand"}


@dataclass(frozen=True)
class CapacityRequest:
    """The question put to the capacity decision for one run.

    ``instance_count`` is how many instances must be placed: the whole gang when it moves
    between capacity types; only the lost instances for an elastic run (``attributes["elastic"]``).  ``exclude`` holds reservation ids the run must leave (an expiring
    block).  ``purchase_key`` makes a block purchase idempotent per (event, run).
    """

    pool: Pool
    instance_count: int
    run_key: str
    current_capacity: Capacity | None = None
    current_reservation_id: str | None = None
    last_move: datetime | None = None
    run_needs: timedelta | None = None
    exclude: frozenset[str] = frozenset()
    lost_instance_ids: tuple[str, ...] = ()
    purchase_key: str | None = None
    selectable: Selectable | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_target(cls, target: Target, *, event: Event) -> CapacityRequest:
        """The request for ``target``'s run as ``event`` affects it.

        Raises ValueError naming the attribute when the instance type is unknown (the decision
        cannot match reservations without it) or an attribute has the wrong form.
        """
        attrs = target.attributes
        instance_type = attrs.get(ATTR_INSTANCE_TYPE)
        if not instance_type:
            raise ValueError(f"target {target.run_key}: attributes[{ATTR_INSTANCE_TYPE!r}] is "
                             "missing; the locate step must say the run's instance type")
        current = attrs.get(ATTR_CAPACITY_TYPE)
        if current is not None:
            current = _KARPENTER_TO_CAPACITY.get(str(current), str(current))
            try:
                current = Capacity(current)
            except ValueError:
                raise ValueError(f"target {target.run_key}: attributes[{ATTR_CAPACITY_TYPE!r}]="
                                 f"{attrs.get(ATTR_CAPACITY_TYPE)!r} is not a capacity type") from None
        moved = attrs.get(ATTR_MOVED_AT)
        if moved is not None and not isinstance(moved, datetime):
            try:
                moved = datetime.fromisoformat(str(moved).replace("Z", "+00:00"))
            except ValueError:
                raise ValueError(f"target {target.run_key}: attributes[{ATTR_MOVED_AT!r}]={moved!r} "
                                 "is not an ISO-8601 time") from None
        lost = tuple(attrs.get(ATTR_LOST_INSTANCE_IDS) or (target.instance_id,))
        # An elastic run keeps its survivors: only the lost workers need capacity.
        count = len(lost) if attrs.get(ATTR_ELASTIC) is True else attrs.get(ATTR_INSTANCE_COUNT, len(lost))
        try:
            count = int(count)
        except (TypeError, ValueError):
            raise ValueError(f"target {target.run_key}: attributes[{ATTR_INSTANCE_COUNT!r}]="
                             f"{count!r} is not a whole number") from None
        needs = attrs.get(ATTR_RUN_NEEDS_SECONDS)
        run_needs = timedelta(seconds=float(needs)) if needs is not None else None
        selectable = None
        if attrs.get(ATTR_SELECTABLE) is not None:
            selectable = Selectable(ids=frozenset(map(str, attrs[ATTR_SELECTABLE])),
                                    sources=tuple(map(str, attrs.get(ATTR_SELECTABLE_FROM) or ())))
        exclude: set[str] = set()
        if event.kind is Kind.CAPACITY_BLOCK_EXPIRY and event.capacity_reservation_id:
            exclude.add(event.capacity_reservation_id)  # move off the expiring block
        return cls(
            pool=Pool(str(instance_type), attrs.get(ATTR_AVAILABILITY_ZONE) or None),
            instance_count=max(count, 1),
            run_key=target.run_key,
            current_capacity=current,
            current_reservation_id=attrs.get(ATTR_RESERVATION_ID) or None,
            last_move=moved,
            run_needs=run_needs,
            exclude=frozenset(exclude),
            lost_instance_ids=lost,
            purchase_key=f"{event.event_id or 'event'}/{target.run_key}"[:256],
            selectable=selectable,
        )
