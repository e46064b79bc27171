"""What the built manifests promise, checked against the code that will run under them: the
daemon's settings parse and validate from the ConfigMap, the grace period outlasts the shutdown
bound, selectors select, probes hit the daemon's endpoints; and the example run is coherent
(queue -> flavors -> NodePools, FSx path -> mount -> trainer flags -> checkpoint URI)."""

from __future__ import annotations

import shlex
import tomllib
from typing import Any

import pytest

from resilienced.options import ENV_PREFIX
from resilienced.settings import (
    HttpSettings,
    NotifySettings,
    QueueSettings,
    Settings,
    documented_options,
)
from trainer.config import parse_args

from .tools import FSX_STACK, REPO, build, load_template, one

pytestmark = pytest.mark.integration

#: Settings the manifests set before the daemon reads them (their issues are open).  This list
#: may only shrink: the test fails once one of them becomes a real setting, to be removed here.


def _pod(build_name: str) -> dict[str, Any]:
    return one("Deployment", build_name)["spec"]["template"]


def _container(build_name: str) -> dict[str, Any]:
    (container,) = _pod(build_name)["spec"]["containers"]
    return container


def _config(build_name: str) -> dict[str, str]:
    """The ConfigMap the daemon reads (envFrom), not another one (the dashboard's)."""
    (ref,) = _container(build_name)["envFrom"]
    return one("ConfigMap", build_name, ref["configMapRef"]["name"])["data"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------- configuration
def test_every_configmap_key_is_a_setting_of_the_daemon() -> None:
    known = {env for _, _, envs, _, _ in documented_options() for env in envs.split(" / ")}
    for name in ("base", "overlay"):
        keys = set(_config(name))
        assert all(k.startswith(ENV_PREFIX) for k in keys)
        assert not keys - known, f"not a setting: {sorted(keys - known)}"


def test_the_overlay_configuration_is_one_the_daemon_accepts() -> None:
    settings = Settings.from_args([], _config("overlay")).validate()
    assert settings.queue.queue_url.startswith("https://sqs.")
    assert settings.intake.allowed_accounts and settings.intake.allowed_regions


def test_the_base_alone_is_refused_by_the_daemon_for_want_of_a_queue() -> None:
    from resilienced.errors import ConfigError
    with pytest.raises(ConfigError, match="--queue-url"):
        Settings.from_args([], _config("base")).validate()


@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_the_grace_period_outlasts_the_shutdown_bound(build_name: str) -> None:
    queue = QueueSettings.from_args(None, _config(build_name))
    grace = _pod(build_name)["spec"]["terminationGracePeriodSeconds"]
    assert grace >= queue.shutdown_timeout + 10, (grace, queue.shutdown_timeout)


# ---------------------------------------------------------------- the pod
@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_the_pod_is_hardened(build_name: str) -> None:
    pod = _pod(build_name)["spec"]
    container = _container(build_name)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env["HOME"] == env["TMPDIR"] == "/tmp" and "emptyDir" in volumes[mounts["/tmp"]]
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}


@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_probes_and_port_are_the_daemons(build_name: str) -> None:
    container = _container(build_name)
    port = int(_config(build_name).get("RESILIENCED_HTTP_PORT", HttpSettings().http_port))
    (declared,) = container["ports"]
    assert (declared["name"], declared["containerPort"]) == ("http", port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["args"] == ["run"]


@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_the_webhook_url_comes_from_a_secret_file_never_the_configmap(build_name: str) -> None:
    config = _config(build_name)
    assert "RESILIENCED_NOTIFY_WEBHOOK" not in config
    assert not any("hooks." in v or v.startswith("http") and "sqs." not in v for v in config.values())
    path = config["RESILIENCED_NOTIFY_WEBHOOK_FILE"]
    mounts = {m["name"]: m for m in _container(build_name)["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod(build_name)["spec"]["volumes"]}
    (name,) = [n for n, m in mounts.items() if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts[name]["readOnly"] is True
    secret = volumes[name]["secret"]
    assert (secret["secretName"], secret["optional"]) == ("resilienced-notify", True)
    assert [i["path"] for i in secret["items"]] == [path.rsplit("/", 1)[1]]
    # the daemon reads it: absent (no Secret) is "no notifications", not an error
    notify = NotifySettings.from_args(None, config)
    notify.validate()
    assert notify.notify_webhook_file == path and notify.webhook_url() is None


def test_two_replicas_spread_over_nodes_and_zones_never_on_spot() -> None:
    deployment = one("Deployment", "overlay")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    spread = {c["topologyKey"]: c["whenUnsatisfiable"] for c in pod["topologySpreadConstraints"]}
    assert spread == {"kubernetes.io/hostname": "DoNotSchedule", "topology.kubernetes.io/zone": "ScheduleAnyway"}
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "karpenter.sh/capacity-type", "operator": "NotIn", "values": ["spot"]} in term["matchExpressions"]


def test_pdb_service_monitor_and_network_policy_select_the_daemon() -> None:
    labels = _pod("overlay")["metadata"]["labels"]
    pdb = one("PodDisruptionBudget", "overlay")["spec"]
    assert _selects(pdb["selector"]["matchLabels"], labels) and pdb["minAvailable"] == 1
    service = one("Service", "overlay")
    assert _selects(service["spec"]["selector"], labels)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    monitor = one("ServiceMonitor", "overlay")["spec"]
    assert _selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["endpoints"] == [{**monitor["endpoints"][0], "port": port["name"], "path": "/metrics"}]
    policy = one("NetworkPolicy", "overlay")["spec"]
    assert _selects(policy["podSelector"]["matchLabels"], labels)
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [8080]
    egress_ports = {(p["protocol"], p["port"]) for rule in policy["egress"] for p in rule["ports"]}
    assert egress_ports == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6379)}
    https = next(r for r in policy["egress"] if r["ports"][0]["port"] == 443)
    assert https["to"][0]["ipBlock"]["except"] == ["169.254.169.254/32"]


def test_the_overlay_sets_irsa_and_a_real_registry() -> None:
    account = one("ServiceAccount", "overlay")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert "set-by-overlay" not in account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert _pod("overlay")["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert _container("overlay")["image"] != _container("base")["image"]


# ---------------------------------------------------------------- the example run
def _by(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in build("examples") if o["kind"] == kind}


def test_the_rayjob_queues_through_kueue_to_flavors_karpenter_can_provide() -> None:
    rayjob = one("RayJob", "examples")
    local = _by("LocalQueue")[rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]]
    assert local["metadata"]["namespace"] == rayjob["metadata"]["namespace"]
    queue = _by("ClusterQueue")[local["spec"]["clusterQueue"]]
    flavors = _by("ResourceFlavor")
    gpu_group = next(g for g in queue["spec"]["resourceGroups"] if "nvidia.com/gpu" in g["coveredResources"])
    assert [f["name"] for f in gpu_group["flavors"]] == ["spot", "capacity-block", "on-demand"]
    pools = _by("NodePool")
    classes = _by("EC2NodeClass")
    for flavor in gpu_group["flavors"]:
        labels = flavors[flavor["name"]]["spec"]["nodeLabels"]
        matching = [p for p in pools.values() if all(
            {"key": k, "operator": "In", "values": [v]} in p["spec"]["template"]["spec"]["requirements"]
            for k, v in labels.items())]
        assert len(matching) == 1, f"flavor {flavor['name']}: one NodePool must provide {labels}"
        assert matching[0]["spec"]["template"]["spec"]["nodeClassRef"]["name"] in classes
    # The reserved pool takes Capacity Blocks only through the class's selector terms.
    (node_class,) = classes.values()
    assert node_class["spec"]["capacityReservationSelectorTerms"]
    # KubeRay refuses a suspended (Kueue-managed) RayJob that does not shut down when finished.
    assert rayjob["spec"]["suspend"] is True and rayjob["spec"]["shutdownAfterJobFinishes"] is True


def test_the_rayjob_runs_the_trainer_with_its_checkpoints_where_resilienced_looks() -> None:
    rayjob = one("RayJob", "examples")
    spec = rayjob["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "trainer"]
    config = parse_args(argv[3:])  # the trainer's own flag parser and validation
    config.validate()
    workers = spec["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(int(w["replicas"]) * int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for w in workers)
    assert config.use_gpu and config.num_workers == gpus
    # The checkpoint dir is on the FSx mount, under the DRA's file-system path, and the
    # annotation is where auto-export puts it: s3://<bucket>/<prefix>/<run>/.
    template = load_template(FSX_STACK)
    dra = template["Resources"]["CheckpointRepository"]["Properties"]
    prefix = template["Parameters"]["CheckpointPrefix"]["Default"]
    claim = _by("PersistentVolumeClaim")
    for group in [spec["rayClusterSpec"]["headGroupSpec"], *workers]:
        pod = group["template"]["spec"]
        fsx = {v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") in claim}
        (mount,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in fsx]
        assert mount == "/fsx"
    relative = config.checkpoint_dir.relative_to("/fsx" + dra["FileSystemPath"])
    uri = rayjob["metadata"]["annotations"]["resilienced.io/checkpoint-uri"]
    assert uri.startswith("s3://") and uri.endswith(f"/{prefix}{relative}/")
    assert config.run_name == str(relative)


def test_the_workers_carry_the_efa_and_nccl_settings_and_whole_cpus() -> None:
    spec = one("RayJob", "examples")["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == _pinned_ray()
    assert spec["authOptions"]["mode"] == "token" and spec["authOptions"]["secretName"]
    (group,) = spec["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {k: env[k] for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NCCL_PROTO")} == \
        {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"}
    assert "NCCL_SOCKET_IFNAME" in env
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS for the static CPU manager
    assert str(resources["limits"]["cpu"]).isdigit() and int(resources["limits"]["vpc.amazonaws.com/efa"]) > 0
    (node_class,) = _by("EC2NodeClass").values()
    assert "cpuManagerPolicy: static" in node_class["spec"]["userData"]
    assert "topologyManagerPolicy: single-numa-node" in node_class["spec"]["userData"]


def _pinned_ray() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.startswith("ray=="))
