"""Watch-fed caches of Kubernetes objects (the informer pattern), so that reads cost no API call.

One :class:`Informer` per resource lists it (in pages), then watches from the list's
resourceVersion, applying each ADDED / MODIFIED / DELETED event to an in-memory store of plain
JSON objects with secondary indices.  It asks for BOOKMARK events, so a quiet watch still advances
its resourceVersion, and ends each watch after ``watch_timeout_s`` (the server closes it too) to
resume from the last resourceVersion seen.  A 410 Gone (the resourceVersion was compacted away,
in the watch's ERROR event or on a list's continue token) makes it list again at once; any other
failure (5xx, 429, timeouts, connection errors, even a 403 while RBAC is being fixed) waits an
exponential backoff with jitter and resumes the watch from where it was (or lists again, when
the first list never finished).

``synced`` is set once the first list is in the store and stays set: a later re-list replaces the
store in one step, so readers never see a half-filled cache.  ``behind`` says why the store may lag
the server (a failed watch or list in its backoff, a 410 Gone before its re-list), None while the
watch follows it: a reader that must not act on stale state (the follow-up's probe,
``kube.progress``) takes :attr:`Informer.answers` (synced and not behind) as the cache's answer and
anything else as "no answer yet".
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from kubernetes_asyncio import watch as k8s_watch

from resilienced.supervisor import Supervisor
from resilienced.errors import ResilienceError
from resilienced.kube.api import JsonObj, KubeStatusError, call, translate
from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.retry import Backoff

log = get_logger(__name__)

Key = tuple[str, str]  # (namespace or "", name)
Indexer = Callable[[JsonObj], Iterable[str]]


@dataclass(frozen=True)
class CacheOptions:
    """How the caches talk to the API server."""

    request_timeout_s: float = 10.0
    """Total time allowed for one list page.  Long enough for a 500-object page on a busy EKS
    control plane, short enough that a hung request is noticed well inside a 2-minute notice."""

    watch_timeout_s: int = 300
    """``timeoutSeconds`` of each watch request; the watch then resumes from its resourceVersion.
    Below the API server's own limit (30-60 min), so idle connections are renewed on our terms."""

    watch_read_slack_s: float = 90.0
    """How long beyond ``watch_timeout_s`` a silent watch connection is trusted before it is
    dropped as dead (the server sends bookmarks about once a minute)."""

    page_size: int = 500
    """``limit`` of each list page: a 5,000-pod cluster is listed in 10 requests, none too large."""

    backoff_initial_s: float = 0.5
    """First wait after a failed list or watch; doubled per failure, with +-25 % jitter."""

    backoff_max_s: float = 30.0
    """Longest wait between attempts while the API server keeps failing."""


def object_key(obj: Mapping[str, JsonValue]) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


class _Gone(Exception):
    """The resourceVersion is too old: list again."""


@dataclass(frozen=True)
class Source:
    """What one informer lists and watches: a kubernetes_asyncio list method and its arguments.

    ``method`` is e.g. ``CoreV1Api.list_node`` or ``CustomObjectsApi.list_cluster_custom_object``
    (with ``args=(group, version, plural)``); it must take ``watch``, ``resource_version``,
    ``label_selector``, ``limit``, ``_continue``, ``timeout_seconds`` and ``allow_watch_bookmarks``.
    """

    resource: str  # for errors and logs: "nodes", "pods", "rayclusters.ray.io"
    method: Callable[..., Awaitable[object]]
    args: tuple[str, ...] = ()
    label_selector: str | None = None
    field_selector: str | None = None
    namespace: str | None = None  # the one namespace a namespaced list covers (None: all, or cluster-scoped)

    def covers(self, namespace: str | None) -> bool:
        """Whether objects of ``namespace`` are listed (an object absent from the store is absent)."""
        return self.namespace is None or self.namespace == namespace


@dataclass
class InformerStats:
    """What the informer did, for tests, metrics and the readiness endpoint."""

    lists: int = 0  # completed lists (the first one and every re-list)
    list_pages: int = 0
    watches: int = 0  # watch requests opened
    events: Counter[str] = field(default_factory=Counter)  # ADDED / MODIFIED / DELETED / BOOKMARK
    expired: int = 0  # 410 Gone answers (each followed by a re-list)
    errors: int = 0  # other failures (each followed by a backoff)
    last_error: str | None = None


class Informer:
    """A list-then-watch cache of one resource, with named secondary indices."""

    def __init__(
        self,
        source: Source,
        *,
        options: CacheOptions | None = None,
        indexers: Mapping[str, Indexer] | None = None,
    ) -> None:
        self.source = source
        self.options = options or CacheOptions()
        self._indexers = dict(indexers or {})
        self._items: dict[Key, JsonObj] = {}
        self._index: dict[str, dict[str, set[Key]]] = {name: {} for name in self._indexers}
        self._keys_of: dict[Key, dict[str, tuple[str, ...]]] = {}
        self.synced = asyncio.Event()
        self.resource_version: str | None = None
        self.stats = InformerStats()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None  # set when the task died of a bug
        self.behind: str | None = None  # why the store may lag the server now (None: the watch follows it)

    @property
    def answers(self) -> bool:
        """Whether the store is the server's state as of the watch: listed, and not behind."""
        return self.synced.is_set() and self.behind is None and self.running

    # ------------------------------------------------------------------ reads
    def get(self, namespace: str | None, name: str) -> JsonObj | None:
        return self._items.get((namespace or "", name))

    def by_index(self, index: str, value: str) -> list[JsonObj]:
        return [self._items[k] for k in sorted(self._index[index].get(value, ()))]

    def values(self) -> list[JsonObj]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    async def wait_until(self, predicate: Callable[[Informer], bool], *, timeout: float) -> bool:
        """Wait (bounded) until ``predicate(self)`` holds after some change; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return predicate(self)
        return True

    # ------------------------------------------------------------------ store
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _unindex(self, key: Key) -> None:
        for name, values in self._keys_of.pop(key, {}).items():
            for value in values:
                bucket = self._index[name].get(value)
                if bucket is not None:
                    bucket.discard(key)
                    if not bucket:
                        del self._index[name][value]

    def _put(self, obj: JsonObj) -> None:
        key = object_key(obj)
        self._unindex(key)
        self._items[key] = obj
        keys: dict[str, tuple[str, ...]] = {}
        for name, indexer in self._indexers.items():
            values = tuple(v for v in indexer(obj) if v)
            keys[name] = values
            for value in values:
                self._index[name].setdefault(value, set()).add(key)
        self._keys_of[key] = keys

    def _remove(self, obj: JsonObj) -> None:
        key = object_key(obj)
        self._unindex(key)
        self._items.pop(key, None)

    def _replace(self, items: Iterable[JsonObj]) -> None:
        self._items.clear()
        self._keys_of.clear()
        self._index = {name: {} for name in self._indexers}
        for obj in items:
            self._put(obj)

    # ------------------------------------------------------------------ lifecycle
    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the list-and-watch task ``resilienced.kube.cache[<resource>]``, a long-lived task of
        ``supervisor`` (the daemon's: its death turns /healthz to 503; else one of its own)."""
        if self._task is None:
            owner = supervisor if supervisor is not None else Supervisor()
            self._task = owner.spawn(self._guarded(), name=f"resilienced.kube.cache[{self.source.resource}]")

    async def stop(self) -> None:
        """Cancel the task and wait for it (its watch connection is closed on the way out)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - it had died already: logged by the guard, kept in failure
            pass

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _guarded(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug: its supervisor logs and records it; readiness reports it
            self.failure = err
            raise

    async def _run(self) -> None:
        backoff = Backoff(self.options.backoff_initial_s, maximum=self.options.backoff_max_s, jitter=0.25)
        while True:
            try:
                if self.resource_version is None or not self.synced.is_set():
                    await self._list()
                    backoff.reset()
                progressed = await self._watch()
                if progressed:
                    backoff.reset()
            except _Gone:
                self.stats.expired += 1
                self.resource_version = None
                self.behind = "resourceVersion expired: listing again"
                log.info("kubernetes cache: resourceVersion expired, listing again", resource=self.source.resource)
            except ResilienceError as err:
                self.stats.errors += 1
                self.stats.last_error = str(err)
                self.behind = str(err)
                delay = backoff.next()
                log.warning("kubernetes cache: retrying", resource=self.source.resource, error=str(err),
                            delay_s=round(delay, 1))
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        items: list[JsonObj] = []
        token: str | None = None
        list_rv: str | None = None
        while True:
            kwargs: dict[str, JsonValue] = {
                "limit": self.options.page_size,
                "_preload_content": False,
                "_request_timeout": self.options.request_timeout_s,
            }
            self._selectors(kwargs)
            if token:
                kwargs["_continue"] = token
            try:
                page = await call(verb="list", resource=self.source.resource,
                                  request=self.source.method(*self.source.args, **kwargs))
            except KubeStatusError as err:
                if err.status == 410:
                    raise _Gone() from err
                raise
            self.stats.list_pages += 1
            meta = page.get("metadata") or {}
            list_rv = list_rv or meta.get("resourceVersion")
            items.extend(page.get("items") or [])
            token = meta.get("continue") or None
            if not token:
                break
        self._replace(items)
        self.resource_version = list_rv
        self.stats.lists += 1
        self.behind = None
        self.synced.set()
        self._notify()

    async def _watch(self) -> bool:
        """One watch request from ``resource_version``; True when it delivered anything."""
        progressed = False
        kwargs: dict[str, JsonValue] = {
            "resource_version": self.resource_version,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self.options.watch_timeout_s,
            "_request_timeout": aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.options.request_timeout_s,
                sock_read=self.options.watch_timeout_s + self.options.watch_read_slack_s,
            ),
        }
        self._selectors(kwargs)
        self.stats.watches += 1
        stream = k8s_watch.Watch(return_type="object")
        try:
            async with stream:
                async for event in stream.stream(self.source.method, *self.source.args, **kwargs):
                    progressed = True
                    self._apply(event)
                    self.behind = None
        except (asyncio.CancelledError, _Gone, ResilienceError):
            raise
        except Exception as err:  # kubernetes_asyncio / aiohttp, translated at this boundary
            translated = translate(err, verb="watch", resource=self.source.resource)
            if isinstance(translated, KubeStatusError) and translated.status == 410:
                raise _Gone() from err
            raise translated from err
        self.behind = None  # the server ended the watch in time: it was following
        return progressed

    def _selectors(self, kwargs: dict[str, JsonValue]) -> None:
        if self.source.label_selector:
            kwargs["label_selector"] = self.source.label_selector
        if self.source.field_selector:
            kwargs["field_selector"] = self.source.field_selector

    def _apply(self, event: Mapping[str, JsonValue]) -> None:
        kind = str(event.get("type", "")).upper()
        obj = event.get("raw_object") or {}
        self.stats.events[kind] += 1
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self._put(obj)
        elif kind == "DELETED":
            self._remove(obj)
        elif kind != "BOOKMARK":
            return
        if rv:
            self.resource_version = rv
        if kind != "BOOKMARK":
            self._notify()


def controller_uids(obj: Mapping[str, JsonValue]) -> list[str]:
    """The uid of the object's controller (its controller ownerReference), as an index value."""
    return [str(ref.get("uid") or "") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
            if ref.get("controller")]


__all__ = ["CacheOptions", "Informer", "InformerStats", "Source", "controller_uids", "object_key"]
