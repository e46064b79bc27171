"""The GCS of each RayCluster: its client (with the cluster's Ray token) and its Ray node list.

A cluster's node list is cached for ``gcs_ttl_s`` and shared by concurrent callers (one call in
flight per RayCluster, uid and address), so a burst of 500 notices costs about one GCS call per
cluster.  A GCS that refuses the token has it read again, once (the Secret may have been
regenerated); a second refusal is a RayAuthError that says which auth mode was refused.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from functools import partial

from resilienced.errors import BackendUnavailable, PermanentError, RayAuthError
from resilienced.kube.api import JsonObj
from resilienced.kube.cluster_caches import ClusterCaches
from resilienced.kube.locate import gcs_address, is_head, is_ray_pod, name_of, namespace_of, uid_of
from resilienced.kube.tokens import RayTokens, auth_mode
from resilienced.model import Target
from resilienced.ports import RayControl, RayNode

RayControlFactory = Callable[[str, str | None], RayControl]


class GcsNodes:
    """The GCS clients of the cluster's RayClusters and their cached node lists.

    ``factory(address, token)`` builds the GCS client of one Ray cluster
    (``resilienced.ray.gcs.RayGcs`` in production); ``tokens`` finds each cluster's token.
    """

    def __init__(
        self,
        caches: ClusterCaches,
        *,
        factory: RayControlFactory,
        tokens: RayTokens,
        clock: Callable[[], float],
        gcs_timeout_s: float,
        gcs_ttl_s: float,
    ) -> None:
        self._caches = caches
        self._factory = factory
        self.tokens = tokens
        self._clock = clock
        self._gcs_timeout_s = gcs_timeout_s
        self._gcs_ttl_s = gcs_ttl_s
        self._gcs: dict[tuple[str, str, str], tuple[float, list[RayNode]]] = {}
        self._inflight: dict[tuple[str, str, str], asyncio.Task[list[RayNode]]] = {}
        self._controls: dict[tuple[str, str | None], RayControl] = {}

    async def close(self) -> None:
        """Cancel GCS calls in flight and close the GCS clients (idempotent)."""
        for task in list(self._inflight.values()):
            task.cancel()
        for task in list(self._inflight.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody waits for it now
                pass
        self._inflight.clear()
        controls, self._controls = list(self._controls.values()), {}
        for control in controls:
            await _close(control)

    def _control(self, address: str, token: str | None) -> RayControl:
        control = self._controls.get((address, token))
        if control is None:
            control = self._factory(address, token)
            self._controls[(address, token)] = control
        return control

    async def ray_control(self, target: Target) -> RayControl:
        """The GCS client for a target's RayCluster (for the signal step), with its token."""
        ns, _, name = (target.ray_cluster or "").partition("/")
        raycluster = self._caches.rayclusters.get(ns, name)
        if raycluster is None and target.facts.volcano_job and target.ray_address:
            return self._control(target.ray_address, None)  # Ray inside a Volcano Job: no KubeRay auth
        if raycluster is None:
            raise PermanentError(f"RayCluster {target.ray_cluster} is not known")
        head = next((p for p in self._caches.pods.by_index("cluster", f"{ns}/{name}")
                     if is_head(p) and is_ray_pod(p)), None)
        address = target.ray_address or gcs_address(raycluster, head)
        return self._control(address, await self.tokens.token_for(raycluster))

    async def nodes(self, raycluster: JsonObj, address: str) -> list[RayNode]:
        key = (f"{namespace_of(raycluster)}/{name_of(raycluster)}", uid_of(raycluster), address)
        cached = self._gcs.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._fetch_nodes(raycluster, address), name=f"resilienced.kube.gcs[{key[0]}]")
            self._inflight[key] = task
            task.add_done_callback(partial(self._fetched, key))
        return await asyncio.shield(task)

    def _fetched(self, key: tuple[str, str, str], task: asyncio.Task[list[RayNode]]) -> None:
        self._inflight.pop(key, None)
        if task.cancelled() or task.exception() is not None:  # exception() also marks it retrieved
            return
        now = self._clock()
        for old in [k for k, (expires, _) in self._gcs.items() if expires <= now]:
            del self._gcs[old]  # clusters gone or quiet: keep the map small
        self._gcs[key] = (now + self._gcs_ttl_s, task.result())

    async def _fetch_nodes(self, raycluster: JsonObj, address: str) -> list[RayNode]:
        where = f"RayCluster {namespace_of(raycluster)}/{name_of(raycluster)}"
        mode = auth_mode(raycluster)
        for attempt in (1, 2):
            token = await self.tokens.token_for(raycluster)
            control = self._control(address, token)
            try:
                async with asyncio.timeout(self._gcs_timeout_s):
                    return list(await control.nodes())
            except TimeoutError:
                raise BackendUnavailable("ray", f"{where}: the GCS at {address} did not answer within "
                                                f"{self._gcs_timeout_s:g}s") from None
            except RayAuthError as err:
                # The token may have been rotated (Secret regenerated): read it again, once.
                self.tokens.forget(raycluster)
                stale = self._controls.pop((address, token), None)
                if stale is not None:
                    await _close(stale)
                if attempt == 2 or mode == "none":
                    hint = {
                        "none": "the RayCluster has no authOptions.mode=token, but its GCS wants a token",
                        "secret": "the token from its auth Secret was refused",
                        "kubernetes": "the daemon's ServiceAccount token was refused "
                                      "(does it have ray:write on the RayCluster?)",
                    }[mode]
                    raise RayAuthError(f"{where}: {hint}: {err}") from err
        raise AssertionError("unreachable")


async def _close(control: object) -> None:
    closer = getattr(control, "close", None) or getattr(control, "aclose", None)
    if closer is None:
        return
    result = closer()
    if inspect.isawaitable(result):
        await result
