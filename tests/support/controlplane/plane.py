"""The real control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok, the KubeRay operator and Kueue, built from source (``build.py``).

:class:`ControlPlane` starts what ``components`` names (the API server and etcd always), on
127.0.0.1 and free ports, in a work folder of its own, and stops everything it started (SIGTERM,
then SIGKILL; every child also dies with the process that started it, ``PR_SET_PDEATHSIG``).

The API server runs as envtest starts it (controller-runtime
``pkg/internal/testing/controlplane/apiserver.go`` ``defaultArgs``): secure serving with a CA of
the plane's own, RBAC authorization (``--authorization-mode=Node,RBAC``), a ServiceAccount issuer
and signing key (so TokenRequest mints real tokens), and the ``ServiceAccount`` admission plugin
off as envtest has it ("this SA is created by controller, but that is not run in integration
environment"); an admin token of ``system:masters`` for the tests' own set-up; an audit log of
every request (``audit.log``), which stands in for the emulator's request log.  It is written in
``blocking`` mode: a request's entry is in the file when its answer is sent (``batch`` mode can
drop entries when its buffer is full, ``k8s.io/apiserver`` ``plugin/pkg/audit/buffered``, "audit
buffer queue blocked"; not seen here, but a count must not depend on it).  It is never rotated: the apiserver's writer (``gopkg.in/natefinch/lumberjack``)
rotates at 100 MB when ``--audit-log-maxsize`` is 0, and kwok's Node heartbeats for a thousand Nodes
fill that in minutes (the third wave of ``bench/mass.py`` found a log that began after it).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from . import build
from .pki import Pair, TinyCA, service_account_key
from .rest import Rest, RestError

COMPONENTS = ("apiserver", "scheduler", "controller-manager", "kwok", "kuberay", "kueue")
#: Seconds a component gets to answer after its start (Kubernetes' own integration framework waits
#: 60 s for an API server on a loaded runner: kubernetes/kubernetes#137743).
START_TIMEOUT_S = 90.0
ADMIN_USER = "resilienced-test-admin"

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StartError(RuntimeError):
    """A component did not start; the message carries the end of its log."""


@dataclass
class Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    _log_file: TextIO | None = None

    def start(self, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self._log_file = open(self.log, "w")
        self.popen = subprocess.Popen(self.argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                      preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _wait(what: str, check: Any, *, process: Process, timeout: float = START_TIMEOUT_S) -> None:
    """Poll ``check()`` until it returns true; :class:`StartError` with the log when the process
    ends or the time runs out."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if not process.alive():
            raise StartError(f"{process.name} exited ({process.popen.returncode if process.popen else '?'}) "
                             f"before {what}; the end of {process.log}:\n{process.tail()}")
        try:
            if check():
                return
        except Exception as err:  # noqa: BLE001 - not up yet; kept for the message
            last = err
        time.sleep(0.1)
    raise StartError(f"{process.name}: no {what} after {timeout:.0f} s (last: {last!r}); the end of "
                     f"{process.log}:\n{process.tail()}")


@dataclass
class ControlPlane:
    """See the module docstring.  ``start()``, then ``url``, ``ca``, ``admin`` (a :class:`Rest`),
    ``kubeconfig(...)``; ``stop()``."""

    components: Sequence[str] = COMPONENTS
    workdir: Path | None = None
    processes: list[Process] = field(default_factory=list)
    audit: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown control-plane component(s) {sorted(unknown)}: choose from {COMPONENTS}")
        self.components = [c for c in COMPONENTS if c in self.components or c == "apiserver"]
        self._own_workdir = self.workdir is None
        self.admin_token = secrets.token_hex(16)
        self.port = 0
        self._admin: Rest | None = None

    # ------------------------------------------------------------------ addresses and clients
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "pki" / "ca.crt"

    @property
    def admin(self) -> Rest:
        if self._admin is None:
            self._admin = Rest(self.url, token=self.admin_token, ca=self.ca)
        return self._admin

    @property
    def audit_log(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "audit.log"

    def kubeconfig(self, *, token: str | None = None, namespace: str = "default", context: str = "real") -> dict[str, Any]:
        """A kubeconfig for ``token`` (the admin's when None)."""
        return {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": context, "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
        }

    def configuration(self, *, token: str | None = None) -> Any:
        """A kubernetes_asyncio Configuration for ``token`` (the admin's when None), verified by the CA."""
        from kubernetes_asyncio import client as k8s

        config = k8s.Configuration(host=self.url)
        config.ssl_ca_cert = str(self.ca)
        config.api_key = {"BearerToken": token or self.admin_token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def api_client(self, *, token: str | None = None) -> Any:
        """A new kubernetes_asyncio ApiClient (the caller closes it)."""
        from kubernetes_asyncio import client as k8s

        return k8s.ApiClient(self.configuration(token=token))

    def write_kubeconfig(self, path: str | Path, *, token: str | None = None, namespace: str = "default") -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig(token=token, namespace=namespace)))
        return path

    def running(self) -> list[str]:
        return [p.name for p in self.processes if p.alive()]

    # ------------------------------------------------------------------ start and stop
    def start(self) -> ControlPlane:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="resilienced-cp-"))
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process started, the last started first (idempotent)."""
        while self.processes:
            self.processes.pop().stop()
        if self._own_workdir and self.workdir is not None and not os.environ.get("RESILIENCED_CP_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _start(self) -> None:
        assert self.workdir is not None
        pki = self.workdir / "pki"
        self._ca = TinyCA(pki)
        self._serving = self._ca.serving("apiserver")
        self._sa = service_account_key(pki)
        self._start_etcd()
        self._start_apiserver()
        self.admin_kubeconfig = self.write_kubeconfig(self.workdir / "admin.kubeconfig")
        from .crds import install_crds

        install_crds(self)
        if "controller-manager" in self.components:
            self._start_controller_manager()
        if "scheduler" in self.components:
            self._start_scheduler()
        if "kwok" in self.components:
            self._start_kwok()
        if "kuberay" in self.components:
            self._start_kuberay()
        if "kueue" in self.components:
            self._start_kueue()

    def _spawn(self, name: str, argv: list[str], **kwargs: Any) -> Process:
        assert self.workdir is not None
        process = Process(name, [str(a) for a in argv], self.workdir / f"{name}.log")
        process.start(**kwargs)
        self.processes.append(process)
        return process

    def _start_etcd(self) -> None:
        assert self.workdir is not None
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        process = self._spawn("etcd", [
            build.program("etcd"), "--name=default", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}", "--unsafe-no-fsync=true",
            "--log-level=warn", "--quota-backend-bytes=2147483648"])

        def healthy() -> bool:
            import urllib.request

            with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as r:
                return bool(json.loads(r.read()).get("health") == "true")

        _wait("/health", healthy, process=process)

    def _start_apiserver(self) -> None:
        assert self.workdir is not None
        self.port = free_port()
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        policy = self.workdir / "audit-policy.yaml"
        # Metadata level: who did what to which object, no bodies (kept small; bench/ counts verbs)
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived"],
                                          "rules": [{"level": "Metadata"}]}))
        argv = [
            build.program("kube-apiserver"), f"--etcd-servers={self.etcd_url}",
            f"--cert-dir={self.workdir / 'pki'}", f"--tls-cert-file={self._serving.cert}",
            f"--tls-private-key-file={self._serving.key}", f"--client-ca-file={self._ca.cert}",
            f"--secure-port={self.port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
            "--authorization-mode=Node,RBAC", f"--token-auth-file={tokens}",
            "--disable-admission-plugins=ServiceAccount",
            f"--service-account-issuer=https://127.0.0.1:{self.port}",
            f"--service-account-key-file={self._sa.cert}", f"--service-account-signing-key-file={self._sa.key}",
            "--default-not-ready-toleration-seconds=5", "--default-unreachable-toleration-seconds=5",
            "--etcd-compaction-interval=0", "--enable-priority-and-fairness=false",
            "--max-requests-inflight=0", "--max-mutating-requests-inflight=0",
            "--endpoint-reconciler-type=none", "--v=0",
        ]
        if self.audit:
            argv += [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
                     "--audit-log-format=json", "--audit-log-mode=blocking",
                     "--audit-log-maxsize=100000"]  # MB: never rotated (0 is lumberjack's default, 100 MB)
        process = self._spawn("kube-apiserver", argv)
        _wait("/readyz", lambda: self.admin.text("/readyz").strip() == "ok", process=process)

    def _component_kubeconfig(self, name: str) -> Path:
        assert self.workdir is not None
        return self.write_kubeconfig(self.workdir / f"{name}.kubeconfig")

    def _secure_healthz(self, port: int) -> Any:
        import ssl
        import urllib.request

        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the component's self-signed serving certificate

        def check() -> bool:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as r:
                return r.read().strip() == b"ok"

        return check

    def _component_args(self, name: str, *, port: int, certs: str) -> list[str]:
        """The program and the flags the controller-manager and the scheduler share: a kubeconfig of
        their own (also to authenticate and authorize their clients), no leader election, secure
        serving on 127.0.0.1:``port`` with self-made certificates in ``certs``."""
        assert self.workdir is not None
        kubeconfig = self._component_kubeconfig(name)
        return [build.program(name), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", f"--secure-port={port}",
                "--bind-address=127.0.0.1", f"--cert-dir={self.workdir / certs}"]

    def _start_controller_manager(self) -> None:
        assert self.workdir is not None
        port = free_port()
        process = self._spawn("kube-controller-manager", [
            *self._component_args("kube-controller-manager", port=port, certs="kcm-certs"),
            f"--service-account-private-key-file={self._sa.key}", f"--root-ca-file={self._ca.cert}",
            "--use-service-account-credentials=false", "--node-monitor-grace-period=20s",
            "--node-monitor-period=2s", "--concurrent-gc-syncs=5", "--v=0",
            # no cloud, no kubelet, no volumes: the controllers that need them stay off
            "--controllers=*,-node-ipam-controller,-persistentvolume-binder-controller,"
            "-persistentvolume-attach-detach-controller,-persistentvolume-expander-controller,"
            "-ephemeral-volume-controller,-horizontal-pod-autoscaler-controller",
        ])
        _wait("/healthz", self._secure_healthz(port), process=process)

    def _start_scheduler(self) -> None:
        assert self.workdir is not None
        port = free_port()
        process = self._spawn("kube-scheduler", [
            *self._component_args("kube-scheduler", port=port, certs="scheduler-certs"), "--v=0"])
        _wait("/healthz", self._secure_healthz(port), process=process)

    def _start_kwok(self) -> None:
        from .kwok import start_kwok

        start_kwok(self)

    def _start_kuberay(self) -> None:
        from .operators import start_kuberay

        start_kuberay(self)

    def _start_kueue(self) -> None:
        from .operators import start_kueue

        start_kueue(self)

    # ------------------------------------------------------------------ waiting on the API
    def wait_for(self, what: str, check: Any, *, timeout: float = 60.0) -> Any:
        """Poll ``check()`` (through ``admin``) until it returns a true value; that value."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                value = check()
                if value:
                    return value
            except RestError as err:
                last = err
            time.sleep(0.1)
        down = [p.name for p in self.processes if not p.alive()]
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r}; "
                             f"stopped components: {down or 'none'})")

    def logs(self, names: Iterable[str] | None = None, lines: int = 40) -> str:
        """The end of each named component's log (all when None), for a failed test's report."""
        return "\n".join(f"--- {p.name} ---\n{p.tail(lines)}" for p in self.processes
                         if names is None or p.name in names)


__all__ = ["COMPONENTS", "ControlPlane", "Pair", "StartError", "free_port"]
