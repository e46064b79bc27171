"""What kubernetes mode leaves on the cluster's objects: the Node's taint (cordon) and Events.

``cordon`` taints the Node ``resilienced.io/interruption=<reason>:NoSchedule`` with the notice's
deadline in an annotation; ``record`` leaves an Event on the run's object (the Volcano Job, else the
RayJob, else the RayCluster) through :class:`~resilienced.kube.events.EventRecorder`, its message
naming the run's instances and their Nodes; only a target without a run object gets it on its Node.
Until issue #45 each Event went on the Node too: one write more per Event, and a gang's Nodes are
marked by their taint and deadline annotation already.
"""

from __future__ import annotations

from datetime import datetime, timezone

from kubernetes_asyncio import client as k8s

from resilienced.errors import BackendUnavailable
from resilienced.kube.api import BACKEND, JsonObj, KubeStatusError, call
from resilienced.kube.cluster_caches import VOLCANO_JOBS, ClusterCaches
from resilienced.kube.events import EventRecorder, ObjectRef, ref_for
from resilienced.kube.locate import VOLCANO_JOB_API_VERSION, name_of, taint_value
from resilienced.log import get as get_logger
from resilienced.model import JsonValue, Target
from resilienced.ports import CordonClaimResult

# the logger these lines had before KubeCluster was split (log lines are a contract)
log = get_logger("resilienced.kube.cluster")

TAINT_KEY = "resilienced.io/interruption"
DEADLINE_ANNOTATION = "resilienced.io/interruption-deadline"
#: The event a cordon decided, where it stood for the event claim of a notice that hit no run
#: (``ports.CordonClaims``); a cordon made otherwise has none.
EVENT_ANNOTATION = "resilienced.io/interruption-event"


def _cordoned(node: JsonObj) -> bool:
    return any(t.get("key") == TAINT_KEY and t.get("effect") == "NoSchedule"
               for t in (node.get("spec") or {}).get("taints") or [])


def _decided_by(node: JsonObj) -> str | None:
    return _notes(node).get(EVENT_ANNOTATION)


def _notes(node: JsonObj) -> dict[str, str]:
    return dict((node.get("metadata") or {}).get("annotations") or {})


class Marks:
    """Cordon and Events for targets of the cluster whose ``caches`` it reads."""

    def __init__(
        self,
        caches: ClusterCaches,
        *,
        core: k8s.CoreV1Api,
        events: EventRecorder,
        request_timeout_s: float,
        conflict_retries: int,
    ) -> None:
        self._caches = caches
        self._core = core
        self.events = events
        self._request_timeout_s = request_timeout_s
        self._conflict_retries = conflict_retries

    async def _read_node(self, name: str) -> JsonObj | None:
        try:
            return await call(verb="get", resource="nodes", request=self._core.read_node(
                name, _preload_content=False, _request_timeout=self._request_timeout_s))
        except KubeStatusError as err:
            if err.status == 404:
                return None
            raise

    def _node_of(self, instance: str | None) -> str | None:
        """The name of the Node of ``instance`` in the Node cache (None: none there)."""
        found = self._caches.nodes.by_index("instance", instance) if instance else []
        return (name_of(found[0]) or None) if found else None

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> bool:
        """Taint the Node ``resilienced.io/interruption=<reason>:NoSchedule`` (once; patch, not replace).

        Node taints have no strategic-merge key, so the patch carries the whole list, guarded by
        the resourceVersion it was read at; a 409 re-reads the Node and tries again.  A target
        without a Node name (an instance whose Node runs no Ray pod any more: a notice that came
        after its run was moved, issue #45) is the Node of its instance, if the cache has one.
        Whether the Node carries resilienced's cordon now (False: no Node, or gone).
        """
        name = target.node or self._node_of(target.instance_id)
        if name is None:
            return False
        return await self._cordon(name, reason=reason, deadline=deadline, event_id=None) != "gone"

    def cordon_claimable(self, instance_id: str, *, event_id: str) -> bool:
        """``ports.CordonClaims``: the instance's Node is in the cache, without resilienced's cordon
        or with the one that decided ``event_id``."""
        name = self._node_of(instance_id)
        node = self._caches.nodes.get(None, name) if name else None
        return node is not None and (not _cordoned(node) or _decided_by(node) == event_id)

    async def cordon_claim(self, instance_id: str, *, event_id: str, reason: str,
                           deadline: datetime | None) -> CordonClaimResult:
        """``ports.CordonClaims``: the cordon of :meth:`cordon`, naming ``event_id`` in the Node's
        ``resilienced.io/interruption-event`` annotation, made only where no cordon of
        resilienced is (the resourceVersion guard: of two deliveries of the event one makes it)."""
        name = self._node_of(instance_id)
        if name is None:
            return "gone"
        return await self._cordon(name, reason=reason, deadline=deadline, event_id=event_id)

    async def _cordon(self, name: str, *, reason: str, deadline: datetime | None,
                      event_id: str | None) -> CordonClaimResult:
        """Taint Node ``name`` unless resilienced's taint is on it; with ``event_id`` the cordon
        names the event it decides, without it the annotation goes (it says which cordon is on)."""
        taint: dict[str, JsonValue] = {"key": TAINT_KEY, "value": taint_value(reason), "effect": "NoSchedule"}
        node = self._caches.nodes.get(None, name)
        for _ in range(self._conflict_retries):
            if node is None:
                node = await self._read_node(name)
                if node is None:
                    log.info("cordon: Node gone", node=name)
                    return "gone"
            if _cordoned(node):
                return "decided" if event_id is not None and _decided_by(node) == event_id else "taken"
            taints = list((node.get("spec") or {}).get("taints") or [])
            notes: dict[str, JsonValue] = {}
            if deadline is not None:
                notes[DEADLINE_ANNOTATION] = deadline.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            if event_id is not None or EVENT_ANNOTATION in _notes(node):  # None: an old one goes
                notes[EVENT_ANNOTATION] = event_id
            metadata: dict[str, JsonValue] = {"resourceVersion": (node.get("metadata") or {}).get("resourceVersion")}
            if notes:
                metadata["annotations"] = notes
            patch: dict[str, JsonValue] = {"metadata": metadata, "spec": {"taints": [*taints, taint]}}
            try:
                await call(verb="patch", resource="nodes", request=self._core.patch_node(
                    name, patch, _preload_content=False, _request_timeout=self._request_timeout_s))
                return "cordoned"
            except KubeStatusError as err:
                if err.status == 404:
                    return "gone"
                if err.status != 409:
                    raise
                node = None
        raise BackendUnavailable(BACKEND, f"cordon {name}: the Node kept changing")

    async def record(self, target: Target, *, reason: str, message: str, warning: bool = False,
                     once: str | None = None) -> None:
        """One Event on the run's object (the Volcano Job, else the RayJob, else the RayCluster), the
        message ending with the target's instances and their Nodes (:meth:`where`); on the Node only
        when the target names no run object.  ``once``: see :meth:`EventRecorder.emit` (one Event
        per object, reason and key, for every replica)."""
        runs = ((target.facts.volcano_job, VOLCANO_JOB_API_VERSION, "Job", self._caches.cache_of(VOLCANO_JOBS)),
                (target.ray_job, "ray.io/v1", "RayJob", self._caches.rayjobs),
                (target.ray_cluster, "ray.io/v1", "RayCluster", self._caches.rayclusters))
        for key, api_version, kind, cache in runs:
            if not key:
                continue
            ns, _, name = str(key).partition("/")
            obj = cache.get(ns, name) if cache is not None else None
            ref = (ref_for(obj, api_version=api_version, kind=kind) if obj is not None
                   else ObjectRef(api_version=api_version, kind=kind, name=name, uid="", namespace=ns))
            await self.events.emit(ref, reason=reason, message=f"{message} {self.where(target)}".rstrip(),
                                   warning=warning, once=once)
            return
        if target.node:
            node = self._caches.nodes.get(None, target.node)
            ref = (ref_for(node, api_version="v1", kind="Node") if node is not None
                   else ObjectRef(api_version="v1", kind="Node", name=target.node, uid=""))
            await self.events.emit(ref, reason=reason, message=message, warning=warning, once=once)

    def where(self, target: Target) -> str:
        """``[instances: i-1 on Node n1, i-2 on Node n2]``: the target's instances (a gang's, a wave's
        merged) and their Nodes from the Node cache (``no Node`` when it has none)."""
        instances = target.facts.instance_ids or ((target.instance_id,) if target.instance_id else ())
        if not instances:
            return ""
        named = []
        for instance in instances:
            node = target.node if instance == target.instance_id and target.node else self._node_of(instance)
            named.append(f"{instance} on Node {node}" if node else f"{instance} (no Node)")
        return f"[instances: {', '.join(named)}]"
