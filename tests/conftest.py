"""Fixtures shared by every topic: the local AWS stand-in (moto server over HTTP), and a
kubernetes_asyncio client to whichever emulated API server (``kubeapi``) a topic's conftest serves.

And the test layers (``unit``, ``integration``, ``e2e``): every test carries one, and
tests/support/layers.py checks that it follows from what the test starts."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from tests.support import layers

REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server process for the session, stopped at the end (also on failure)."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with MotoServer(log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def ray_head() -> Iterator[Any]:
    """One head-only local Ray cluster for the session (started by the first test that asks),
    stopped at the end, also on failure. For tests that use its GCS (KV stores, node lists) and
    stop every node they add; a test whose claim depends on every node of its cluster starts its
    own (docs/development.md, "Rules the suite keeps"). A start costs about 5 CPU-seconds here."""
    from tests.support.ray import local_cluster

    with local_cluster("rh-") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def control_plane() -> Iterator[Any]:
    """The real Kubernetes control plane (tests/support/controlplane: every component), one per test
    process, started by the first ``cluster`` test that asks and stopped at the end, also on failure."""
    from tests.support.controlplane.plane import ControlPlane

    plane = ControlPlane()
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """A clean moto (reset before each test) and fake credentials in the environment."""
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    moto_server.reset()
    yield moto_server


@pytest.fixture
async def api(kubeapi: Any) -> AsyncIterator[Any]:
    """A real kubernetes_asyncio ApiClient to the topic's emulated API server, closed afterwards."""
    client = kubeapi.api_client()
    try:
        yield client
    finally:
        await client.close()


# --------------------------------------------------------------------------- test layers
def pytest_configure(config: pytest.Config) -> None:
    layers.GUARD.install()
    config.stash[_RECORDS] = {}
    config.pluginmanager.register(_ClosestLayer(), "resilienced-closest-layer")


class _ClosestLayer:
    """A test's closest layer marker is its only one, before ``-m`` selects.

    pytest gathers the markers of a test and of its module: an ``e2e`` test in a ``unit`` module
    matched both ``-m e2e`` and ``-m "unit or integration"``, so ``make test`` ran it twice (19
    tests did: the e2e process and the fast layers each ran them). Here every layer marker moves
    off the modules and classes, and each test gets its closest one.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        closest = {item.nodeid: layers.layer_of([m.name for m in item.iter_markers()]) for item in items}
        for item in items:
            for node in item.listchain():
                node.own_markers[:] = [m for m in node.own_markers if m.name not in layers.LAYERS]
        for item in items:
            layer = closest[item.nodeid]
            if layer is not None:
                item.add_marker(layer)
        # before -m deselects: a long test's quick forms must be among the collected tests
        problems = layers.long_problems([
            (item.nodeid, closest[item.nodeid],
             None if (mark := item.get_closest_marker(layers.LONG)) is None else tuple(mark.args))
            for item in items])
        if problems:
            raise pytest.UsageError("long tests (tests/support/layers.py):\n  " + "\n  ".join(problems))


_RECORDS = pytest.StashKey[dict[str, layers.ModuleRecord]]()
_LAYER = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = []
    records = config.stash[_RECORDS]
    observing = bool(os.environ.get("RESILIENCED_LAYERS_REPORT"))  # report what each module does
    for item in items:
        layer = layers.layer_of([m.name for m in item.iter_markers()])
        if layer is None and observing:
            layer = "unit"
        if layer is None:
            unmarked.append(item.nodeid)
            continue
        item.stash[_LAYER] = layer
        record = records.setdefault(item.nodeid.split("::")[0], layers.ModuleRecord())
        record.layer_ranks.add(layers.LAYERS.index(layer))
        record.tests += 1
    if unmarked:
        raise pytest.UsageError(
            "tests without a layer marker (pytestmark = pytest.mark.unit / integration / cluster / e2e; "
            f"tests/support/layers.py): {', '.join(unmarked[:10])}"
            + (f" and {len(unmarked) - 10} more" if len(unmarked) > 10 else ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    seen = layers.GUARD.begin()
    if layers.E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
        seen.add("e2e", "a shared Ray cluster or the trainer (fixture)")
    if layers.CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
        seen.add("cluster", "the real control plane (fixture)")
    try:
        yield
    finally:
        layers.GUARD.end()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or _LAYER not in item.stash:
        return
    seen = layers.GUARD.current
    record = item.config.stash[_RECORDS].get(item.nodeid.split("::")[0])
    if seen is None or record is None:
        return
    record.ran += 1
    record.seen_rank = max(record.seen_rank, seen.rank)
    record.why.extend(w for w in seen.why if w not in record.why and len(record.why) < 5)
    problem = layers.too_much(item.stash[_LAYER], seen)
    if problem is not None and report.passed:
        report.outcome = "failed"
        report.longrepr = problem


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    records = session.config.stash.get(_RECORDS, {})
    path = os.environ.get("RESILIENCED_LAYERS_REPORT")
    if path:
        layers.write_report(path, records)
    problems = layers.too_little(records)
    if problems and not os.environ.get("RESILIENCED_LAYERS_REPORT"):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("test layers: modules marked above what their tests start:", red=True)
            for problem in problems:
                reporter.write_line(f"  {problem}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def own_sigterm() -> Iterator[None]:
    """A Checkpointer or a framework guard made in this process installs its SIGTERM flag: put
    pytest's handler back and clear the flag."""
    from trainer.preemption import SIGTERM

    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        SIGTERM.clear()
