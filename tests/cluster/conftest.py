"""The ``cluster`` layer: the daemon against the real control plane (tests/support/controlplane).

One control plane per test process (``control_plane``, tests/conftest.py: started by the first
test that asks and stopped at the end, also on failure); each test gets a :class:`World`: a namespace of its own and
the cluster-scoped objects it made, removed when it ends.  The daemon's ServiceAccount and RBAC are
those of ``deploy/kubernetes/base``, applied once (``daemon_identity``).  A failed test's report
carries the end of every component's log.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.controlplane import ControlPlane
from tests.support.controlplane.world import World, install_daemon_identity

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="session")
def daemon_identity(control_plane: ControlPlane) -> ControlPlane:
    install_daemon_identity(control_plane)
    return control_plane


@pytest.fixture
def plane(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    down = [p.name for p in control_plane.processes if not p.alive()]
    assert not down, f"control-plane components ended: {down}\n{control_plane.logs(down)}"
    yield control_plane
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        request.node.add_report_section("call", "control plane", control_plane.logs(lines=25))


@pytest.fixture
def world(plane: ControlPlane) -> Iterator[World]:
    made = World(plane)
    try:
        yield made
    finally:
        made.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[object]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
