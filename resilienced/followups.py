"""In-process follow-up store: :class:`MemoryFollowUps`, a ``ports.FollowUpStore`` for one replica.

Plan mode and unit tests use it; the cross-replica stores are ``resilienced.kube.followups``
(Leases) and ``resilienced.ray.followups`` (the GCS KV).  Records are JSON-able dicts, versioned
by a counter: :meth:`put` writes only on the version it was given (compare-and-set).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any


class MemoryFollowUps:
    """``ports.FollowUpStore`` in a dict (correct for one process; forgotten on restart)."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[dict[str, Any], int]] = {}

    async def get(self, run: str) -> tuple[dict[str, Any], str] | None:
        entry = self._records.get(run)
        return None if entry is None else (copy.deepcopy(entry[0]), str(entry[1]))

    async def put(self, run: str, record: Mapping[str, Any], *, version: str | None) -> str | None:
        entry = self._records.get(run)
        current = None if entry is None else str(entry[1])
        if current != version:
            return None
        number = (entry[1] if entry is not None else 0) + 1
        self._records[run] = (json.loads(json.dumps(dict(record), default=str)), number)
        return str(number)

    async def all(self) -> list[tuple[dict[str, Any], str]]:
        return [(copy.deepcopy(record), str(number)) for record, number in self._records.values()]

    async def delete(self, run: str, *, version: str) -> bool:
        entry = self._records.get(run)
        if entry is None or str(entry[1]) != version:
            return False
        del self._records[run]
        return True
