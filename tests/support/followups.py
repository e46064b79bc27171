"""In-process follow-up store: :class:`MemoryFollowUps`, a ``ports.FollowUpStore`` for one replica.

A test double (plan mode follows nothing up); the daemon's stores are ``resilienced.kube.followup_store``
(Leases) and ``resilienced.ray.followup_store`` (the GCS KV).  Records are JSON-able dicts, versioned
by a counter: :meth:`put` writes only on the version it was given (compare-and-set).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping

from resilienced.model import JsonValue


class MemoryFollowUps:
    """``ports.FollowUpStore`` in a dict (correct for one process; forgotten on restart)."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[dict[str, JsonValue], int]] = {}

    async def get(self, run: str) -> tuple[dict[str, JsonValue], str] | None:
        entry = self._records.get(run)
        return None if entry is None else (copy.deepcopy(entry[0]), str(entry[1]))

    async def put(self, run: str, record: Mapping[str, JsonValue], *, version: str | None) -> str | None:
        entry = self._records.get(run)
        current = None if entry is None else str(entry[1])
        if current != version:
            return None
        number = (entry[1] if entry is not None else 0) + 1
        self._records[run] = (json.loads(json.dumps(dict(record), default=str)), number)
        return str(number)

    async def all(self) -> list[tuple[dict[str, JsonValue], str]]:
        return [(copy.deepcopy(record), str(number)) for record, number in self._records.values()]

    async def delete(self, run: str, *, version: str) -> bool:
        entry = self._records.get(run)
        if entry is None or str(entry[1]) != version:
            return False
        del self._records[run]
        return True
