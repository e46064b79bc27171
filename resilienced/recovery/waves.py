"""A run's notices in flight in this replica, handled as one (issue #45).

Spot reclaims pools, not instances: a gang's notices (one per instance) come together.  The first
notice of a run this replica handles *leads* the run's wave: its steps run as they always did
(under the run claim ``run/<event id>/<run>``, the run's move claim, one Event per step on the
run).  A notice of the same run that comes while the wave is under way *joins* it: it cordons and
drains its own instances (both idempotent), adds them to the run's lost instances while the wave
has not begun to move the run, and shares the wave's outcome (done, retry, failed); it writes no
claim and no Event of its own, and the consumer takes no event claim for it
(``Recovery.needs_event_claim``).  A notice that joins after the move began shares the outcome
where the move took the whole gang (kubernetes mode, a run that is not elastic); otherwise it is
looked at again once the wave ended (its instances were not in the move).

A wave is *reserved* as soon as the consumer asks whether a notice needs an event claim
(``Recovery.needs_event_claim``, before it takes the claim): a gang's notices come in one receive
and are dispatched at once, so without the reservation every one of them found no wave yet and took
an event claim of its own (seen on the real control plane, tests/cluster/test_mass.py: 6 event
claims for 3 runs' 6 notices).  The reserving notice leads it once its event claim is held; one
that does not lead it (its event claim was another delivery's, or its act found its run gone)
drops it (:meth:`Waves.unreserve`), and whoever had joined is sent back to the queue.

The wave is this replica's alone (memory): across replicas the run claims and the move claim decide
as before.  :class:`Waves` holds the waves in flight; :class:`Wave` is one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from resilienced.errors import TemporaryError
from resilienced.model import Step, Target
from resilienced.recovery.targets import merged

R = TypeVar("R")

#: Steps a joining notice never shares: a terminate hook is completed for its own event.
OWN_STEPS = frozenset({Step.COMPLETE_LIFECYCLE})


@dataclass(eq=False)
class Wave(Generic[R]):
    """One run handled as one in this replica: the leader's event, the notices that joined it."""

    run: str
    event_id: str | None
    steps: frozenset[Step]
    events: set[str] = field(default_factory=set)  # the leader's event and those that joined
    joined: list[Target] = field(default_factory=list)  # joiners' targets, before the move began
    moving: bool = False  # the move began: a later joiner's instances are not in it
    led: bool = False  # its leader's handling began (a reserved wave's has not yet)
    ended: asyncio.Future[R] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def covers(self, steps: Iterable[Step]) -> bool:
        """Whether the wave does every step a notice with ``steps`` asks (its own apart)."""
        return set(steps) - OWN_STEPS <= self.steps

    def join(self, target: Target) -> bool:
        """Add a joiner's instances to the run's move; False once the move began."""
        if self.moving:
            return False
        self.joined.append(target)
        return True

    def begin_move(self, target: Target) -> Target:
        """The leader's ``target`` with the joiners' instances, lost instances and Ray nodes; no
        joiner is added after this."""
        self.moving = True
        return merged(target, self.joined)

    def finish(self, outcome: R) -> None:
        if not self.ended.done():
            self.ended.set_result(outcome)

    def fail(self, error: BaseException) -> None:
        if not self.ended.done():
            if isinstance(error, asyncio.CancelledError):  # the leader was stopped: its joiners retry
                error = TemporaryError(f"the handling of run {self.run} (event {self.event_id}) was stopped")
            self.ended.set_exception(error)
            self.ended.exception()  # retrieved: no joiner may be waiting


class Waves(Generic[R]):
    """The runs this replica handles now, by run key (see the module docstring)."""

    def __init__(self) -> None:
        self._by_run: dict[str, Wave[R]] = {}

    def current(self, run: str) -> Wave[R] | None:
        return self._by_run.get(run)

    def __len__(self) -> int:
        return len(self._by_run)

    def reserve(self, run: str, *, event_id: str, steps: Iterable[Step]) -> Wave[R] | None:
        """A wave of ``run`` that the notice of ``event_id`` leads once its event claim is held;
        notices of the run that come meanwhile join it.  None when the run has a wave already."""
        if run in self._by_run:
            return None
        wave: Wave[R] = Wave(run=run, event_id=event_id, steps=frozenset(steps) - OWN_STEPS, events={event_id})
        self._by_run[run] = wave
        return wave

    def reserved_for(self, run: str, event_id: str | None) -> bool:
        """Whether ``run``'s wave is reserved for the notice of ``event_id`` and not led yet."""
        wave = self._by_run.get(run)
        return wave is not None and event_id is not None and wave.event_id == event_id and not wave.led

    def unreserve(self, event_id: str) -> None:
        """Drop the waves reserved for ``event_id`` that it did not lead; their joiners are retried."""
        for run, wave in list(self._by_run.items()):
            if wave.event_id == event_id and not wave.led:
                del self._by_run[run]
                wave.fail(TemporaryError(f"the notice of event {event_id} did not lead the handling of run {run} "
                                         "(its event claim was another delivery's, or the run was gone)", delay=1.0))

    @contextlib.asynccontextmanager
    async def lead(self, run: str, *, event_id: str | None, steps: Iterable[Step]) -> AsyncIterator[Wave[R]]:
        """The wave of ``run`` for the block (the one reserved for ``event_id``, else a new one);
        ended with the block's error when it raises (the leader calls :meth:`Wave.finish` with its
        outcome), and forgotten after it."""
        wave = self._by_run.get(run)
        if wave is not None and not self.reserved_for(run, event_id):
            raise RuntimeError(f"run {run} has a wave in flight already")
        if wave is None:
            wave = Wave(run=run, event_id=event_id, steps=frozenset(steps) - OWN_STEPS,
                        events={event_id} if event_id else set())
            self._by_run[run] = wave
        wave.led = True
        try:
            yield wave
        except BaseException as e:
            wave.fail(e)
            raise
        finally:
            del self._by_run[run]
            wave.fail(TemporaryError(f"the handling of run {run} (event {event_id}) ended without an outcome"))
