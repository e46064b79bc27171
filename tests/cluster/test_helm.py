"""The Helm chart on the real control plane: ``helm install``, the ServiceAccount's grants as the
API server authorizes them, ``helm upgrade`` rolling the Deployment, ``helm uninstall``.

One release for the module (``installed``): the chart with the monitoring objects on (the plane
serves the Prometheus operator's CRDs) and a Ray-token grant in a second namespace, installed by
the helm of ``make helm`` with an admin kubeconfig into a namespace of its own.  Then:

* every object of the release's manifest is on the API server, and the controller-manager made
  the Deployment's ReplicaSet (kwok has no Node the pods fit: they need not run here);
* ``kubectl auth can-i --as=system:serviceaccount:<ns>:<sa>``: yes for every verb of
  ``resilienced.ops.permissions`` on its resource (the Leases only in the claims namespace, the
  token Secret only by name), no for every other verb on those resources, for a wildcard and for
  escalation;
* ``helm upgrade`` with the same values changes nothing of the Deployment; with a changed setting
  the pod template changes (checksum/config) and a new ReplicaSet appears;
* ``helm uninstall`` removes every object of the manifest and the release itself, and leaves what
  it did not make: the claims' Leases (made by the daemon), the namespace, the CRDs.

The release is named ``resilienced-helm``, so its cluster-scoped objects do not meet the
``resilienced`` ClusterRole that ``daemon_identity`` applies from the kustomize base.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilienced.ops import permissions
from resilienced.ops.permissions import NAMESPACED_RBAC_RULES, RBAC_RULES
from tests.support.controlplane import ControlPlane
from tests.support.controlplane.build import MissingBuild, program
from tests.support.controlplane.rest import Rest, RestError
from tests.support.controlplane.world import World

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "resilienced"
RELEASE = "resilienced-helm"
SERVICE_ACCOUNT = RELEASE  # the release's full name (the release name contains the chart's)
TOKEN_SECRET = "run-ray-token"
#: The verbs a grant is checked against: every verb of the API's resources (RBAC's own and the
#: subresources' aside).
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


def _program(name: str) -> str:
    try:
        return str(program(name))
    except MissingBuild as err:
        pytest.fail(f"{err} (`make test` builds it too)", pytrace=False)


@dataclass
class Release:
    plane: ControlPlane
    namespace: str  # the release's, and the claims'
    runs: str  # a training namespace with a Ray token grant
    kubeconfig: Path
    values: Path
    home: Path

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{SERVICE_ACCOUNT}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                **{f"HELM_{k}_HOME": str(self.home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([_program("helm"), *args, "-n", self.namespace], capture_output=True,
                              text=True, timeout=timeout, env=self._env(), cwd=ROOT)
        if check:
            assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
        return done

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_program("kubectl"), *args], capture_output=True, text=True,
                              timeout=timeout, env=self._env(), cwd=ROOT)

    def can_i(self, verb: str, resource: str, *, namespace: str | None = None, subresource: str = "") -> bool:
        """``kubectl auth can-i VERB RESOURCE --as=<the daemon>``, in ``namespace`` or all of them."""
        where = ["-n", namespace] if namespace else ["--all-namespaces"]
        if subresource:
            where.append(f"--subresource={subresource}")
        done = self.kubectl("auth", "can-i", verb, resource, f"--as={self.user}", *where)
        answer = done.stdout.strip().splitlines()[:1]
        assert answer in (["yes"], ["no"]), f"kubectl auth can-i {verb} {resource}: {done.stdout}{done.stderr}"
        assert done.returncode == (0 if answer == ["yes"] else 1), done.stderr
        return answer == ["yes"]

    def manifest(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.helm("get", "manifest", RELEASE).stdout) if d]

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        admin = self.plane.admin
        meta = obj["metadata"]
        plural = admin.plural(obj["apiVersion"], obj["kind"])
        try:
            return admin.request("GET", admin.path(obj["apiVersion"], plural, namespace=meta.get("namespace"),
                                                   name=meta["name"]))
        except RestError as err:
            if err.status == 404:
                return None
            raise

    def deployment(self) -> dict[str, Any]:
        found = self.get({"apiVersion": "apps/v1", "kind": "Deployment",
                          "metadata": {"name": RELEASE, "namespace": self.namespace}})
        assert found is not None
        return found

    def replicasets(self) -> list[dict[str, Any]]:
        uid = self.deployment()["metadata"]["uid"]
        items = self.plane.admin.request("GET", f"/apis/apps/v1/namespaces/{self.namespace}/replicasets")["items"]
        return [rs for rs in items if any(o["uid"] == uid for o in rs["metadata"].get("ownerReferences", []))]


def _resource(group: str, plural: str) -> str:
    return f"{plural}.{group}" if group else plural


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    down = [p.name for p in control_plane.processes if not p.alive()]
    assert not down, f"control-plane components ended: {down}\n{control_plane.logs(down)}"
    home = tmp_path_factory.mktemp("helm")
    world, runs = World(control_plane), World(control_plane)
    values = home / "values.yaml"
    values.write_text(yaml.safe_dump({
        "queueUrl": "https://sqs.us-east-1.amazonaws.com/111122223333/resilienced-events",
        "serviceAccount": {"roleArn": "arn:aws:iam::111122223333:role/resilienced-DaemonRole-EXAMPLE"},
        "rayTokenSecrets": [{"namespace": runs.namespace, "secrets": [TOKEN_SECRET]}],
        "monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                       "dashboard": {"enabled": True}},
    }))
    release = Release(control_plane, world.namespace, runs.namespace,
                      control_plane.write_kubeconfig(home / "kubeconfig", namespace=world.namespace), values, home)
    release.helm("install", RELEASE, str(CHART), "-f", str(values))
    try:
        yield release
    finally:
        if release.helm("status", RELEASE, check=False).returncode == 0:
            release.helm("uninstall", RELEASE, check=False)
        runs.close()
        world.close()


def test_helm_install_makes_every_object_of_the_chart(installed: Release) -> None:
    status = installed.helm("status", RELEASE, "-o", "json")
    assert yaml.safe_load(status.stdout)["info"]["status"] == "deployed"
    objects = installed.manifest()
    kinds = {o["kind"] for o in objects}
    assert kinds == {"ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                     "Service", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor",
                     "PrometheusRule"}
    missing = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if installed.get(o) is None]
    assert not missing
    roles = {o["metadata"]["namespace"] for o in objects if o["kind"] == "Role"}
    assert roles == {installed.namespace, installed.runs}
    installed.plane.wait_for("the Deployment's ReplicaSet (kube-controller-manager)",
                             lambda: len(installed.replicasets()) == 1, timeout=60)


def test_the_service_account_can_do_exactly_what_the_daemon_does(installed: Release) -> None:
    cluster = permissions.grants(RBAC_RULES)
    leases = permissions.grants(NAMESPACED_RBAC_RULES["daemon"])
    checks: list[tuple[bool, str, str, str | None]] = []  # (expected, verb, resource[/name], namespace)
    for group, plural in sorted({(g, r) for g, r, _ in cluster}):
        for verb in VERBS:
            checks.append(((group, plural, verb) in cluster, verb, _resource(group, plural), None))
    for group, plural in sorted({(g, r) for g, r, _ in leases}):
        for verb in VERBS:
            granted = (group, plural, verb) in leases
            checks.append((granted, verb, _resource(group, plural), installed.namespace))
            if granted:  # in the claims namespace only
                checks.append((False, verb, _resource(group, plural), installed.runs))
    # the Ray token: get, by name, in the training namespace only
    checks += [(True, "get", f"secrets/{TOKEN_SECRET}", installed.runs),
               (False, "get", "secrets/another-secret", installed.runs),
               (False, "list", "secrets", installed.runs),
               (False, "get", f"secrets/{TOKEN_SECRET}", installed.namespace)]
    # wildcards, escalation, a verb the daemon never sends
    checks += [(False, "*", "*", None), (False, "*", "nodes", None), (False, "get", "*", None),
               (False, "escalate", "clusterroles.rbac.authorization.k8s.io", None),
               (False, "bind", "clusterroles.rbac.authorization.k8s.io", None),
               (False, "impersonate", "serviceaccounts", None), (False, "ray:write", "rayclusters.ray.io", None),
               (False, "create", "configmaps", installed.namespace)]
    assert sum(expected for expected, *_ in checks) == len(cluster) + len(leases) + 1
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: installed.can_i(c[1], c[2], namespace=c[3]), checks))
    wrong = [f"{verb} {resource} in {namespace or 'all namespaces'}: expected {'yes' if expected else 'no'}"
             for (expected, verb, resource, namespace), answer in zip(checks, answers) if answer != expected]
    assert not wrong, "\n".join(wrong)
    assert not installed.can_i("create", "pods", subresource="exec")
    assert installed.can_i("list", "pods") and not installed.can_i("list", "pods", subresource="log")


def test_helm_upgrade_with_a_changed_setting_rolls_the_deployment(installed: Release) -> None:
    installed.plane.wait_for("the first ReplicaSet", lambda: len(installed.replicasets()) == 1, timeout=60)
    before = installed.deployment()
    checksum = before["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    # the same values: nothing of the Deployment changes
    installed.helm("upgrade", RELEASE, str(CHART), "-f", str(installed.values))
    same = installed.deployment()
    assert same["metadata"]["generation"] == before["metadata"]["generation"]
    assert len(installed.replicasets()) == 1
    # a changed setting: the ConfigMap, then the pod template, then a new ReplicaSet
    installed.helm("upgrade", RELEASE, str(CHART), "-f", str(installed.values), "--set", "concurrency=11")
    config = installed.get({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": RELEASE, "namespace": installed.namespace}})
    assert config is not None and config["data"]["RESILIENCED_CONCURRENCY"] == "11"
    after = installed.deployment()
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    rolled = after["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert rolled != checksum

    def two_replicasets() -> list[dict[str, Any]] | None:
        found = installed.replicasets()
        return found if len(found) == 2 else None

    sets = installed.plane.wait_for("a second ReplicaSet for the new pod template", two_replicasets, timeout=60)
    checksums = {rs["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for rs in sets}
    assert checksums == {checksum, rolled}
    history = yaml.safe_load(installed.helm("history", RELEASE, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2, 3]


def test_helm_uninstall_removes_what_it_made_and_leaves_the_claims(installed: Release) -> None:
    objects = installed.manifest()
    assert objects
    # a claim, as the daemon makes it (its own token: the Role allows it)
    token = installed.plane.admin.request(
        "POST", f"/api/v1/namespaces/{installed.namespace}/serviceaccounts/{SERVICE_ACCOUNT}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
    )["status"]["token"]
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "claim-1", "namespace": installed.namespace,
                          "labels": {"app.kubernetes.io/managed-by": "resilienced"}},
             "spec": {"holderIdentity": "resilienced-helm-0"}}
    Rest(installed.plane.url, token=token, ca=installed.plane.ca).create(lease)

    installed.helm("uninstall", RELEASE, "--wait", "--timeout", "120s")
    installed.plane.wait_for("every object of the release gone",
                             lambda: all(installed.get(o) is None for o in objects), timeout=60)
    assert installed.helm("status", RELEASE, check=False).returncode != 0
    secrets = installed.plane.admin.request("GET", f"/api/v1/namespaces/{installed.namespace}/secrets",
                                            query={"labelSelector": "owner=helm"})["items"]
    assert not secrets, [s["metadata"]["name"] for s in secrets]
    installed.plane.wait_for("the ReplicaSets collected", lambda: not [
        rs for rs in installed.plane.admin.request(
            "GET", f"/apis/apps/v1/namespaces/{installed.namespace}/replicasets")["items"]
        if rs["metadata"]["labels"].get("app.kubernetes.io/instance") == RELEASE], timeout=60)
    assert not installed.can_i("patch", "nodes")
    # what it did not make stays: the claims, the namespace, the CRDs
    assert installed.get(lease) is not None
    assert installed.get({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": installed.namespace}})
    assert installed.get({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                          "metadata": {"name": "servicemonitors.monitoring.coreos.com"}})
