"""What an operator sees of a real recovery: the webhook notification and ``resilienced status``.

The recovery is the one of test_recovery.py (emulated API server with the manifests' RBAC, Lease
claims, S3 on moto, the KubeRay requeuer).  The webhook is a real aiohttp server on 127.0.0.1:
it receives the POST with the facts; when it answers 500, hangs or refuses the connection, the
recovery's outcome is the same and the recovery returns while the webhook is still failing.
``resilienced status`` runs in-process against the emulated API server and reads the done claim
Leases that recovery wrote.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from resilienced.app import cli
from resilienced.model import Result
from resilienced.ops.notify import Notifier, NotifyMetrics, load_template

from .conftest import NS, instance
from .test_recovery import World, body, plan_of, save_after_the_drain, world  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@dataclass
class Webhook:
    """A webhook on 127.0.0.1 that answers ``status``, or holds every request until released."""

    status: int = 200
    hang: bool = False
    posts: list[Any] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.posts.append(await request.json())
        self.arrived.set()
        if self.hang:
            await self.release.wait()
        return web.Response(status=self.status, text="ok" if self.status < 300 else "boom")


@pytest.fixture
async def webhook() -> AsyncIterator[Webhook]:
    hook = Webhook()
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    hook.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield hook
    finally:
        hook.release.set()
        await runner.cleanup()


def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notifier(url: str, **kw: Any) -> tuple[Notifier, NotifyMetrics]:
    metrics = NotifyMetrics(CollectorRegistry())
    return Notifier(url=url, metrics=metrics, backoff_s=0.01, **kw), metrics


def count(metrics: NotifyMetrics, outcome: str) -> float:
    return metrics.notifications.labels(outcome=outcome)._value.get()


async def spot_notice(world: World, *, step: int = 37) -> Any:
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"},
                        when=datetime.now(timezone.utc)))
    saver = asyncio.create_task(save_after_the_drain(world, step=step))
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    await saver
    return outcome


# ---------------------------------------------------------------- notifications
async def test_one_post_per_run_arrives_with_the_facts(world: World, webhook: Webhook) -> None:
    world.recovery.notifier, metrics = notifier(webhook.url)
    outcome = await spot_notice(world)
    await world.recovery.notifier.close()

    assert outcome.result is Result.DONE, outcome.reason
    (post,) = webhook.posts
    assert count(metrics, "sent") == 1 and count(metrics, "failed") == 0
    # Slack-compatible: text plus blocks, the facts in the fields
    text = post["text"]
    for fact in ("spot_interruption", instance(1), f"{NS}/train", "step 37", "durable yes",
                 "steps lost -", "capacity capacity-block", ": done"):
        assert fact in text, (fact, text)
    fields = {f["text"].split("\n")[0].strip("*"): f["text"].split("\n")[1]
              for f in post["blocks"][1]["fields"]}
    assert fields["Drained nodes"] == "01" * 28
    assert fields["Checkpoint step"] == "37" and fields["Durable"] == "yes"
    assert fields["Capacity"] == "capacity-block" and fields["Outcome"] == "done"
    assert fields["Capacity reason"] not in ("", "-")
    assert "7e9d2f6c-0000-4000-8000-000000000001" in post["blocks"][2]["elements"][0]["text"]


async def test_a_template_changes_the_body(world: World, webhook: Webhook, tmp_path: Path) -> None:
    template = tmp_path / "body.json"
    template.write_text('{"run": "$run", "says": "$kind on $instances: step $checkpoint_step ($durable)"}')
    world.recovery.notifier, _ = notifier(webhook.url, template=load_template(str(template)))
    await spot_notice(world, step=12)
    await world.recovery.notifier.close()
    assert webhook.posts == [{"run": f"{NS}/train",
                              "says": f"spot_interruption on {instance(1)}: step 12 (yes)"}]


@pytest.mark.parametrize("failure, posts", [("500", 3), ("400", 1), ("refused", 0)])
async def test_a_failing_webhook_costs_the_recovery_nothing(world: World, webhook: Webhook,
                                                            failure: str, posts: int) -> None:
    webhook.status = 400 if failure == "400" else 500
    url = f"http://127.0.0.1:{closed_port()}/hook" if failure == "refused" else webhook.url
    world.recovery.notifier, metrics = notifier(url, retries=2, timeout_s=2)
    outcome = await spot_notice(world)
    assert outcome.result is Result.DONE, outcome.reason
    assert outcome.details["runs"][0]["durable"]["verified"]

    await world.recovery.notifier.close()
    assert count(metrics, "failed") == 1 and count(metrics, "sent") == 0
    assert len(webhook.posts) == posts  # a 500 is retried twice; a 400 is not (the body is refused)


async def test_a_hanging_webhook_does_not_hold_the_recovery(world: World, webhook: Webhook) -> None:
    webhook.hang = True
    world.recovery.notifier, metrics = notifier(webhook.url, retries=0, timeout_s=30)
    outcome = await spot_notice(world)
    # the recovery is back with its outcome; the webhook has not answered (it cannot: it hangs)
    assert outcome.result is Result.DONE, outcome.reason
    assert count(metrics, "sent") == 0 and count(metrics, "failed") == 0
    await asyncio.wait_for(webhook.arrived.wait(), timeout=10)  # the POST is held by the server now
    assert not webhook.release.is_set()
    await world.recovery.notifier.close(timeout_s=0.1)  # shutdown does not wait for it either
    assert count(metrics, "sent") == 0


async def test_a_full_queue_drops_and_counts_instead_of_waiting(webhook: Webhook) -> None:
    webhook.hang = True
    hook, metrics = notifier(webhook.url, retries=0, timeout_s=30, queue_size=1)
    for n in range(3):
        hook.submit({"run": f"r{n}", "kind": "spot_interruption"})
    await asyncio.wait_for(webhook.arrived.wait(), timeout=10)
    hook.submit({"run": "r3"})
    await hook.close(timeout_s=0.1)
    assert count(metrics, "dropped") >= 2 and count(metrics, "sent") == 0


@pytest.mark.parametrize("text, error", [
    ('{"run": "$nope"}', "unknown placeholder $nope"),
    ('{"run": $run}', "not JSON once filled in"),
])
def test_a_bad_template_is_refused_naming_what_is_wrong(tmp_path: Path, text: str, error: str) -> None:
    from resilienced.errors import ConfigError
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="--notify-template") as caught:
        load_template(str(path))
    assert error in caught.value.message


# ---------------------------------------------------------------- status
async def status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]], str]:
    code = await asyncio.to_thread(cli.main, ["status", *args])
    out, err = capsys.readouterr()
    return code, status_rows(out), err


def status_rows(out: str) -> list[dict[str, Any]]:
    """The rows in ``status --json`` output (log lines of the test's own recovery set aside)."""
    from resilienced.ops.run_record import FIELDS

    parsed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [row for row in parsed if set(row) == set(FIELDS)]


async def test_status_shows_what_a_real_recovery_did(world: World, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    outcome = await spot_notice(world, step=41)
    assert outcome.result is Result.DONE, outcome.reason
    kubeconfig = world.kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    args = ("--kubeconfig", str(kubeconfig), "--claims-namespace", "resilienced")
    before = world.kubeapi.counts()

    code, rows, err = await status(capsys, *args, "--json")

    assert code == 0, err
    # read only, with the daemon's own RBAC (the emulator enforces it): one list of Leases
    calls = {k: v - before.get(k, 0) for k, v in world.kubeapi.counts().items() if v != before.get(k, 0)}
    assert calls == {("list", "leases.coordination.k8s.io"): 1}, calls
    (row,) = rows
    assert row["event_id"] == "7e9d2f6c-0000-4000-8000-000000000001"
    assert (row["kind"], row["instances"], row["run"], row["outcome"]) == (
        "spot_interruption", [instance(1)], f"{NS}/train", "done")
    assert (row["checkpoint_step"], row["durable"], row["capacity"]) == (41, True, "capacity-block")
    assert row["drained"] == ["01" * 28]
    assert datetime.fromisoformat(row["time"]) <= datetime.now(timezone.utc)

    code = await asyncio.to_thread(cli.main, ["status", *args])
    out, _ = capsys.readouterr()
    assert code == 0
    header, line = [text for text in out.splitlines() if not text.startswith("{")]
    assert header.split()[:5] == ["TIME", "KIND", "INSTANCES", "RUN", "OUTCOME"]
    assert f"{NS}/train" in line and "capacity-block" in line and " 41 " in line

    # --since: the run was handled just now; a cutoff in the future hides it
    code, rows, _ = await status(capsys, *args, "--json", "--since", "1h")
    assert code == 0 and len(rows) == 1
    code, rows, err = await status(capsys, *args, "--json", "--since", "2999-01-01T00:00:00Z")
    assert code == 0 and rows == [] and "no runs handled" in err


async def test_status_names_a_bad_since_and_needs_a_mode(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["status", "--kubeconfig", "x", "--since", "yesterday"])
    assert caught.value.code == 2 and "--since" in capsys.readouterr().err
    monkeypatch.delenv("RESILIENCED_MODE", raising=False)
    assert cli.main(["status"]) == 2
    assert "--mode" in capsys.readouterr().err


def test_a_record_written_before_the_event_fields_existed_is_summarised_with_what_it_has() -> None:
    from resilienced.ops.run_record import RunRecord

    old = {"run": "ml/train", "instances": [instance(1)],
           "durable": {"verified": False, "resume_step": 10, "steps_lost": 5, "reason": "deadline passed"},
           "requeue": {"capacity": "on-demand", "reason": "no Spot"}}
    row = RunRecord.from_json(old).summary(key="run/7e9d2f6c-0000-4000-8000-000000000001/ml/train")
    assert row["event_id"] == "7e9d2f6c-0000-4000-8000-000000000001" and row["kind"] is None
    assert (row["checkpoint_step"], row["durable"], row["steps_lost"]) == (10, False, 5)
    assert (row["capacity"], row["outcome"], row["reason"]) == ("on-demand", "done", "deadline passed")
