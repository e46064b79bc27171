"""RayGcs against a real local multi-node Ray cluster with token auth.

Listing nodes, the PREEMPTION drain (and leaving alone a node that already drains sooner), the
internal KV, the version check, token errors, several clusters with different tokens from one
process, and a GCS nobody listens on.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import threading
from datetime import datetime, timedelta, timezone

import pytest

from resilienced.ray import gcs as raygcs
from resilienced.errors import BackendUnavailable, RayAuthError, RayVersionMismatch
from resilienced.local.aws import free_port
from resilienced.local.raycluster import LocalRayCluster
from resilienced.ray.gcs import RayGcs, parse_address
from tests.support.kubeoptions import LOCAL_BOUND_S

from .conftest import INSTANCE_LABEL, WORKER_INSTANCE, busy

pytestmark = pytest.mark.e2e


def gcs(cluster: LocalRayCluster, **kwargs: object) -> RayGcs:
    return RayGcs(cluster.address, token=cluster.auth_token, timeout=LOCAL_BOUND_S, **kwargs)


def in_minutes(m: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(minutes=m)


async def wait_until(predicate, *, timeout: float = 60.0, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_nodes_lists_head_and_labelled_worker(ray_cluster: LocalRayCluster) -> None:
    nodes = {n.node_id: n for n in await gcs(ray_cluster).nodes()}

    head = nodes[ray_cluster.head.node_id]
    assert head.is_head and head.alive
    (worker,) = [n for n in nodes.values() if n.labels.get(INSTANCE_LABEL) == WORKER_INSTANCE]
    assert worker.alive and not worker.is_head
    assert worker.node_id == ray_cluster.workers[0].node_id
    assert worker.draining_deadline_ms is None
    assert worker.address  # the node manager address the private-IP fallback compares


async def test_ping_reports_the_cluster_ray_version(ray_cluster: LocalRayCluster) -> None:
    import ray

    assert await gcs(ray_cluster).ping() == ray.__version__


async def test_drain_of_an_idle_node_uses_reason_preemption_and_the_node_leaves(
    ray_cluster: LocalRayCluster, fresh_node
) -> None:
    node = fresh_node("i-00000000000000d01")
    client = gcs(ray_cluster)

    result = await client.drain_node(node.node_id, deadline=in_minutes(2), message="spot interruption (test)")

    assert (result.outcome, result.accepted) == ("drained", True)

    async def dead() -> bool:
        return not {n.node_id: n for n in await client.nodes()}[node.node_id].alive

    await wait_until(dead, what="the drained idle node to leave")
    # The GCS recorded why the node went away: a preemption drain, with our message.
    with ray_cluster._gcs() as raw:
        info = {k.hex(): v for k, v in raw.get_all_node_info(timeout=LOCAL_BOUND_S).items()}[node.node_id]
    from ray.core.generated import common_pb2

    assert info.death_info.reason == common_pb2.NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
    assert info.death_info.reason_message == "spot interruption (test)"

    again = await client.drain_node(node.node_id, deadline=in_minutes(2), message="again")
    assert (again.outcome, again.accepted) == ("dead", False)
    assert (await client.drain(node.node_id, deadline=in_minutes(2), message="again")).accepted is False


async def test_a_busy_node_keeps_draining_and_an_earlier_deadline_is_not_replaced(
    ray_cluster: LocalRayCluster, fresh_node
) -> None:
    node = fresh_node("i-00000000000000d02")
    client = gcs(ray_cluster)
    with busy(ray_cluster, node.node_id):
        first = in_minutes(2)
        assert (await client.drain(node.node_id, deadline=first, message="notice")).accepted
        listed = {n.node_id: n for n in await client.nodes()}[node.node_id]
        assert listed.alive
        assert listed.draining_deadline_ms == int(first.timestamp() * 1000)

        later = await client.drain_node(node.node_id, deadline=in_minutes(5), message="later")
        assert (later.outcome, later.accepted) == ("already_draining", True)
        assert "not re-drained" in later.detail
        unchanged = {n.node_id: n for n in await client.nodes()}[node.node_id]
        assert unchanged.draining_deadline_ms == int(first.timestamp() * 1000)

        earlier_at = in_minutes(1)
        earlier = await client.drain_node(node.node_id, deadline=earlier_at, message="sooner")
        assert (earlier.outcome, earlier.accepted) == ("drained", True)
        assert "was draining" in earlier.detail
        moved = {n.node_id: n for n in await client.nodes()}[node.node_id]
        assert moved.draining_deadline_ms == int(earlier_at.timestamp() * 1000)


async def test_drain_of_a_node_the_cluster_does_not_know(ray_cluster: LocalRayCluster) -> None:
    result = await gcs(ray_cluster).drain_node("ab" * 28, deadline=in_minutes(2), message="x")
    assert (result.outcome, result.accepted) == ("unknown_node", False)


@pytest.mark.parametrize(
    ("node_id", "deadline", "message"),
    [
        ("zz", in_minutes(2), "not 56 hex"),
        ("ab" * 27, in_minutes(2), "not 56 hex"),
        ("ab" * 28, datetime(2030, 1, 1), "no time zone"),
    ],
    ids=["not-hex", "short", "naive-deadline"],
)
async def test_drain_rejects_bad_input_before_calling_the_gcs(node_id: str, deadline: datetime, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await RayGcs(f"127.0.0.1:{free_port()}").drain_node(node_id, deadline=deadline, message="x")


async def test_internal_kv_put_if_absent_get_keys_del(ray_cluster: LocalRayCluster) -> None:
    client = gcs(ray_cluster)
    await client.kv_del("t/kv/a")
    assert await client.kv_put_if_absent("t/kv/a", b"first") is True
    assert await client.kv_put_if_absent("t/kv/a", b"second") is False
    assert await client.kv_get("t/kv/a") == b"first"
    await client.kv_put("t/kv/a", b"third")
    assert await client.kv_get("t/kv/a") == b"third"
    assert "t/kv/a" in await client.kv_keys("t/kv/")
    assert await client.kv_del("t/kv/a") is True
    assert await client.kv_del("t/kv/a") is False
    assert await client.kv_get("t/kv/a") is None
    # The namespace is resilienced's own: Ray's default namespace does not see the key.
    await client.kv_put("t/kv/ns", b"x")
    with ray_cluster._gcs() as raw:
        assert raw.internal_kv_get(b"t/kv/ns", namespace=None, timeout=LOCAL_BOUND_S) is None
        assert raw.internal_kv_get(b"t/kv/ns", namespace=b"resilienced", timeout=LOCAL_BOUND_S) == b"x"


async def test_a_cluster_on_another_ray_version_is_refused_naming_both(ray_cluster: LocalRayCluster) -> None:
    import ray

    with ray_cluster._gcs() as raw:
        original = raw.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster", timeout=LOCAL_BOUND_S)
        metadata = json.loads(original)
        metadata["ray_version"] = "2.59.0"
        raw.internal_kv_put(b"CLUSTER_METADATA", json.dumps(metadata).encode(), True,
                            namespace=b"cluster", timeout=LOCAL_BOUND_S)
    try:
        with pytest.raises(RayVersionMismatch) as info:
            await gcs(ray_cluster).nodes()
        assert "2.59.0" in str(info.value) and ray.__version__ in str(info.value)
        with pytest.raises(RayVersionMismatch):
            await gcs(ray_cluster).drain("ab" * 28, deadline=in_minutes(2), message="x")
    finally:
        with ray_cluster._gcs() as raw:
            raw.internal_kv_put(b"CLUSTER_METADATA", original, True, namespace=b"cluster", timeout=LOCAL_BOUND_S)
    assert await gcs(ray_cluster).ping() == ray.__version__


async def test_a_wrong_token_is_a_ray_auth_error(ray_cluster: LocalRayCluster) -> None:
    with pytest.raises(RayAuthError, match="rejected the auth token given"):
        await RayGcs(ray_cluster.address, token="0" * 64, timeout=LOCAL_BOUND_S).nodes()


async def test_no_token_anywhere_is_a_ray_auth_error_naming_the_sources(
    ray_cluster: LocalRayCluster, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_K8S_TOKEN_AUTH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    with pytest.raises(RayAuthError, match="requires a token and none is configured"):
        await RayGcs(ray_cluster.address, timeout=LOCAL_BOUND_S).nodes()


async def test_the_default_token_is_found_where_ray_looks_for_it(
    ray_cluster: LocalRayCluster, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(ray_cluster.auth_token + "\n")
    assert await RayGcs(ray_cluster.address, timeout=LOCAL_BOUND_S).nodes()


async def test_several_clusters_with_different_tokens_from_one_process(
    ray_cluster: LocalRayCluster, second_cluster: LocalRayCluster
) -> None:
    assert ray_cluster.auth_token != second_cluster.auth_token
    one, two = gcs(ray_cluster), gcs(second_cluster)
    env_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    switches_before = raygcs.token_switches()

    heads = set()
    for _ in range(10):  # interleaved, one after the other
        heads.add(next(n.node_id for n in await one.nodes() if n.is_head))
        heads.add(next(n.node_id for n in await two.nodes() if n.is_head))
    # and concurrently
    results = await asyncio.gather(*(c.nodes() for c in (one, two) * 10))
    heads |= {next(n.node_id for n in nodes if n.is_head) for nodes in results}

    assert heads == {ray_cluster.head.node_id, second_cluster.head.node_id}
    assert raygcs.token_switches() - switches_before >= 20
    # The process environment is as it was: the token never stays in it.
    assert {k: os.environ.get(k) for k in env_before} == env_before


def _c_getenv(key: str) -> str | None:
    """The C environment's value (what Ray's C++ reads), not Python's os.environ mapping."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    value = libc.getenv(key.encode())
    return value.decode() if value is not None else None


def test_a_call_switches_the_token_in_the_c_environment_and_never_in_os_environ() -> None:
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    mapping_before = dict(os.environ)
    c_before = {k: _c_getenv(k) for k in keys}

    with raygcs.TOKEN_SWITCH.using("t" * 32, wait_s=5, address="127.0.0.1:1"):
        path = _c_getenv("RAY_AUTH_TOKEN_PATH")
        assert path is not None and open(path, encoding="utf-8").read() == "t" * 32
        assert (_c_getenv("RAY_AUTH_MODE"), _c_getenv("RAY_AUTH_TOKEN")) == ("token", None)
        assert dict(os.environ) == mapping_before  # what other threads iterate did not move

    assert {k: _c_getenv(k) for k in keys} == c_before
    assert dict(os.environ) == mapping_before


async def test_threads_iterating_os_environ_during_gcs_calls_never_see_it_change(
    ray_cluster: LocalRayCluster, second_cluster: LocalRayCluster
) -> None:
    # As botocore's proxy lookup does for every new client while the daemon's GCS calls run in
    # worker threads: a key removed between listing the keys and reading one was a KeyError.
    before = dict(os.environ)
    stop = threading.Event()
    seen: list[dict[str, str]] = []
    errors: list[BaseException] = []

    def iterate() -> None:
        while not stop.is_set():
            try:
                snapshot = dict(os.environ.items())
            except BaseException as exc:  # noqa: BLE001 - the defect is any exception here
                errors.append(exc)
                return
            if snapshot != before:
                seen.append(snapshot)

    reader = threading.Thread(target=iterate, daemon=True)
    reader.start()
    try:
        one, two = gcs(ray_cluster), gcs(second_cluster)
        for _ in range(10):
            await asyncio.gather(*(c.nodes() for c in (one, two) * 5))
    finally:
        stop.set()
        reader.join(timeout=10)

    assert errors == []
    assert [sorted(set(s.items()) ^ set(before.items())) for s in seen[:3]] == []


async def test_a_gcs_nobody_listens_on_is_backend_unavailable_at_once() -> None:
    client = RayGcs(f"127.0.0.1:{free_port()}", token="x" * 32, timeout=5)
    for call in (client.nodes(), client.drain("ab" * 28, deadline=in_minutes(2), message="x"),
                 client.kv_get("k")):
        with pytest.raises(BackendUnavailable) as info:
            await asyncio.wait_for(call, timeout=30)
        assert info.value.backend == "ray-gcs"
        assert "cannot connect" in str(info.value)


@pytest.mark.parametrize(
    ("address", "message"),
    [("", "empty"), ("10.0.0.5", "not host:port"), ("10.0.0.5:0", "1-65535"), ("ray://h:10001", "without ray://"),
     ("h:port", "not host:port")],
    ids=["empty", "no-port", "port-zero", "client-url", "port-name"],
)
def test_bad_addresses_and_tokens_are_refused(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_address(address)


def test_a_blank_token_is_refused() -> None:
    with pytest.raises(ValueError, match="token"):
        RayGcs("127.0.0.1:6379", token="  ")


async def test_a_cancel_that_lands_as_the_gcs_answers_is_not_lost(ray_cluster: LocalRayCluster) -> None:
    """A task cancelled (Ctrl-C, a shutdown) in the loop iteration where the GCS's answer arrives
    must end cancelled: ``asyncio.wait_for`` of Python 3.11 returned the answer instead and the
    caller's loop went on, so the drill's teardown waited forever on it (a lost Ctrl-C)."""
    gcs = RayGcs(ray_cluster.address, token=ray_cluster.auth_token)
    loop = asyncio.get_running_loop()
    caller: list[asyncio.Task] = []

    def answer_as_the_cancel_comes(client: object) -> str:
        loop.call_soon_threadsafe(caller[0].cancel)  # queued just before the answer is handed over
        return "the answer"

    task = asyncio.create_task(gcs._call("a call", answer_as_the_cancel_comes))
    caller.append(task)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
