"""The Ray auth token for a KubeRay cluster, in the three modes KubeRay's ``spec.authOptions`` has.

What KubeRay does (ray-project/kuberay, ray-operator; read at HEAD feeaf72):

* ``authOptions`` absent, or ``mode`` not ``token``: no auth env is given to the Ray pods
  (``utils.IsAuthEnabled``: ``AuthOptions != nil && Mode == "token"``), so the GCS takes no token.
  Here: ``None``.
* ``mode: token`` (the default the API documents), ``enableK8sTokenAuth`` unset: the token is in
  a Secret, data key ``auth_token``.  The Secret is ``authOptions.secretName`` when set (the user
  made it), else one the operator generates, named ``utils.CheckName(<cluster name>)`` (the
  cluster's own name, trimmed to 50 characters), with a random 32-byte base64 token, labelled
  ``ray.io/cluster`` and owned by the RayCluster (``raycluster_controller.go`` ``reconcileAuthSecret``,
  ``createAuthSecret``; pods get ``RAY_AUTH_TOKEN`` from it in ``common/pod.go``
  ``SetContainerTokenAuthEnvVars``).  Here: one namespaced GET of that Secret by name (no list or
  watch of Secrets: the RBAC names the Secrets).
* ``mode: token`` with ``enableK8sTokenAuth: true`` (Ray >= 2.55; validation rejects it together
  with ``secretName``): pods get ``RAY_ENABLE_K8S_TOKEN_AUTH=true`` and a projected ServiceAccount
  token, and no Secret exists.  Ray's client then sends a Kubernetes ServiceAccount token as its
  bearer token (Ray ``src/ray/rpc/authentication/authentication_token_loader.cc``: after
  ``RAY_AUTH_TOKEN`` and ``RAY_AUTH_TOKEN_PATH``, it reads the ServiceAccount token file), and the
  GCS checks it with a TokenReview, then a SubjectAccessReview for verb ``ray:write`` on
  ``rayclusters.ray.io/<name>`` in the cluster's namespace (``k8s_util.cc`` ``ValidateToken``,
  ``k8s_constants.h``).  Here: the daemon's own ServiceAccount token, re-read from its file at each
  use (the kubelet rotates projected tokens), and the daemon's ServiceAccount needs the
  ``ray:write`` verb on the RayClusters it drains.

A missing Secret, a Secret without ``auth_token``, a refused GET, or a missing ServiceAccount
token file is a :class:`~resilienced.errors.RayAuthError` that says which of these it is.  A wrong
token is found out by the GCS; the RayControl adapter raises RayAuthError for it.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kubernetes_asyncio import client as k8s

from resilienced.errors import RayAuthError
from resilienced.kube.api import KubeStatusError, call
from resilienced.kube.locate import name_of, namespace_of, secret_name_for, uid_of
from resilienced.model import JsonValue

SECRET_KEY = "auth_token"  # KubeRay's RAY_AUTH_TOKEN_SECRET_KEY

MODE_NONE = "none"
MODE_SECRET = "secret"
MODE_KUBERNETES = "kubernetes"


def auth_mode(raycluster: Mapping[str, JsonValue]) -> str:
    """``none`` | ``secret`` | ``kubernetes``: how the cluster's GCS authenticates callers."""
    options = (raycluster.get("spec") or {}).get("authOptions")
    if not isinstance(options, Mapping) or options.get("mode") != "token":
        return MODE_NONE
    return MODE_KUBERNETES if options.get("enableK8sTokenAuth") is True else MODE_SECRET


def auth_secret_name(raycluster: Mapping[str, JsonValue]) -> str:
    """The Secret holding the token in ``secret`` mode: ``authOptions.secretName``, else KubeRay's generated one."""
    options = (raycluster.get("spec") or {}).get("authOptions") or {}
    return options.get("secretName") or secret_name_for(name_of(raycluster))


class RayTokens:
    """Finds, and briefly caches, the token for each RayCluster.

    ``ttl_s`` bounds how long a token read from a Secret is reused (a burst of notices for one
    cluster costs one GET); :meth:`forget` drops a cluster's token when the GCS refused it.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        service_account_token_path: str | Path,
        ttl_s: float = 60.0,
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self._sa_token_path = Path(service_account_token_path)
        self._ttl_s = ttl_s
        self._timeout = request_timeout_s
        self._clock = clock
        self._cache: dict[tuple[str, str], tuple[float, str | None]] = {}

    def forget(self, raycluster: Mapping[str, JsonValue]) -> None:
        self._cache.pop((namespace_of(raycluster), uid_of(raycluster) or name_of(raycluster)), None)

    async def token_for(self, raycluster: Mapping[str, JsonValue]) -> str | None:
        """The token to send to this cluster's GCS, or None when it takes none."""
        mode = auth_mode(raycluster)
        if mode == MODE_NONE:
            return None
        if mode == MODE_KUBERNETES:
            return self._service_account_token(raycluster)
        key = (namespace_of(raycluster), uid_of(raycluster) or name_of(raycluster))
        cached = self._cache.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        token = await self._secret_token(raycluster)
        self._cache[key] = (self._clock() + self._ttl_s, token)
        return token

    def _service_account_token(self, raycluster: Mapping[str, JsonValue]) -> str:
        where = f"RayCluster {namespace_of(raycluster)}/{name_of(raycluster)}"
        try:
            token = self._sa_token_path.read_text().strip()
        except OSError as err:
            raise RayAuthError(
                f"{where} delegates Ray auth to Kubernetes (authOptions.enableK8sTokenAuth) but the "
                f"daemon's ServiceAccount token cannot be read at {self._sa_token_path}: {err}"
            ) from err
        if not token:
            raise RayAuthError(f"{where}: the ServiceAccount token file {self._sa_token_path} is empty")
        return token

    async def _secret_token(self, raycluster: Mapping[str, JsonValue]) -> str:
        ns, secret = namespace_of(raycluster), auth_secret_name(raycluster)
        where = f"RayCluster {ns}/{name_of(raycluster)} (authOptions.mode=token)"
        try:
            body = await call(verb="get", resource="secrets", request=self._core.read_namespaced_secret(
                secret, ns, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status == 404:
                raise RayAuthError(f"{where}: its auth token Secret {ns}/{secret} does not exist") from err
            if err.status == 403:
                raise RayAuthError(
                    f"{where}: the daemon may not read the auth token Secret {ns}/{secret} "
                    "(grant get on it, by resourceNames, in a Role in that namespace)"
                ) from err
            raise
        encoded = (body.get("data") or {}).get(SECRET_KEY)
        if not encoded:
            raise RayAuthError(f"{where}: Secret {ns}/{secret} has no data key {SECRET_KEY!r}")
        try:
            token = base64.b64decode(encoded, validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError) as err:
            raise RayAuthError(f"{where}: Secret {ns}/{secret} key {SECRET_KEY!r} is not base64 text") from err
        if not token:
            raise RayAuthError(f"{where}: Secret {ns}/{secret} key {SECRET_KEY!r} is empty")
        return token
