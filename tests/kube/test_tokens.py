"""The three Ray auth modes of KubeRay's authOptions: none, a Secret, delegated to Kubernetes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from resilienced.errors import RayAuthError
from resilienced.kube.cluster import KubeCluster, KubeOptions
from resilienced.kube.tokens import auth_mode, auth_secret_name
from .conftest import LOCAL_BOUND_S, FAST, GcsFactory, instance, node, ray_node, ray_pod, raycluster
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

GCS = "10.0.9.1:6379"


def _secret(name: str, token: str | None, *, namespace: str = "ml") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "stringData": {"auth_token": token} if token is not None else {"other": "x"}}


def _world(kubeapi: KubeApiServer, gcs: GcsFactory, auth: dict | None, *, name: str = "rc") -> dict:
    rc = kubeapi.create(raycluster(name, head_ip="10.0.9.1", auth=auth))
    kubeapi.seed(node("n1", instance(1)), ray_pod("w1", cluster=name, node_name="n1", ip="10.0.1.1"))
    gcs.nodes[GCS] = [ray_node(0x11, "10.0.1.1")]
    return rc


@pytest.fixture
def sa_token(tmp_path: Path) -> Path:
    path = tmp_path / "serviceaccount" / "token"
    path.parent.mkdir()
    path.write_text("eyJhbGciOi.sa-token.sig\n")
    return path


@pytest.fixture
async def kube(kubeapi: KubeApiServer, api, gcs: GcsFactory, sa_token: Path) -> AsyncIterator[KubeCluster]:
    options = KubeOptions(cache=FAST.cache, service_account_token_path=str(sa_token))
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=options) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("auth", "mode", "secret"),
    [
        (None, "none", "rc"),
        ({"mode": "disabled"}, "none", "rc"),
        ({"enableK8sTokenAuth": True}, "none", "rc"),  # without mode=token KubeRay enables nothing
        ({"mode": "token"}, "secret", "rc"),
        ({"mode": "token", "secretName": "mine"}, "secret", "mine"),
        ({"mode": "token", "enableK8sTokenAuth": True}, "kubernetes", "rc"),
    ],
    ids=["absent", "disabled", "k8s-without-mode", "token", "token-named-secret", "delegated"],
)
def test_auth_mode_follows_kuberay(auth: dict | None, mode: str, secret: str) -> None:
    rc = raycluster("rc", auth=auth)
    assert auth_mode(rc) == mode and auth_secret_name(rc) == secret


def test_generated_secret_name_is_kuberays_check_name() -> None:
    long_name = "a" * 10 + "-" + "b" * 49
    assert auth_secret_name(raycluster(long_name, auth={"mode": "token"})) == "r" + long_name[-49:]  # "-" first: "r"
    assert auth_secret_name(raycluster("x" * 5 + "y" * 50, auth={"mode": "token"})) == "y" * 50
    assert auth_secret_name(raycluster("1st-cluster", auth={"mode": "token"})) == "rst-cluster"


async def test_no_auth_sends_no_token(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    _world(kubeapi, gcs, None)
    (target,) = (await kube.locate(instance_ids=[instance(1)])).targets
    assert target.attributes["auth"] == "none" and gcs.made == [(GCS, None)]
    assert kubeapi.counts()[("get", "secrets")] == 0


async def test_token_from_the_generated_secret(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    _world(kubeapi, gcs, {"mode": "token"})
    kubeapi.create(_secret("rc", "tok-123"))
    gcs.expected_token[GCS] = "tok-123"
    (target,) = (await kube.locate(instance_ids=[instance(1)])).targets
    assert target.ray_node_ids == ("11" * 28,) and target.attributes["auth"] == "secret"
    assert gcs.made == [(GCS, "tok-123")]
    reads = [(r.verb, r.namespace, r.name) for r in kubeapi.requests if r.resource == "secrets"]
    assert reads == [("get", "ml", "rc")]  # one namespaced GET by name: no list, no watch


async def test_token_from_the_named_secret_is_cached(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token", "secretName": "ray-auth"})
    kubeapi.create(_secret("ray-auth", "tok-456"))
    await kube.caches.wait_ready()
    await kube.caches.rayclusters.wait_until(lambda c: c.get("ml", "rc") is not None, timeout=LOCAL_BOUND_S)
    assert await kube.gcs.tokens.token_for(kube.caches.rayclusters.get("ml", "rc")) == "tok-456"
    assert await kube.gcs.tokens.token_for(rc) == "tok-456"
    assert kubeapi.counts()[("get", "secrets")] == 1


async def test_a_missing_secret_is_a_clear_error(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token"})
    location = await kube.locate(instance_ids=[instance(1)])
    assert location.targets == ()
    assert location.unresolved[instance(1)] == (
        "RayCluster ml/rc: RayCluster ml/rc (authOptions.mode=token): its auth token Secret ml/rc does not exist")
    with pytest.raises(RayAuthError, match="does not exist"):
        await kube.gcs.tokens.token_for(rc)


async def test_a_secret_without_the_key_is_a_clear_error(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token"})
    kubeapi.create(_secret("rc", None))
    with pytest.raises(RayAuthError, match="has no data key 'auth_token'"):
        await kube.gcs.tokens.token_for(rc)


async def test_a_forbidden_secret_is_a_clear_error(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token"})
    kubeapi.fail(verb="get", resource="secrets", status=403)
    with pytest.raises(RayAuthError, match="may not read the auth token Secret ml/rc"):
        await kube.gcs.tokens.token_for(rc)


async def test_a_wrong_token_is_read_again_once_then_reported(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    _world(kubeapi, gcs, {"mode": "token"})
    kubeapi.create(_secret("rc", "stale"))
    gcs.expected_token[GCS] = "rotated"
    location = await kube.locate(instance_ids=[instance(1)])
    assert location.targets == ()
    assert "the token from its auth Secret was refused" in location.unresolved[instance(1)]
    assert kubeapi.counts()[("get", "secrets")] == 2  # the cached token was dropped and read again


async def test_a_rotated_secret_is_picked_up(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token"})
    kubeapi.create(_secret("rc", "old"))
    assert await kube.gcs.tokens.token_for(rc) == "old"  # cached
    kubeapi.put(_secret("rc", "new"))
    gcs.expected_token[GCS] = "new"
    (target,) = (await kube.locate(instance_ids=[instance(1)])).targets
    assert target.ray_node_ids == ("11" * 28,)
    assert [t for _, t in gcs.made] == ["old", "new"]


async def test_delegated_mode_sends_the_service_account_token(
    kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory, sa_token: Path
) -> None:
    _world(kubeapi, gcs, {"mode": "token", "enableK8sTokenAuth": True})
    gcs.expected_token[GCS] = "eyJhbGciOi.sa-token.sig"
    (target,) = (await kube.locate(instance_ids=[instance(1)])).targets
    assert target.attributes["auth"] == "kubernetes"
    assert gcs.made == [(GCS, "eyJhbGciOi.sa-token.sig")]
    assert kubeapi.counts()[("get", "secrets")] == 0


async def test_delegated_mode_without_a_service_account_token(
    kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory, sa_token: Path
) -> None:
    rc = _world(kubeapi, gcs, {"mode": "token", "enableK8sTokenAuth": True})
    sa_token.unlink()
    with pytest.raises(RayAuthError, match="enableK8sTokenAuth.*cannot be read"):
        await kube.gcs.tokens.token_for(rc)


async def test_delegated_mode_refused_names_ray_write(
    kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory
) -> None:
    _world(kubeapi, gcs, {"mode": "token", "enableK8sTokenAuth": True})
    gcs.expected_token[GCS] = "something else"
    location = await kube.locate(instance_ids=[instance(1)])
    assert "ray:write" in location.unresolved[instance(1)]


async def test_a_cluster_without_auth_whose_gcs_wants_a_token(kube: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    _world(kubeapi, gcs, None)
    gcs.expected_token[GCS] = "secret"
    location = await kube.locate(instance_ids=[instance(1)])
    assert "has no authOptions.mode=token, but its GCS wants a token" in location.unresolved[instance(1)]
    assert len(gcs.made) == 1  # no token to read again: not retried
