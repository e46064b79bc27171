"""Ray mode: each run's follow-up (``resilienced.followup.rules.FollowUp``) in the Ray cluster's GCS KV.

One key per run, ``followups/<quoted run>`` in the namespace ``resilienced`` (next to the run
claims of ``resilienced.ray.claims``), holding ``{"version": N, "record": {...}}``.  The GCS KV
has no compare-and-set: a create is an atomic put-if-absent, an update reads the version, checks
it and writes ``N + 1``.  Updates are made only under the run's move claim (one writer at a
time, ``resilienced.followup.follower``), so the read-check-write is not raced; the version check
still turns a late writer whose claim lapsed into a no-op when another wrote first.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping

from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.ports import GcsKv

log = get_logger("resilienced.ray.followups")  # the name its log lines have always carried

PREFIX = "followups/"


def _key(run: str) -> str:
    return PREFIX + urllib.parse.quote(run, safe="")


class RayKvFollowUps:
    """``ports.FollowUpStore`` on a Ray cluster's GCS internal KV."""

    def __init__(self, *, kv: GcsKv) -> None:
        self._kv = kv

    async def _read(self, key: str) -> tuple[dict[str, JsonValue], int] | None:
        raw = await self._kv.kv_get(key)
        if raw is None:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
            return dict(data["record"]), int(data["version"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            log.warning("follow-up record unreadable", key=key, error=str(e))
            return None

    async def get(self, run: str) -> tuple[dict[str, JsonValue], str] | None:
        found = await self._read(_key(run))
        return None if found is None else (found[0], str(found[1]))

    async def put(self, run: str, record: Mapping[str, JsonValue], *, version: str | None) -> str | None:
        key = _key(run)

        def dump(number: int) -> bytes:
            return json.dumps({"version": number, "record": dict(record)}, sort_keys=True, default=str).encode()

        if version is None:
            return "1" if await self._kv.kv_put_if_absent(key, dump(1)) else None
        current = await self._read(key)
        if current is None or str(current[1]) != version:
            return None
        await self._kv.kv_put(key, dump(current[1] + 1))
        return str(current[1] + 1)

    async def all(self) -> list[tuple[dict[str, JsonValue], str]]:
        out = []
        for key in sorted(await self._kv.kv_keys(PREFIX)):
            found = await self._read(key)
            if found is not None:
                out.append((found[0], str(found[1])))
        return out

    async def delete(self, run: str, *, version: str) -> bool:
        current = await self._read(_key(run))
        if current is None or str(current[1]) != version:
            return False
        return await self._kv.kv_del(_key(run))
