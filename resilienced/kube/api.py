"""The boundary with kubernetes_asyncio: raw JSON calls, and the one place its errors are translated.

Every Kubernetes request of the kube package goes through :func:`call`, which awaits a
kubernetes_asyncio API call made with ``_preload_content=False`` (no model deserialisation: the
caches hold plain JSON objects), decodes the body and maps every failure::

    5xx, 429, connection errors, timeouts    -> BackendUnavailable("kubernetes", ...)   (retry later)
    403                                      -> KubeStatusError (a PermanentError) naming verb and resource
    401                                      -> KubeStatusError: the daemon's own credentials were refused
    other 4xx (404, 409, 410, 422 ...)       -> KubeStatusError with ``status``: callers handle the
                                                codes they expect (404 per call, 409 to retry), the
                                                rest stays a PermanentError

Nothing above this module sees an ``ApiException`` or an aiohttp error.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from resilienced.errors import BackendUnavailable, ConfigError, PermanentError
from resilienced.model import JsonValue

BACKEND = "kubernetes"

#: A Kubernetes object as the API answers it (JSON): a mapping read by its documented fields (``metadata``,
#: ``spec``, ``status``...), whose nested values are Any: the API server, not this code, holds their schema.
JsonObj = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeStatusError(PermanentError):
    """A definite 4xx answer from the API server (not 429): ``status`` says which.

    A PermanentError, so that one a caller did not expect ends as "give up on this target"
    with the verb and resource named; callers catch the codes they handle (404, 409, 410).
    """

    def __init__(self, *, verb: str, resource: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"kubernetes: {verb} {resource}: {status} {reason}: {message}")
        self.verb = verb
        self.resource = resource
        self.status = status
        self.reason = reason
        self.message = message


def _status_parts(status: int, reason: str | None, body: object) -> tuple[str, str]:
    message = ""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            message = str(decoded.get("message") or "")
            reason = str(decoded.get("reason") or reason or "")
        else:
            message = body[:200]
    return reason or str(status), message


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def translate(
    error: BaseException, *, verb: str, resource: str, headers: Mapping[str, str] | None = None
) -> Exception:
    """The resilienced error for a kubernetes_asyncio / aiohttp failure of ``verb`` on ``resource``."""
    if isinstance(error, ApiException):
        status = int(error.status or 0)
        reason, message = _status_parts(status, error.reason, error.body)
        if status == 0 or status >= 500 or status == 429:
            return BackendUnavailable(
                BACKEND, f"{verb} {resource}: {status} {reason} {message}".strip(),
                delay=_retry_after(headers or error.headers),
            )
        if status == 403:
            return KubeStatusError(
                verb=verb, resource=resource, status=403, reason=reason,
                message=f"forbidden: the daemon's ServiceAccount may not {verb} {resource} ({message})",
            )
        return KubeStatusError(verb=verb, resource=resource, status=status, reason=reason, message=message)
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return BackendUnavailable(BACKEND, f"{verb} {resource}: timed out")
    if isinstance(error, (aiohttp.ClientError, OSError)):
        return BackendUnavailable(BACKEND, f"{verb} {resource}: {type(error).__name__}: {error}")
    return BackendUnavailable(BACKEND, f"{verb} {resource}: unexpected {type(error).__name__}: {error}")


async def call(verb: str, resource: str, request: Awaitable[Any]) -> JsonObj:
    """Await a kubernetes_asyncio call made with ``_preload_content=False``; return its JSON body.

    ``request`` is Awaitable[Any]: kubernetes_asyncio types each call by the model it deserialises, and a call
    made with ``_preload_content=False`` answers the aiohttp.ClientResponse instead."""
    try:
        response = await request
        try:
            body = await response.read()
        finally:
            response.release()
    except ApiException as err:
        raise translate(err, verb=verb, resource=resource) from err
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError) as err:
        raise translate(err, verb=verb, resource=resource) from err
    if response.status >= 400:
        err = ApiException(status=response.status, reason=response.reason)
        err.body = body
        raise translate(err, verb=verb, resource=resource, headers=response.headers) from None
    try:
        decoded = json.loads(body or b"{}")
    except ValueError as err:
        raise BackendUnavailable(BACKEND, f"{verb} {resource}: the answer is not JSON") from err
    if not isinstance(decoded, dict):
        raise BackendUnavailable(BACKEND, f"{verb} {resource}: the answer is not a JSON object")
    return decoded


async def connect(*, kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> k8s.ApiClient:
    """An ApiClient from the pod's ServiceAccount when in a cluster, else from a kubeconfig file.

    In a pod, kubernetes_asyncio re-reads the projected ServiceAccount token when it rotates.
    The caller closes the client.
    """
    configuration = k8s.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            path = kubeconfig or os.environ.get("KUBECONFIG") or Path.home() / ".kube" / "config"
            await k8s_config.load_kube_config(
                config_file=str(path), context=context, client_configuration=configuration,
                persist_config=False,
            )
    except (k8s_config.ConfigException, OSError, ValueError) as err:
        raise ConfigError("kubeconfig", f"cannot load Kubernetes credentials: {err}") from err
    return k8s.ApiClient(configuration)
