"""RayGcs: the GCS calls resilienced makes on one Ray cluster (the ``ray drain-node`` protocol).

Every Ray-protocol specific of the project lives in this module: the GCS client, the drain
reason, the cluster-metadata key behind the version check, the internal-KV namespace, and the
token handling.  Nothing else imports ``ray``.

What it does, per cluster (one :class:`RayGcs` per GCS address):

* :meth:`RayGcs.nodes` lists every node the GCS knows (alive or dead) with its hex id, node
  manager address, labels, head flag and drain deadline.
* :meth:`RayGcs.drain` asks the GCS to drain a node with reason ``DRAIN_NODE_REASON_PREEMPTION``
  and a deadline in unix milliseconds, as ``ray drain-node`` does (``ray/scripts/scripts.py``
  ``drain_node``): Ray Train then hands ``PreemptionInfo`` to every rank.  A node already
  draining with an earlier or equal deadline is left alone (and the result says so).
* ``kv_*`` read and write the GCS internal KV in the namespace ``resilienced`` (ray-mode claims).

Version check: the first call on a connection reads the cluster metadata the head wrote into the
internal KV (namespace ``cluster``, key ``CLUSTER_METADATA``, JSON with ``ray_version``), as
``ray drain-node`` does (``_check_ray_version``).  Another Ray version than the one installed here
(pinned in pyproject) raises :class:`~resilienced.errors.RayVersionMismatch` naming both: the
drain RPC is not a stable public API.

Token auth (Ray 2.60 turns it on by default).  How Ray's client side finds its token
(C++ ``ray::rpc::AuthenticationTokenLoader``, ``src/ray/rpc/authentication/
authentication_token_loader.cc``): one process-wide singleton; ``GetToken``/``TryLoadToken``
return the cached token if there is one, else load it from, in order, the ``RAY_AUTH_TOKEN``
environment variable, the file named by ``RAY_AUTH_TOKEN_PATH``, the Kubernetes service-account
token (only with ``RAY_ENABLE_K8S_TOKEN_AUTH``), and ``~/.ray/auth_token``, and cache it until
``ResetCache()`` (Python: ``AuthenticationTokenLoader.instance().reset_cache()``).  Whether a
token is sent at all depends on ``RayConfig.AUTH_MODE`` (process-wide, read from
``RAY_AUTH_MODE`` by ``Config.initialize``).  Seen here with Ray 2.60: the GCS client asks the
loader for the token on every RPC, so a client made for cluster A sends cluster B's token once
the cache holds B's.  And with token mode on and no token found, ``GetToken`` ends the process
(``RAY_CHECK``).

So, to talk to several clusters with different tokens from one process, every GCS call here runs
under one process-wide lock that (1) writes the cluster's token into a private file
(``0600`` in a ``0700`` temporary directory) named by ``RAY_AUTH_TOKEN_PATH``, with
``RAY_AUTH_TOKEN`` removed and ``RAY_AUTH_MODE=token`` set for the duration of the call only,
(2) resets the loader's cache, (3) makes the call, and (4) puts the environment back.  The token
never sits in the environment; child processes see the variables only if they are spawned during
a call.  The switch is made in the C environment (``os.putenv``/``os.unsetenv``, what Ray's C++
reads), never in Python's ``os.environ`` mapping: other threads iterate that mapping (botocore
looks up proxies in it for every new client), and a key removed between the snapshot of its keys
and the read of its value raised ``KeyError`` there (seen in a drill: the daemon's GCS call ended
while the drill created an EventBridge client).  Measured here: the switch costs about 0.2 ms (a GCS call on a local cluster about
0.5 ms); a helper subprocess per call, the alternative, costs about 0.5 s and 80 MB per call.
The price is that GCS calls of all clusters are serialised; a call waits at most ``timeout`` for
the lock and then raises :class:`~resilienced.errors.BackendUnavailable`.  A cluster without
token auth gets a placeholder token (a GCS without auth ignores it), so the ``RAY_CHECK`` above
can never fire.  ``RayConfig.AUTH_MODE`` is left at ``token`` for the rest of the process.

Never hangs: the GCS client is synchronous, so each call runs in a daemon thread while the
event loop awaits it with a bound.  Before a call a TCP connect (bounded by ``timeout``) checks
that something listens at the address, so an unreachable GCS fails fast, without taking the
lock.  Every RPC carries ``timeout``; the connection is made with
``InnerGcsClient.standalone(timeout_ms)`` (which still waits up to ~10 s more inside Ray when
something answers TCP but is not a GCS).  Library errors are translated here:
``AuthenticationError`` -> :class:`~resilienced.errors.RayAuthError`, other Ray RPC errors and
timeouts -> ``BackendUnavailable("ray-gcs", ...)``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from resilienced.errors import BackendUnavailable, RayAuthError, RayVersionMismatch
from resilienced.log import get as get_logger
from resilienced.ports import DrainResult, RayNode

log = get_logger(__name__)

T = TypeVar("T")

BACKEND = "ray-gcs"
#: The GCS internal-KV namespace resilienced writes to (ray-mode claims).
KV_NAMESPACE = "resilienced"
#: The drain reason Ray Train turns into ``PreemptionInfo``.
DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"
#: Where the head keeps the cluster's Ray version (``ray._common.usage.usage_lib``).
_METADATA_NAMESPACE = b"cluster"
_METADATA_KEY = b"CLUSTER_METADATA"
#: ``GcsNodeInfo.state`` of a live node.
_ALIVE = 0
#: Sent to clusters for which no token is known: a GCS without token auth ignores it, one with
#: token auth rejects it (-> RayAuthError).  Never empty: an empty token would end the process.
_NO_TOKEN = "resilienced-no-token-configured"
_NODE_ID_RE = re.compile(r"^[0-9a-f]{56}$")
_K8S_SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# --------------------------------------------------------------------------- ray, lazily
def _ray() -> Any:
    """``ray._raylet`` (imported on first use: it takes a few hundred ms)."""
    import ray._raylet

    return ray._raylet


def installed_ray_version() -> str:
    """The Ray version this process speaks (pinned in pyproject)."""
    import ray

    return ray.__version__


# --------------------------------------------------------------------------- token handling
def default_token() -> str | None:
    """The token Ray's own client would load in this process, or None.

    Same sources and order as ``AuthenticationTokenLoader::TryLoadTokenFromSources``:
    ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, the Kubernetes service-account
    token when ``RAY_ENABLE_K8S_TOKEN_AUTH`` is set, ``~/.ray/auth_token`` (first line, trimmed).
    Read in Python, so that it is not confused with the token file this module writes.
    """
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    if path and path != TOKEN_SWITCH.path_str:
        return _first_line(Path(path))
    if os.environ.get("RAY_ENABLE_K8S_TOKEN_AUTH", "").lower() in ("1", "true"):
        token = _first_line(_K8S_SA_TOKEN)
        if token:
            return token
    return _first_line(Path.home() / ".ray" / "auth_token")


def _first_line(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().strip()
    except OSError:
        return None
    return line or None


class _TokenSwitch:
    """Process-wide: the lock every GCS call holds, and the token file Ray reads under it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._dir: Path | None = None
        self._path: Path | None = None
        self._written: str | None = None
        self.switches = 0  # how many times the token changed (observability, tests)

    @property
    def path_str(self) -> str | None:
        return str(self._path) if self._path else None

    def _file(self) -> Path:
        if self._path is None:
            atexit.register(self._cleanup)
        if self._dir is None or not self._dir.is_dir():  # first use, or a /tmp cleaner took it
            self._dir = Path(tempfile.mkdtemp(prefix="resilienced-ray-auth-"))
            os.chmod(self._dir, 0o700)
            self._path = self._dir / "token"
            self._written = None
        assert self._path is not None
        return self._path

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    @contextmanager
    def using(self, token: str, *, wait_s: float, address: str) -> Iterator[None]:
        """Hold the lock with ``token`` loaded as the process's Ray token; restore the env after."""
        if not self.lock.acquire(timeout=max(wait_s, 0.0)):
            raise BackendUnavailable(
                BACKEND, f"{address}: another GCS call held the client for more than {wait_s:.1f}s"
            )
        try:
            path = self._file()
            # Rewritten also when it went missing: Ray ends the process when RAY_AUTH_TOKEN_PATH
            # names a file it cannot read.
            if token != self._written or not path.is_file():
                tmp = path.with_name("token.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(token)
                os.replace(tmp, path)
                self._written = token
                self.switches += 1
            # The C environment only (what Ray's C++ loader reads with getenv): os.environ, the
            # mapping other threads iterate (botocore's proxy lookup, subprocess env copies),
            # never changes, so no key can vanish under an iteration (KeyError).
            os.unsetenv("RAY_AUTH_TOKEN")
            os.putenv("RAY_AUTH_TOKEN_PATH", str(path))
            os.putenv("RAY_AUTH_MODE", "token")
            raylet = _ray()
            if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
                raylet.Config.initialize("")  # re-reads RAY_AUTH_MODE
            raylet.AuthenticationTokenLoader.instance().reset_cache()
            yield
        finally:
            for key in _AUTH_VARS:  # back to what os.environ (never changed here) says
                value = os.environ.get(key)
                if value is None:
                    os.unsetenv(key)
                else:
                    os.putenv(key, value)
            self.lock.release()


#: The one switch of Ray's auth environment in this process (public: the drill's local Ray cluster,
#: ``resilienced.local.raycluster``, makes its own GCS client under it too).
TOKEN_SWITCH = _TokenSwitch()


# --------------------------------------------------------------------------- the adapter
def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError naming what is wrong."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError("Ray GCS address is empty: expected host:port, e.g. 10.0.0.5:6379")
    text = address.strip()
    for prefix in ("ray://", "gcs://"):
        if text.startswith(prefix):
            raise ValueError(f"Ray GCS address {address!r}: give host:port without {prefix}")
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"Ray GCS address {address!r} is not host:port with a port in 1-65535")
    return host, int(port_text)


class RayGcs:
    """The ``ports.RayControl`` of one Ray cluster, reached at its GCS address.

    Args:
        address: the GCS ``host:port`` (``ray start --head --port``; KubeRay: the head
            service, port 6379).
        token: the cluster's auth token.  None: the token Ray's own client would find in this
            process (:func:`default_token`), else none (clusters without token auth).
        timeout: seconds, the bound of each step: the TCP check, the wait for the process-wide
            GCS lock, each RPC.  A call as a whole is abandoned after ``3 * timeout + 15`` s.
    """

    def __init__(self, address: str, *, token: str | None = None, timeout: float = 10.0) -> None:
        self._host, self._port = parse_address(address)
        self.address = f"{self._host}:{self._port}"
        if token is not None:
            token = token.strip()
            if not token or any(c.isspace() for c in token):
                raise ValueError("Ray auth token must be a non-empty string without whitespace")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._token = token if token is not None else default_token()
        self._token_given = token is not None
        self.timeout = float(timeout)
        self._client: Any = None  # InnerGcsClient; only touched under TOKEN_SWITCH.lock
        self.cluster_ray_version: str | None = None

    def __repr__(self) -> str:
        return f"RayGcs({self.address!r}, token={'set' if self._token else 'none'})"

    # ------------------------------------------------------------------ port: RayControl
    async def nodes(self) -> list[RayNode]:
        """Every node the GCS knows, alive or dead.

        ``draining_deadline_ms``: None when the node is not draining, the deadline in unix ms
        when it is, 0 when it drains without a deadline (GCS's own convention).
        """
        return await self._call("list nodes", self._nodes_sync)

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        """Drain with reason PREEMPTION: what happened and why (see :class:`DrainResult`;
        ``accepted`` when GCS took it or the node already drains sooner)."""
        return await self.drain_node(node_id, deadline=deadline, message=message)

    async def drain_node(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        """The same as :meth:`drain` (the name of the ``ray drain-node`` call)."""
        node_id = _check_node_id(node_id)
        if deadline.tzinfo is None:
            raise ValueError(f"drain deadline {deadline.isoformat()} has no time zone (want UTC)")
        deadline_ms = int(deadline.timestamp() * 1000)
        if deadline_ms <= 0:
            raise ValueError(f"drain deadline {deadline.isoformat()} is not after 1970")
        result = await self._call(
            f"drain node {node_id}", lambda c: self._drain_sync(c, node_id, deadline_ms, message)
        )
        log_fn = log.info if result.accepted else log.warning
        log_fn("ray drain", node_id=node_id, address=self.address, outcome=result.outcome, detail=result.detail)
        return result

    # ------------------------------------------------------------------ internal KV
    async def kv_put_if_absent(self, key: str, value: bytes) -> bool:
        """Write ``key`` only if it does not exist; True when this call wrote it.

        Atomic in the GCS (a Put with ``overwrite=False``): of two racing writers one wins.
        """
        k = _kv_key(key)
        return await self._call(
            f"kv put-if-absent {key}",
            lambda c: bool(c.internal_kv_put(k, bytes(value), False, namespace=KV_NAMESPACE.encode(),
                                             timeout=self.timeout)),
        )

    async def kv_put(self, key: str, value: bytes) -> None:
        """Write ``key``, replacing any value (no compare-and-set exists in the GCS KV)."""
        k = _kv_key(key)
        await self._call(
            f"kv put {key}",
            lambda c: c.internal_kv_put(k, bytes(value), True, namespace=KV_NAMESPACE.encode(),
                                        timeout=self.timeout),
        )

    async def kv_get(self, key: str) -> bytes | None:
        k = _kv_key(key)
        return await self._call(
            f"kv get {key}",
            lambda c: c.internal_kv_get(k, namespace=KV_NAMESPACE.encode(), timeout=self.timeout),
        )

    async def kv_del(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""
        k = _kv_key(key)
        return await self._call(
            f"kv del {key}",
            lambda c: c.internal_kv_del(k, False, namespace=KV_NAMESPACE.encode(),
                                        timeout=self.timeout) > 0,
        )

    async def kv_keys(self, prefix: str) -> list[str]:
        """Every key in the namespace that starts with ``prefix``."""
        k = _kv_key(prefix)
        raw = await self._call(
            f"kv keys {prefix}",
            lambda c: c.internal_kv_keys(k, namespace=KV_NAMESPACE.encode(), timeout=self.timeout),
        )
        return sorted(key.decode("utf-8", errors="replace") for key in raw)

    async def ping(self) -> str:
        """Connect (checking token and version); returns the cluster's Ray version."""
        await self._call("ping", lambda c: None)
        assert self.cluster_ray_version is not None
        return self.cluster_ray_version

    # ------------------------------------------------------------------ plumbing
    async def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` on a daemon thread under the token lock, bounded in time."""
        await self._check_reachable()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def run() -> None:
            try:
                value = self._run_locked(what, fn)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                try:
                    loop.call_soon_threadsafe(settle, False, e)
                except RuntimeError:  # the loop is gone
                    pass
            else:
                try:
                    loop.call_soon_threadsafe(settle, True, value)
                except RuntimeError:
                    pass

        threading.Thread(target=run, name=f"ray-gcs {self.address}", daemon=True).start()
        bound = 3 * self.timeout + 15.0
        try:
            async with asyncio.timeout(bound):
                return await future
        except TimeoutError:
            raise BackendUnavailable(
                BACKEND, f"{self.address}: {what} did not finish within {bound:.0f}s"
            ) from None

    async def _check_reachable(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                _, writer = await asyncio.open_connection(self._host, self._port)
        except TimeoutError:
            raise BackendUnavailable(
                BACKEND, f"{self.address}: no TCP connection within {self.timeout:.1f}s"
            ) from None
        except OSError as e:
            raise BackendUnavailable(BACKEND, f"{self.address}: cannot connect: {e}") from e
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass

    def _run_locked(self, what: str, fn: Callable[[Any], T]) -> T:
        raylet_exc = _ray_exceptions()
        with TOKEN_SWITCH.using(self._token or _NO_TOKEN, wait_s=self.timeout, address=self.address):
            try:
                client = self._connected()
                return fn(client)
            except raylet_exc.AuthenticationError as e:
                self._client = None
                raise RayAuthError(self._auth_message()) from e
            except (raylet_exc.RayError, TimeoutError, OSError) as e:
                self._client = None  # reconnect (and re-check the version) next time
                raise BackendUnavailable(BACKEND, f"{self.address}: {what} failed: {_brief(e)}") from e

    def _auth_message(self) -> str:
        if self._token is None:
            return (
                f"the Ray cluster at {self.address} requires a token and none is configured "
                "(no token given, and RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token "
                "hold none)"
            )
        source = "given" if self._token_given else "found in this process's Ray token sources"
        return f"the Ray cluster at {self.address} rejected the auth token {source} (wrong token)"

    def _connected(self) -> Any:
        if self._client is not None:
            return self._client
        raylet = _ray()
        client = raylet.InnerGcsClient.standalone(self.address, None, int(self.timeout * 1000))
        version = self._check_version(client)
        self._client = client
        self.cluster_ray_version = version
        return client

    def _check_version(self, client: Any) -> str:
        ours = installed_ray_version()
        raw = client.internal_kv_get(_METADATA_KEY, namespace=_METADATA_NAMESPACE, timeout=self.timeout)
        theirs: Any = None
        if raw is not None:
            try:
                theirs = json.loads(raw.decode("utf-8")).get("ray_version")
            except (ValueError, UnicodeDecodeError, AttributeError):
                theirs = None
        if not isinstance(theirs, str) or not theirs:
            raise RayVersionMismatch(
                f"the Ray cluster at {self.address} does not report its Ray version (no readable "
                f"cluster metadata); resilienced speaks Ray {ours} and will not drain blind"
            )
        if theirs != ours:
            raise RayVersionMismatch(
                f"Ray version mismatch: the cluster at {self.address} runs Ray {theirs}, "
                f"resilienced is built for Ray {ours} (pinned); the GCS drain protocol is not "
                "stable across versions"
            )
        return theirs

    def _nodes_sync(self, client: Any) -> list[RayNode]:
        infos = client.get_all_node_info(timeout=self.timeout)
        draining = {_hex(k): int(v) for k, v in client.get_draining_nodes(timeout=self.timeout).items()}
        out = []
        for node_id, info in infos.items():
            hex_id = _hex(node_id)
            out.append(
                RayNode(
                    node_id=hex_id,
                    address=info.node_manager_address,
                    labels={str(k): str(v) for k, v in info.labels.items()},
                    alive=info.state == _ALIVE,
                    is_head=bool(info.is_head_node),
                    draining_deadline_ms=draining.get(hex_id),
                    started_ms=int(getattr(info, "start_time_ms", 0) or 0) or None,
                    resources={str(k): float(v) for k, v in dict(getattr(info, "resources_total", {}) or {}).items()},
                )
            )
        return out

    def _drain_sync(self, client: Any, node_id: str, deadline_ms: int, message: str) -> DrainResult:
        nodes = {n.node_id: n for n in self._nodes_sync(client)}
        node = nodes.get(node_id)
        if node is None:
            return DrainResult(node_id, "unknown_node", False, deadline_ms,
                               f"no node {node_id} in the cluster at {self.address}")
        if not node.alive:
            return DrainResult(node_id, "dead", False, deadline_ms, "the node is already dead")
        current = node.draining_deadline_ms
        if current is not None and current != 0 and current <= deadline_ms:
            return DrainResult(
                node_id, "already_draining", True, deadline_ms,
                f"already draining with deadline {current} ms <= {deadline_ms} ms: not re-drained",
            )
        from ray.core.generated import autoscaler_pb2

        accepted, rejection = client.drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON), message, deadline_ms,
            timeout=self.timeout,
        )
        if accepted:
            detail = "" if current is None else f"was draining with deadline {current or 'none'}"
            return DrainResult(node_id, "drained", True, deadline_ms, detail)
        return DrainResult(node_id, "rejected", False, deadline_ms, str(rejection))


def _ray_exceptions() -> Any:
    import ray.exceptions

    return ray.exceptions


def _hex(node_id: Any) -> str:
    return node_id if isinstance(node_id, str) else node_id.hex()


def _check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not _NODE_ID_RE.match(node_id.lower()):
        raise ValueError(f"Ray node id {node_id!r} is not 56 hex characters")
    return node_id.lower()


def _kv_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"GCS KV key {key!r} must be a non-empty string")
    return key.encode("utf-8")


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


def token_switches() -> int:
    """How many times the process-wide token changed (for tests and the benchmark)."""
    return TOKEN_SWITCH.switches
