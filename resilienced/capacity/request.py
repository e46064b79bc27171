"""What the capacity decision is asked about one run, and where those facts come from.

A :class:`CapacityRequest` is built from the located :class:`~resilienced.model.Target` and the
:class:`~resilienced.model.Event`.  The target carries the facts as a
:class:`~resilienced.model.RunFacts` (``Target.facts``; the locate step fills what it knows;
kubernetes mode reads them from the Node's labels and from the annotations the requeuers leave
on the RayJob/RayCluster, see :data:`ANNOTATION_CAPACITY` ...).  Missing facts have safe
defaults: one instance, unknown AZ, unknown current capacity (treated like Spot), never moved,
unknown remaining time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from resilienced.capacity.decision import KARPENTER_BLOCK_DRAIN, PLACEMENTS, Pool, Selectable
from resilienced.clock import parse_time
from resilienced.model import Capacity, Event, JsonValue, Kind, NodeShape, Target

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
#: ``karpenter.k8s.aws/capacity-reservation-type`` of an On-Demand Capacity Reservation (v1.6+;
#: a Capacity Block is ``capacity-block``).
ODCR_RESERVATION_TYPE = "default"


def capacity_of(capacity_type: str, reservation_type: str | None = None) -> Capacity:
    """A labelled capacity type as a :class:`Capacity` (ValueError when it is none).

    Karpenter's ``reserved`` covers On-Demand Capacity Reservations too: with the reservation type
    ``default`` it is On-Demand capacity held for the account, not a Capacity Block (aws/karpenter-
    provider-aws v1.6+ labels every reserved node with ``karpenter.k8s.aws/capacity-reservation-type``;
    a reserved node without it is read as a block, as before that label existed here).
    """
    if capacity_type == "reserved" and reservation_type == ODCR_RESERVATION_TYPE:
        return Capacity.ON_DEMAND
    return Capacity(_KARPENTER_TO_CAPACITY.get(capacity_type, capacity_type))


@dataclass(frozen=True)
class CapacityRequest:
    """The question put to the capacity decision for one run.

    ``instance_count`` is how many instances must be placed: the whole gang when it moves
    between capacity types; only the lost instances for an elastic run (``Target.facts.elastic``).  ``exclude`` holds reservation ids the run must leave (an expiring
    block).  ``purchase_key`` makes a block purchase idempotent per (event, run).  ``drain_lead``:
    how long before a block's end the run's nodes are drained when that is earlier than EC2's
    30 min (Karpenter's nodes: 40 min).  ``closed``: capacity value -> why the run cannot be
    admitted on it now (Kueue: no matching flavor or no free quota; ``facts.closed_capacity``).
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
    drain_lead: timedelta | None = None
    closed: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, JsonValue] = field(default_factory=dict)

    @classmethod
    def from_target(cls, target: Target, *, event: Event) -> CapacityRequest:
        """The request for ``target``'s run as ``event`` affects it.

        Raises ValueError naming the attribute when the instance type is unknown (the decision
        cannot match reservations without it) or an attribute has the wrong form.
        """
        facts = target.facts
        if not facts.instance_type:
            raise ValueError(f"target {target.run_key}: facts.instance_type is missing; the locate "
                             "step must say the run's instance type")
        current = None
        if facts.capacity_type is not None:
            try:
                current = capacity_of(str(facts.capacity_type), facts.reservation_type)
            except ValueError:
                raise ValueError(f"target {target.run_key}: facts.capacity_type={facts.capacity_type!r} "
                                 "is not a capacity type") from None
        moved = facts.moved_at
        if moved is not None and not isinstance(moved, datetime):
            try:
                moved = parse_time(str(moved))
            except ValueError:
                raise ValueError(f"target {target.run_key}: facts.moved_at={moved!r} "
                                 "is not an ISO-8601 time") from None
        lost = tuple(facts.lost_instance_ids or (target.instance_id,))
        # An elastic run keeps its survivors: only the lost workers need capacity.
        count: object = len(lost) if facts.elastic is True or facts.instance_count is None else facts.instance_count
        try:
            count = int(count)
        except (TypeError, ValueError):
            raise ValueError(f"target {target.run_key}: facts.instance_count="
                             f"{count!r} is not a whole number") from None
        needs = facts.run_needs_seconds
        run_needs = timedelta(seconds=float(needs)) if needs is not None else None
        selectable = None
        if facts.selectable_reservations is not None:
            selectable = Selectable(ids=frozenset(map(str, facts.selectable_reservations)),
                                    sources=tuple(map(str, facts.selectable_from)))
        exclude: set[str] = set(map(str, facts.exclude))  # stalled capacity in its cool-down
        if event.kind is Kind.CAPACITY_BLOCK_EXPIRY and event.capacity_reservation_id:
            exclude.add(event.capacity_reservation_id)  # move off the expiring block
        closed = {str(capacity): str(why) for capacity, why in facts.closed_capacity}
        for capacity in closed:
            if capacity not in {c.value for c in PLACEMENTS}:
                raise ValueError(f"target {target.run_key}: facts.closed_capacity names {capacity!r}, "
                                 "not a capacity that places a run")
        return cls(
            pool=Pool(str(facts.instance_type), facts.availability_zone or None),
            instance_count=max(count, 1),
            run_key=target.run_key,
            current_capacity=current,
            # an ODCR's id is no block to stay on
            current_reservation_id=(facts.reservation_id or None) if current is Capacity.CAPACITY_BLOCK else None,
            last_move=moved,
            run_needs=run_needs,
            exclude=frozenset(exclude),
            lost_instance_ids=lost,
            purchase_key=f"{event.event_id or 'event'}/{target.run_key}"[:256],
            selectable=selectable,
            # Karpenter drains a block's nodes before EC2 would: the run leaves it by then
            drain_lead=KARPENTER_BLOCK_DRAIN if facts.node_shape == NodeShape.KARPENTER.value else None,
            closed=closed,
        )
