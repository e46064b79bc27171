"""Ray mode: the daemon's claims kept in the Ray cluster itself.

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
import time
import urllib.parse
from collections.abc import Callable, Mapping

from resilienced.errors import BackendUnavailable
from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.ports import Claim, GcsKv

log = get_logger(__name__)


_PREFIX = "claims/"


class RayKvClaims:
    """``ports.ClaimStore`` on a Ray cluster's GCS internal KV (namespace ``resilienced``).

    The :class:`~resilienced.ports.ClaimStore` contract, as :class:`resilienced.doubles.MemoryClaims`:
    a free or expired claim is taken, the same holder renews, another live holder or a remembered
    ``done`` wins.  Records are JSON
    ``{"holder", "state": "held"|"done"|"released", "expires": unix s, "details"}``.

    Args:
        kv: the cluster's :class:`resilienced.ray.gcs.RayGcs`.
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
                    log.info("claim taken over (expired)", key=key, previous=record["holder"])
                return Claim(key=key, holder=holder, state="held")
        raise BackendUnavailable("ray-gcs", f"claim {key}: lost the race five times in a row")

    async def get(self, key: str) -> Claim | None:
        _check(key, "(reader)")
        _, record = await self._current(key)
        if record is None or record["expires"] <= self._clock() or record["state"] == "released":
            return None
        return Claim(key=key, holder=record["holder"], state=record["state"],
                     details=record.get("details") or {})

    async def complete(self, key: str, *, holder: str, details: Mapping[str, JsonValue]) -> None:
        _check(key, holder)
        gen, record = await self._current(key)
        done = {"holder": holder, "state": "done", "expires": self._clock() + self._done_ttl,
                "details": dict(details)}
        live = record is not None and record["expires"] > self._clock()
        if live and (record["state"] == "done" or record["holder"] != holder):
            return  # done already, or taken over after our TTL ran out: the new holder decides
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

    async def _current(self, key: str) -> tuple[int, dict[str, JsonValue] | None]:
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
            log.warning("claim unreadable; treating it as free", key=key, generation=gen, error=str(e))
            return gen, None
        return gen, record

    async def _prune(self, key: str, *, below: int) -> None:
        for gen in range(max(1, below - 3), below):
            await self._kv.kv_del(self._gen_key(key, gen))


def _dump(record: Mapping[str, JsonValue]) -> bytes:
    return json.dumps(record, sort_keys=True, default=str).encode("utf-8")


def _check(key: str, holder: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"claim key {key!r} must be a non-empty string")
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"claim holder {holder!r} must be a non-empty string")
