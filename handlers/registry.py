"""The registry of the event kinds: (source, detail-type) -> the module that parses and plans it.

Each kind's module names what it handles and holds two pure functions:

- ``SOURCE``, ``DETAIL_TYPES``: the EventBridge ``source`` and ``detail-type`` values it parses
  (the registry key, as Karpenter's interruption parser keys on them);
- ``KIND``: the :class:`~resilienced.model.Kind` it produces;
- ``parse(envelope, base, settings) -> Event``: read the kind's ``detail``.  ``base`` is the
  event with its common fields (id, time, account, region...) already validated by
  ``resilienced.intake.pipeline``; ``parse`` returns it with the kind, instance ids, deadline and
  attributes filled in, or raises :class:`~resilienced.errors.InvalidEventError` naming the field;
- ``plan(event, settings) -> Plan``: what must happen to which instances by when.  Whether the
  event is actionable is decided here (a ``pending`` state change is not).

Adding a kind: write the module (open its docstring with a real payload), and add it to
``MODULES`` below.  An event whose (source, detail-type) is not registered is ``unknown``: a
no-op that is acknowledged, not an error.
"""

from __future__ import annotations

from types import ModuleType

from handlers import (
    asg_lifecycle,
    capacity_block_expiry,
    capacity_reservation_interruption,
    rebalance_recommendation,
    scheduled_change,
    spot_interruption,
    state_change,
)
from resilienced.model import Event, Kind, Plan
from resilienced.settings import IntakeSettings

MODULES: tuple[ModuleType, ...] = (
    spot_interruption,
    capacity_reservation_interruption,
    capacity_block_expiry,
    scheduled_change,
    state_change,
    rebalance_recommendation,
    asg_lifecycle,
)

#: (source, detail-type) -> the module that parses and plans it.
REGISTRY: dict[tuple[str, str], ModuleType] = {
    (module.SOURCE, detail_type): module for module in MODULES for detail_type in module.DETAIL_TYPES
}
_BY_KIND: dict[Kind, ModuleType] = {module.KIND: module for module in MODULES}


def lookup(source: str | None, detail_type: str | None) -> ModuleType | None:
    """The handler module for an event, or None when resilienced does not act on it."""
    return REGISTRY.get((source, detail_type))  # type: ignore[arg-type]


def plan(event: Event, settings: IntakeSettings) -> Plan:
    """The plan for any event: its kind's ``plan()``, or not actionable for unknown/invalid."""
    module = _BY_KIND.get(event.kind)
    if module is None:
        return Plan(event=event, actionable=False, reason=event.reason or f"{event.kind.value} event")
    return module.plan(event, settings)
