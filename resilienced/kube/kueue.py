"""Pure rules: on which capacities Kueue can admit a run now, read from its queue objects.

Kueue admits a Workload on a flavor only when the ClusterQueue has the quota for it; otherwise the
Workload stays pending (``QuotaReserved`` false, "insufficient unused quota for <resource> in
flavor <f>, <n> more needed") and the job stays suspended (kubernetes-sigs/kueue v0.19.2
``pkg/scheduler/flavorassigner/flavorassigner.go`` ``fitsResourceQuota``: the flavor's
``Available`` quota, ``pkg/cache/scheduler/clusterqueue_snapshot.go``).  Steering a run into a
flavor whose quota is short therefore leaves it suspended while the requeue reports success.  So
before the capacity decision, the locate step asks, for each capacity (``spot`` |
``capacity-block`` | ``on-demand``), whether the run's ClusterQueue could admit it there:

* the ClusterQueue: the run's ``kueue.x-k8s.io/queue-name`` label -> its LocalQueue in the run's
  namespace -> ``spec.clusterQueue`` (``apis/kueue/v1beta2`` ``localqueue_types.go``);
* per resource group of ``spec.resourceGroups`` that covers a resource the run's workers ask for,
  the flavors whose ResourceFlavor ``spec.nodeLabels`` do not contradict the selector of that
  capacity on the flavor's own keys (``flavorSelector``: only the flavor's label keys count);
  none: Kueue would answer ``NoMatchingFlavor``; the capacity is closed;
* one of them must have, for every covered resource, ``nominalQuota`` - the reserved total in
  ``status.flavorsReservation`` >= what the run's workers ask for.  The run's own reservation is
  counted as free on the flavors of the capacity it is on while it runs (the eviction releases
  it).  In a cohort (``spec.cohortName``; ``spec.cohort`` in v1beta1) a flavor may borrow up to its
  ``borrowingLimit`` (no limit: the check cannot tell and does not close it); whether the cohort
  has that much unused is not read.  Preemption of lower-priority work is not counted either.

What the check cannot see (a cohort's unused quota, preemption, admission checks, a quota taken
between the check and the requeue) is left to the follow-up after the requeue, which sees a
Workload that stays pending.  The run's workers ask for: per worker group, ``replicas`` x
``numOfHosts`` pods, each the sum of its containers' requests (a limit stands for a missing
request, as the API server defaults it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal, InvalidOperation

from resilienced.model import JsonValue

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: object) -> Decimal:
    """A Kubernetes quantity (``64``, ``16Ti``, ``500m``, ``1e3``) as a number; ValueError otherwise."""
    text = str(value).strip()
    try:
        return Decimal(text)  # plain numbers and exponents
    except InvalidOperation:
        pass
    match = _QUANTITY.match(text)
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    try:
        return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2)])
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None


def _fmt(amount: Decimal) -> str:
    return format(amount.normalize(), "f")


def worker_needs(groups: Iterable[Mapping[str, JsonValue]]) -> dict[str, Decimal]:
    """What a run's worker groups ask for in all: resource -> amount."""
    needs: dict[str, Decimal] = {}
    for group in groups:
        pods = int(group.get("replicas") or 0) * max(int(group.get("numOfHosts") or 1), 1)
        for container in ((group.get("template") or {}).get("spec") or {}).get("containers") or []:
            resources = container.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for name, value in asked.items():
                needs[name] = needs.get(name, Decimal(0)) + quantity(value) * pods
    return {name: amount for name, amount in needs.items() if amount > 0}


def _fits(flavor_labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """``flavorSelector``: the selector must not contradict the flavor on the flavor's own keys."""
    return all(selector.get(key, value) == value for key, value in flavor_labels.items())


def _quotas(clusterqueue: Mapping[str, JsonValue]) -> dict[tuple[str, str], Mapping[str, JsonValue]]:
    return {(f.get("name", ""), r.get("name", "")): r
            for group in (clusterqueue.get("spec") or {}).get("resourceGroups") or []
            for f in group.get("flavors") or [] for r in f.get("resources") or []}


def _reserved(clusterqueue: Mapping[str, JsonValue]) -> dict[tuple[str, str], Decimal]:
    return {(f.get("name", ""), r.get("name", "")): quantity(r.get("total") or 0)
            for f in (clusterqueue.get("status") or {}).get("flavorsReservation") or []
            for r in f.get("resources") or []}


class QueueCheck:
    """One ClusterQueue's answer for one run (see the module docstring).

    Args:
        clusterqueue: the ClusterQueue object.
        flavor_labels: ResourceFlavor name -> its ``spec.nodeLabels`` (None: no such flavor).
        needs: what the run's workers ask for (:func:`worker_needs`).
        own_selector: the selector of the capacity the run is on while it holds quota (its
            reservation there is released by the eviction); None: it holds none.
    """

    def __init__(self, clusterqueue: Mapping[str, JsonValue], *, flavor_labels: Callable[[str], Mapping[str, str] | None],
                 needs: Mapping[str, Decimal], own_selector: Mapping[str, str] | None) -> None:
        self.name = str((clusterqueue.get("metadata") or {}).get("name") or "?")
        self.groups = (clusterqueue.get("spec") or {}).get("resourceGroups") or []
        spec = clusterqueue.get("spec") or {}
        self.cohort = spec.get("cohortName") or spec.get("cohort")
        self.quotas = _quotas(clusterqueue)
        self.reserved = _reserved(clusterqueue)
        self.flavor_labels = flavor_labels
        self.needs = dict(needs)
        self.own_selector = own_selector

    def why_not(self, selector: Mapping[str, str]) -> str | None:
        """Why the run cannot be admitted with ``selector`` (None: a flavor has the quota)."""
        for group in self.groups:
            covered = [r for r in group.get("coveredResources") or [] if r in self.needs]
            if not covered:
                continue
            flavors = [f.get("name", "") for f in group.get("flavors") or []]
            matching = [f for f in flavors
                        if self.flavor_labels(f) is not None and _fits(self.flavor_labels(f) or {}, selector)]
            if not matching:
                return (f"Kueue ClusterQueue {self.name} has no flavor for {', '.join(covered)} whose nodeLabels "
                        f"match {_describe(selector)} (flavors {', '.join(flavors) or 'none'})")
            short = [self._short(f, covered) for f in matching]
            if all(short):
                return f"Kueue ClusterQueue {self.name} has too little free quota: {'; '.join(s for s in short if s)}"
        return None

    def _short(self, flavor: str, resources: Sequence[str]) -> str | None:
        own = self.own_selector is not None and _fits(self.flavor_labels(flavor) or {}, self.own_selector)
        for resource in resources:
            quota = self.quotas.get((flavor, resource))
            nominal = quantity(quota.get("nominalQuota") or 0) if quota else Decimal(0)
            borrowing = (quota or {}).get("borrowingLimit")
            if self.cohort and borrowing is None:
                continue  # may borrow without limit from its cohort: not for this check to say
            free = nominal - self.reserved.get((flavor, resource), Decimal(0))
            free += self.needs[resource] if own else 0
            free += quantity(borrowing) if self.cohort and borrowing is not None else 0
            if free < self.needs[resource]:
                return (f"flavor {flavor} has {_fmt(max(free, Decimal(0)))} {resource} free of {_fmt(nominal)}, "
                        f"the run needs {_fmt(self.needs[resource])}")
        return None


def _describe(selector: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))


def closed_capacities(check: QueueCheck, selectors: Mapping[str, Mapping[str, str]]) -> tuple[tuple[str, str], ...]:
    """``((capacity, why), ...)`` for each capacity of ``selectors`` Kueue cannot admit the run on."""
    out = []
    for capacity, selector in selectors.items():
        why = check.why_not(selector)
        if why is not None:
            out.append((capacity, why))
    return tuple(out)
