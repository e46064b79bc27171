"""A real local multi-node Ray cluster made of ``ray start`` processes, for tests and the drill.

Every node is one ``ray start --block`` process started under ``setsid``, so each node is its own
process group (session) that can be signalled as a whole, as the instance it stands for:

* :meth:`LocalRayCluster.sigterm_node` sends SIGTERM to the node's ``ray start`` process, which
  is what Kubernetes does to a pod's PID 1 (KubeRay runs ``ray start --block`` there).  Ray then
  drains the node itself: GCS ``DrainNode`` with reason PREEMPTION and a deadline of
  ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (30 s unless set in ``env``), waits for the raylet to
  finish, and stops the node's processes.  The signal goes to that one process, not the whole
  group: the raylet and the workers share the group, and a SIGTERM to them ends them at once,
  which is a crash, not a drain.
* :meth:`LocalRayCluster.kill_node` sends SIGKILL to the whole group: the instance is gone.
* :meth:`LocalRayCluster.drain_node` asks the GCS for a drain, as the daemon does.
* :meth:`LocalRayCluster.restart_head` starts the head again with its first command line and
  environment, once its processes are gone, as the kubelet restarts a head Pod's container.  With
  ``redis_address`` (GCS fault tolerance) the restarted GCS reloads the cluster from Redis and the
  workers stay; without it the cluster's state is gone.

Facts this module relies on (Ray 2.60, seen on a 2-core machine):

* ``ray start --head`` turns token auth on; every process of the cluster (nodes, drivers, GCS
  clients) then needs ``RAY_AUTH_MODE=token`` and the token, here passed as ``RAY_AUTH_TOKEN``
  (no ``~/.ray/auth_token`` is written or read).
* ``--node-ip-address=127.0.0.1`` is required.
* Worker nodes must start one at a time: concurrent starts time out on 2 cores.
* Every port is chosen free per node, and every cluster has its own ``--temp-dir``, so two
  clusters (two test runs) never collide; nothing here runs ``ray stop`` or touches processes it
  did not start.
* ``ray start --block`` polls its child processes every second and, when one (the GCS, the
  raylet) exits with another code than 0 or SIGTERM's, kills the node's other processes and exits
  1 (``ray/scripts/scripts.py``, the ``if block:`` loop, Ray 2.60): a SIGKILLed GCS takes its
  head node down with it, and what brings it back is a restart of the head's ``ray start``.

GCS fault tolerance (``redis_address``) is configured as KubeRay does it (kuberay
``ray-operator/controllers/ray/common/pod.go``, ``configureGCSFaultTolerance`` /
``configureRedisFT``; Ray's doc/source/cluster/kubernetes/user-guides/kuberay-gcs-ft.md): the head
gets ``RAY_REDIS_ADDRESS`` (read by ``ray/_private/node.py`` in Ray 2.60: the GCS is started with
``--redis_address``/``--redis_port``, ``ray/_private/services.py`` ``start_gcs_server``) and
``RAY_external_storage_namespace`` (the cluster's key prefix in Redis; KubeRay uses the
RayCluster's UID, here the cluster's id); the workers get ``RAY_gcs_rpc_server_reconnect_timeout_s
= 600`` (Ray's default is 60, ``src/ray/common/ray_config_def.h``): a raylet that cannot reach the
GCS for that long exits, and 600 s outlasts a head restart.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from resilienced.errors import ResilienceError
from resilienced.model import CAPACITY_NAMES
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL

CAPACITY_TYPES = CAPACITY_NAMES

#: Set in every node's environment (and so inherited by its raylet and Ray workers): how
#: :meth:`LocalRayCluster.kill_node` and :meth:`LocalRayCluster.stop` find every process of a
#: node, also workers whose parent died first, and never a process of another cluster.
_NODE_MARKER = "RESILIENCED_LOCALRAY_NODE"

#: GCS node states (``GcsNodeInfo.state``).
_ALIVE = 0

#: ``ray start`` gives a new raylet 30 s to register with the GCS, a constant of Ray's
#: (``raylet_start_wait_time_s`` in ray/_private/node.py, Ray 2.60), then exits 1 saying this; on
#: a loaded 2-core machine a node can take longer, the head too (its GCS not answering within
#: those 30 s: seen Dec 3 in ``make test-long`` with a core kept busy).  Such a start is made
#: again, at most :data:`NODE_START_ATTEMPTS` in all, as a provider launches again an instance
#: that failed its start-up (the head on a GCS port drawn anew); any other failure is raised at
#: once.
_RAYLET_TIMED_OUT = "The current node timed out during startup"
NODE_START_ATTEMPTS = 3

#: A unix socket path must fit in 107 bytes; Ray puts ``session_<date>_<pid>/sockets/plasma_store``
#: (about 60 bytes) under the temp dir.
_MAX_TEMP_DIR_LEN = 45


class LocalRayError(ResilienceError):
    """A local Ray cluster or node could not be started, reached or stopped."""


#: The lowest port a node's fixed ports are drawn from; they lie below the kernel's ephemeral range.
_FIXED_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (bind(0), outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class _PortPool:
    """Free ports for a node's fixed ports (GCS, node manager, agents...), never handed out twice
    by one cluster.

    Drawn at random below the kernel's ephemeral range: a port taken from that range (bind to
    port 0) is free only until someone else is given it, and between the draw and ``ray start``
    binding it (seconds, tens of seconds on a loaded machine) any outgoing connection or bind to
    port 0 on the machine could be.  Below the range only another explicit bind can take it: a
    clash needs another cluster to draw the same port meanwhile.  (Dec 3: in three of six loaded
    runs the head of tests/ray/test_requeue.py did not start or its GCS stopped answering; a
    port taken in that window fits, but was not shown.)
    """

    def __init__(self) -> None:
        self._given: set[int] = set()
        self._random = random.Random()
        self._high = _ephemeral_low() - 1  # read once: the kernel's range does not change under a run
        self._low = _FIXED_PORTS_FROM if self._high - _FIXED_PORTS_FROM >= 1000 else 1024

    def take(self) -> int:
        low, high = self._low, self._high
        for _ in range(200):
            port = self._random.randint(low, high)
            if port not in self._given and _bindable(port):
                self._given.add(port)
                return port
        raise LocalRayError(f"no free TCP port found in {low}-{high}")


@dataclass(frozen=True)
class NodeInfo:
    """One node as the GCS lists it."""

    node_id: str  # hex
    address: str  # node manager address (ip)
    port: int  # node manager port
    labels: Mapping[str, str]
    alive: bool
    draining: bool
    draining_deadline_ms: int | None  # None: not draining, or draining without a deadline
    is_head: bool


@dataclass
class LocalRayNode:
    """A node this cluster started: one ``ray start --block`` process group."""

    name: str
    labels: dict[str, str]
    num_cpus: int
    node_manager_port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path
    #: the ``ray start`` command line and environment it was started with (a restart reuses them)
    command: list[str] = field(default_factory=list, repr=False)
    environment: dict[str, str] = field(default_factory=dict, repr=False)
    node_id: str = ""  # hex, set once the GCS lists the node ALIVE
    is_head: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pgid(self) -> int:
        """The node's process group: ``ray start`` runs under setsid, so it equals its pid."""
        return self.process.pid

    def running(self) -> bool:
        """Whether the node's ``ray start`` process has not exited."""
        return self.process.poll() is None

    def reaped(self) -> bool:
        """Whether this process has collected ``ray start``'s exit status.  From then on its pid,
        the id of the node's process group, may be another process's (pids are reused, within
        minutes on a busy machine with ``pid_max`` 32768): the node is signalled by pid or group
        only before, and found by its marker after."""
        return self.process.returncode is not None


class LocalRayCluster:
    """A head node (``head_num_cpus`` CPUs, 0 by default) plus worker nodes added one at a time.

    Args:
        workdir: holds the cluster's ``--temp-dir`` (``<workdir>/ray``) and the nodes' logs
            (``<workdir>/logs``).  Must be short: Ray's unix sockets live under the temp dir.
        auth_token: the cluster's token; one is generated when None.
        head_num_cpus: CPUs the head offers to tasks (0: the head runs no training workers).
        head_labels: labels of the head node.
        env: extra environment for every node process and in :attr:`env` (for example
            ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``).
        start_timeout_s: how long one node may take to be listed ALIVE by the GCS (180 s: a guard
            against a hang; a `ray start` took over 90 s on a 2-core machine at load average 25).
        object_store_memory: bytes of object store per node (small: tests share one machine).
        redis_address: ``host:port`` of a Redis the GCS keeps the cluster's state in (GCS fault
            tolerance, configured as KubeRay does: see the module docstring), so that the cluster
            survives :meth:`restart_head`.  None (the default): the GCS keeps it in memory.
    """

    def __init__(
        self,
        *,
        workdir: Path,
        auth_token: str | None = None,
        head_num_cpus: int = 0,
        head_labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 180.0,
        object_store_memory: int = 100 * 1024 * 1024,
        redis_address: str | None = None,
    ) -> None:
        if head_num_cpus < 0:
            raise ValueError(f"head_num_cpus must be >= 0, got {head_num_cpus}")
        if auth_token is not None and (not auth_token or any(c.isspace() for c in auth_token)):
            raise ValueError("auth_token must be a non-empty string without whitespace")
        self.workdir = Path(workdir).absolute()
        self.temp_dir = self.workdir / "ray"
        if len(str(self.temp_dir)) > _MAX_TEMP_DIR_LEN:
            raise ValueError(
                f"workdir {str(self.workdir)!r} is too long for Ray's unix sockets: the temp dir "
                f"{str(self.temp_dir)!r} must be at most {_MAX_TEMP_DIR_LEN} characters"
            )
        self.auth_token = auth_token or secrets.token_hex(32)
        self.head_num_cpus = head_num_cpus
        self.head_labels = dict(head_labels or {})
        self._extra_env = dict(env or {})
        self._start_timeout_s = start_timeout_s
        self._object_store_memory = object_store_memory
        self._ports = _PortPool()
        self.gcs_port = 0
        self.address = ""
        self.head: LocalRayNode | None = None
        self.workers: list[LocalRayNode] = []
        self._counter = 0
        self._cluster_id = secrets.token_hex(8)
        self.redis_address = redis_address
        self._lock = threading.Lock()
        self._started = False

    # ------------------------------------------------------------------ environment
    @property
    def env(self) -> dict[str, str]:
        """Environment variables a driver, GCS client or joining node of this cluster needs."""
        env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.auth_token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        if self.address:
            env["RAY_ADDRESS"] = self.address
        env.update(self._extra_env)
        return env

    def _process_env(self, *, head: bool = False) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env.pop("RAY_ADDRESS", None)
        env.update(self.env)
        env.pop("RAY_ADDRESS", None)  # `ray start --address` says where; RAY_ADDRESS would too
        if self.redis_address:  # GCS fault tolerance, as KubeRay sets it (module docstring)
            if head:
                env["RAY_REDIS_ADDRESS"] = self.redis_address
                env["RAY_external_storage_namespace"] = self._cluster_id
            else:
                env.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "600")
        return env

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the head on 127.0.0.1 and wait until the GCS lists it ALIVE (a start that Ray
        gave up on is made again on a new GCS port, :data:`NODE_START_ATTEMPTS` in all)."""
        if self._started:
            return
        self._started = True
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        def start_head() -> LocalRayNode:
            self.gcs_port = self._ports.take()
            self.address = f"127.0.0.1:{self.gcs_port}"
            return self._start_node(head=True, labels=self.head_labels, num_cpus=self.head_num_cpus,
                                    resources=None)

        try:
            self.head = _with_attempts(start_head)
        except BaseException:
            self.stop()
            raise

    def add_node(
        self,
        *,
        labels: Mapping[str, str],
        num_cpus: int = 1,
        resources: Mapping[str, float] | None = None,
        node_ip: str = "127.0.0.1",
    ) -> LocalRayNode:
        """Start a worker node (``ray start --block`` under setsid) and wait until it is ALIVE.

        ``node_ip``: the node's address, a loopback one (``127.0.0.2``, ...) to give workers
        distinct addresses (a Kubernetes pod IP, an EC2 private IP): a worker started so reports
        it as its node manager address.
        """
        if not node_ip.startswith("127."):
            raise ValueError(f"node_ip must be a loopback address (127.x.y.z), got {node_ip!r}")
        if self.head is None:
            raise LocalRayError("start() the cluster before adding nodes")
        if num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
        _check_labels(labels)
        with self._lock:  # one node start at a time: concurrent starts time out on 2 cores
            node = _with_attempts(lambda: self._start_node(head=False, labels=labels, num_cpus=num_cpus,
                                                           resources=resources, node_ip=node_ip))
            self.workers.append(node)
            return node

    def _start_node(
        self,
        *,
        head: bool,
        labels: Mapping[str, str],
        num_cpus: int,
        resources: Mapping[str, float] | None,
        node_ip: str = "127.0.0.1",
    ) -> LocalRayNode:
        self._counter += 1
        name = "head" if head else f"node{self._counter - 1}"
        node_manager_port = self._ports.take()
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--node-ip-address={node_ip}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={self._object_store_memory}",
            "--disable-usage-stats",
            f"--node-manager-port={node_manager_port}",
            f"--object-manager-port={self._ports.take()}",
            f"--dashboard-agent-listen-port={self._ports.take()}",
            f"--dashboard-agent-grpc-port={self._ports.take()}",
            f"--runtime-env-agent-port={self._ports.take()}",
            f"--metrics-export-port={self._ports.take()}",
            "--min-worker-port=0",
            "--max-worker-port=0",
        ]
        if head:
            cmd += [
                "--head",
                f"--port={self.gcs_port}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
                f"--dashboard-port={self._ports.take()}",
            ]
        else:
            # One log monitor per machine: every node here shares the head's session directory,
            # and a monitor per node would send every worker log line to drivers once per node.
            cmd += [f"--address={self.address}", "--include-log-monitor=false"]
        if labels:
            cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if resources:
            import json

            cmd.append("--resources=" + json.dumps(dict(resources)))
        log_path = self.workdir / "logs" / f"{name}.log"
        environment = {**self._process_env(head=head), _NODE_MARKER: f"{self._cluster_id}/{name}"}
        node = LocalRayNode(
            name=name,
            labels=dict(labels),
            num_cpus=num_cpus,
            node_manager_port=node_manager_port,
            process=self._popen(cmd, environment, log_path),
            log_path=log_path,
            is_head=head,
            command=cmd,
            environment=environment,
        )
        if head:
            self.head = node
        try:
            node.node_id = self._wait_alive(node)
        except BaseException:
            self._kill_group(node)
            raise
        return node

    def _popen(self, cmd: list[str], environment: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd=self.workdir,
                start_new_session=True,
            )

    def restart_head(self, *, exit_timeout_s: float = 30.0) -> LocalRayNode:
        """Start the head again, with the command line and environment it was first started with.

        As the kubelet restarts a head Pod's container: first the old head must be gone (its
        ``ray start --block`` exits by itself once its GCS died, see the module docstring; it is
        waited for up to ``exit_timeout_s``, then killed), then the same ``ray start`` runs again,
        on the same ports.  Returns the head, with the node id its new raylet registered under
        (a restarted raylet is a new node).  Only a cluster with ``redis_address`` keeps its
        workers and its state across this.
        """
        old = self.head
        if old is None:
            raise LocalRayError("start() the cluster before restarting its head")
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.process.wait(timeout=exit_timeout_s)
        self._kill_group(old)
        # A restarted container has a fresh filesystem, without the ``ray_current_cluster`` file
        # the first start wrote into the temp dir. Here it stays, and ``ray start --head``
        # refuses to start when that file names its own address and a raylet on this machine
        # (a worker's, here) carries that ``--gcs-address`` (Ray 2.60 ray/scripts/scripts.py
        # "Fail early when starting a new cluster when one is already running";
        # ray/_common/utils.py ``get_ray_address_file``): it goes, as in a new container.
        (self.temp_dir / "ray_current_cluster").unlink(missing_ok=True)
        node = LocalRayNode(
            name=old.name,
            labels=dict(old.labels),
            num_cpus=old.num_cpus,
            node_manager_port=old.node_manager_port,
            process=self._popen(old.command, old.environment, old.log_path),
            log_path=old.log_path,
            is_head=True,
            command=old.command,
            environment=old.environment,
        )
        self.head = node
        try:
            node.node_id = self._wait_alive(node, not_id=old.node_id)
        except BaseException:
            self._kill_group(node)
            raise
        return node

    def _wait_alive(self, node: LocalRayNode, *, not_id: str = "") -> str:
        deadline = time.monotonic() + self._start_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if node.process.poll() is not None:
                raise LocalRayError(
                    f"ray start for {node.name} exited with code {node.process.returncode}; "
                    f"see {node.log_path}:\n{_tail(node.log_path)}{self._gcs_log_tail()}"
                )
            if node.is_head and not _listening(self.gcs_port):
                # no GCS yet: a GCS client would wait its ~30 s for the cluster's id, and a
                # ``ray start`` that exits meanwhile would be seen only after that
                last_error = LocalRayError(f"nothing listens on the GCS port {self.gcs_port} yet")
                time.sleep(0.25)
                continue
            try:
                for info in self._node_infos(timeout_s=5.0):
                    # a restarted node reuses its port: the old entry may still be listed ALIVE
                    if info.port == node.node_manager_port and info.alive and info.node_id != not_id:
                        return info.node_id
            except LocalRayError as e:  # the GCS is not up yet
                last_error = e
            time.sleep(0.25)
        raise LocalRayError(
            f"{node.name} was not listed ALIVE by the GCS at {self.address} within "
            f"{self._start_timeout_s}s (last error: {last_error}); see {node.log_path}:\n"
            f"{_tail(node.log_path)}{self._gcs_log_tail()}"
        )

    def _gcs_log_tail(self, lines: int = 12) -> str:
        """The end of the GCS's log, for a node start's error: whether the GCS was up, and what
        it last did (the temp dir, and so the log, is gone once the failed cluster is stopped)."""
        log = self.temp_dir / "session_latest" / "logs" / "gcs_server.out"
        return f"\nthe GCS's log ({log.name}), last {lines} lines:\n{_tail(log, lines)}"

    # ------------------------------------------------------------------ failures
    def sigterm_node(self, node: LocalRayNode) -> None:
        """SIGTERM to the node's ``ray start`` (a pod's PID 1): Ray drains the node itself."""
        if node.process.poll() is None:  # not reaped: the pid is still this node's
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGTERM)

    def kill_node(self, node: LocalRayNode) -> None:
        """SIGKILL the node's whole process group: the instance is gone."""
        self._kill_group(node)

    def terminate_node(self, node: LocalRayNode, *, grace_s: float = 2.0) -> None:
        """The instance is terminated as EC2's default terminate does it: a graceful OS shutdown
        ("Normal instance shutdown with attempted graceful OS shutdown", EC2 User Guide,
        instance-terminate-methods), so every process gets SIGTERM (the raylet then leaves the
        GCS at once: the node is seen dead in ~0.1 s, against ~17 s of health checks after a
        SIGKILL, measured here), then, after ``grace_s``, the power goes (SIGKILL)."""
        if not node.reaped():
            doomed = _descendants(node.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pgid, signal.SIGTERM)
            for pid in doomed:  # Ray workers run in process groups of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=grace_s)
        self._kill_group(node)

    def drain_node(
        self,
        node: LocalRayNode | str,
        *,
        deadline_ms: int,
        reason: str = "DRAIN_NODE_REASON_PREEMPTION",
        message: str = "resilienced local drain",
    ) -> bool:
        """Ask the GCS to drain a node, as the daemon does; returns whether it was accepted."""
        from ray.core.generated import autoscaler_pb2

        node_id = node.node_id if isinstance(node, LocalRayNode) else node
        try:
            reason_value = autoscaler_pb2.DrainNodeReason.Value(reason)
        except ValueError as e:
            raise ValueError(f"unknown drain reason {reason!r}") from e
        with self._gcs() as gcs:
            try:
                accepted, error = gcs.drain_node(node_id, reason_value, message, int(deadline_ms))
            except Exception as e:
                raise LocalRayError(f"drain of node {node_id} at {self.address} failed: {e}") from e
        if not accepted:
            raise LocalRayError(f"drain of node {node_id} was rejected: {error}")
        return bool(accepted)

    # ------------------------------------------------------------------ observation
    def nodes(self) -> list[NodeInfo]:
        """Every node the GCS knows (alive or dead), with labels and drain state."""
        return self._node_infos(timeout_s=10.0)

    def wait_for(
        self, predicate, *, timeout_s: float, what: str, interval_s: float = 0.25
    ) -> list[NodeInfo]:
        """Poll :meth:`nodes` until ``predicate(nodes)`` holds; raise naming ``what`` if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.nodes()
            if predicate(nodes):
                return nodes
            if time.monotonic() >= deadline:
                raise LocalRayError(f"timed out after {timeout_s}s waiting for {what}: {nodes}")
            time.sleep(interval_s)

    def processes(self, node: LocalRayNode | None = None) -> list[int]:
        """Pids of the live processes of this cluster (or of one node), found by their marker."""
        prefix = f"{self._cluster_id}/{node.name}" if node else f"{self._cluster_id}/"
        return [pid for pid in _marked(prefix) if _alive(pid)]

    def _node_infos(self, *, timeout_s: float) -> list[NodeInfo]:
        with self._gcs() as gcs:
            try:
                infos = gcs.get_all_node_info(timeout=timeout_s)
                draining = gcs.get_draining_nodes()
            except Exception as e:
                raise LocalRayError(f"GCS at {self.address} did not answer: {e}") from e
        out = []
        for node_id, info in infos.items():
            hex_id = node_id.hex()
            deadline = draining.get(hex_id)
            out.append(
                NodeInfo(
                    node_id=hex_id,
                    address=info.node_manager_address,
                    port=info.node_manager_port,
                    labels={k: v for k, v in info.labels.items()},
                    alive=info.state == _ALIVE,
                    draining=hex_id in draining,
                    draining_deadline_ms=deadline or None,
                    is_head=bool(info.is_head_node),
                )
            )
        return out

    @contextlib.contextmanager
    def _gcs(self) -> Iterator[object]:
        """A GCS client for this cluster, under the process-wide token switch of
        ``resilienced.ray.gcs``: the drill runs the daemon's GCS calls (another token handling) in
        this process, and two threads swapping Ray's auth environment at once end the process."""
        from ray._raylet import GcsClient

        from resilienced.ray.gcs import TOKEN_SWITCH

        if not self.address:
            raise LocalRayError("the cluster is not started")
        with TOKEN_SWITCH.using(self.auth_token, wait_s=60.0, address=self.address):
            try:
                client = GcsClient(address=self.address)
            except Exception as e:  # Ray's RpcError: no GCS there (yet, or any more)
                raise LocalRayError(f"GCS at {self.address} did not answer: {e}") from e
            yield client

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Stop every node this cluster started and remove its temp dir; idempotent."""
        nodes = [*self.workers, *([self.head] if self.head else [])]
        for node in nodes:  # workers first, the head (GCS) last
            self._kill_group(node)
        _sweep(f"{self._cluster_id}/")
        self.workers = []
        self.head = None
        self.address = ""
        if self.temp_dir.exists():
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_group(self, node: LocalRayNode) -> None:
        """SIGKILL the node's group, its descendants and every process carrying its marker.

        Ray workers run in process groups of their own, and a worker whose raylet died first is
        no longer a descendant: the marker in their environment finds them all.  The group and
        the process tree are signalled only while ``ray start`` is not reaped (its pid, the
        group's id, cannot be another's yet); a node stopped before (killed, terminated, or
        ended by its own drain) is found by its marker alone.  Before, the cluster's stop sent
        SIGKILL to the group id and the descendants of the pid of a node killed minutes earlier,
        an id a busy machine may have given to another test's processes since.
        """
        if not node.reaped():
            doomed = _descendants(node.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pgid, signal.SIGKILL)
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=30)
        # Until none of the node's processes runs (a zombie left for init to reap does not count).
        deadline = time.monotonic() + 30
        while (left := self.processes(node)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def __enter__(self) -> "LocalRayCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_labels(labels: Mapping[str, str]) -> None:
    for key, value in labels.items():
        if not key or any(c in key for c in ",= ") or any(c in str(value) for c in ",= "):
            raise ValueError(f"node label {key!r}={value!r} must not be empty or contain ',', '=' or spaces")
    capacity = labels.get(CAPACITY_TYPE_LABEL)
    if capacity is not None and capacity not in CAPACITY_TYPES:
        raise ValueError(f"label {CAPACITY_TYPE_LABEL}={capacity!r}: expected one of {CAPACITY_TYPES}")


def _proc_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, process group) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in _proc_pids():
        stat = _proc_stat(p)
        if stat is not None:
            children.setdefault(stat[1], []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _running(stat: tuple[str, int, int] | None) -> bool:
    """Whether a :func:`_proc_stat` is of a process that still runs (not gone, not a zombie)."""
    return stat is not None and stat[0] not in ("Z", "X")


def _alive(pid: int) -> bool:
    return _running(_proc_stat(pid))


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _marked(marker_prefix: str) -> list[int]:
    """Pids whose environment carries a node marker starting with the prefix (not this one).

    A prefix ending in ``/`` (``<cluster>/``) matches every node of the cluster; any other is a
    whole marker (``<cluster>/node1`` is not ``<cluster>/node12``)."""
    needle = f"{_NODE_MARKER}={marker_prefix}".encode()
    exact = not marker_prefix.endswith("/")
    me = os.getpid()
    return [pid for pid in _proc_pids() if pid != me
            and any(entry == needle if exact else entry.startswith(needle) for entry in _environ(pid))]


def _environ(pid: int) -> list[bytes]:
    """A process's environment entries (``NAME=value``); none when it is gone or not ours."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def group_members_with(pgid: int, env_entry: str) -> list[int]:
    """Running processes of process group ``pgid`` whose environment holds ``env_entry``
    (``NAME=value``): what is left of a group after its leader was reaped, and only it (another
    group may have been given the same id since; its processes do not carry the entry)."""
    needle, me = env_entry.encode(), os.getpid()
    return [pid for pid in _proc_pids()
            if pid != me and _in_group(_proc_stat(pid), pgid) and needle in _environ(pid)]


def _in_group(stat: tuple[str, int, int] | None, pgid: int) -> bool:
    return _running(stat) and stat is not None and stat[2] == pgid


def _sweep(marker_prefix: str) -> None:
    """SIGKILL every process whose environment carries a node marker starting with the prefix."""
    found = _marked(marker_prefix)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(found)


def _with_attempts(start: Callable[[], LocalRayNode]) -> LocalRayNode:
    """``start()`` a node, again while Ray gives up on its raylet, :data:`NODE_START_ATTEMPTS` in
    all; any other failure is raised at once (a failed start has stopped its processes already)."""
    for _ in range(NODE_START_ATTEMPTS - 1):
        try:
            return start()
        except LocalRayError as error:
            if _RAYLET_TIMED_OUT not in str(error):
                raise
    return start()


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
