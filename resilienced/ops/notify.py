"""Notifications: one webhook POST per run per event once the daemon has handled it, and one when
the run trains again (``resumed``), falls back to other capacity (``fell back``) or is ``stuck``
(``resilienced.followup.follower``).

:class:`Notifier` is off the recovery's path: :meth:`Notifier.submit` only puts the facts on a
bounded in-memory queue (never waits, never raises; when the queue is full the notification
is dropped and counted), and one background task POSTs them.  Each POST has a total timeout
(``--notify-timeout-seconds``) and is retried ``--notify-retries`` times on a connection error,
a timeout, a 429 or a 5xx, with a doubling pause (0.5 s, 1 s, 2 s...).  So a webhook that
answers 500, hangs or refuses the connection costs the recovery nothing; its failures are
counted in ``resilienced_notifications_total{outcome="failed"}``.

The body is Slack-compatible by default (``text`` plus ``blocks``, :func:`slack_body`).
``--notify-template FILE`` replaces it: the file is a JSON document with ``$name`` placeholders
(Python ``string.Template``), each replaced by the fact as JSON string content (escaped, without
the quotes), so ``{"msg": "run $run: $outcome"}`` stays valid JSON.  The placeholders are the
keys of :data:`FACTS`; an unknown one, or a template that is not JSON once filled, is refused
at start-up (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import string
from collections.abc import Mapping
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from resilienced import log, retry
from resilienced.errors import ConfigError
from resilienced.model import JsonValue
from resilienced.retry import Backoff

#: The facts of one notification (the template's placeholders), with a sample of each.
FACTS: dict[str, JsonValue] = {
    "event_id": "0b3e2a8c-1111-2222-3333-444455556666",
    "kind": "spot_interruption",
    "time": "2026-01-01T00:00:00+00:00",
    "instances": "i-0123456789abcdef0",
    "run": "team-a/llm-pretrain",
    "drained": "4f1e...",
    "checkpoint_step": "1200",
    "durable": "yes",
    "steps_lost": "0",
    "capacity": "spot",
    "capacity_reason": "spot pool healthy",
    "outcome": "done",
    "reason": "",
    "stage": "training",
    "seconds_from_notice": "95",
    # the recovery's ledger (resilienced.ops.ledger), on resumed and stuck: what the interruption cost
    "lost_gpu_seconds": "5968",
    "premium_usd": "32.0",
    "goodput": "0.906",
}
#: How many notifications may wait for the webhook before new ones are dropped.
QUEUE_SIZE = 1000
#: How long a stopping daemon waits for queued notifications before dropping them.
CLOSE_TIMEOUT_S = 5.0
OUTCOMES = ("sent", "failed", "dropped")


class NotifyMetrics:
    """``resilienced_notifications_total{outcome}`` (sent, failed, dropped)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.notifications = Counter("resilienced_notifications", "Webhook notifications, by "
                                     "outcome (sent, failed, dropped).", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.notifications.labels(outcome=outcome)


def load_template(path: str | None) -> str | None:
    """The template in ``path``, checked against the sample facts; ConfigError naming what is wrong."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("--notify-template", f"cannot read {path}: {e.strerror or e}") from None
    try:
        render(text, FACTS)
    except KeyError as e:
        raise ConfigError("--notify-template", f"{path}: unknown placeholder ${e.args[0]} (known: "
                                               f"{', '.join(sorted(FACTS))})") from None
    except ValueError as e:
        raise ConfigError("--notify-template", f"{path}: not JSON once filled in: {e}") from None
    return text


def render(template: str, facts: Mapping[str, JsonValue]) -> JsonValue:
    """The body a template gives for ``facts`` (parsed JSON); KeyError / ValueError when it cannot."""
    escaped = {k: json.dumps("" if v is None else str(v))[1:-1] for k, v in facts.items()}
    return json.loads(string.Template(template).substitute(escaped))


def flat(facts: Mapping[str, JsonValue]) -> dict[str, str]:
    """Facts as strings (lists joined by commas, booleans as yes/no, None as '-')."""
    def text(value: object) -> str:
        if value is None or value == []:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, (list, tuple)):
            return ", ".join(str(v) for v in value)
        return str(value)
    return {key: text(facts.get(key)) for key in FACTS}


#: Outcomes of the follow-up after the requeue (resilienced.followup.follower), with their headline.
FOLLOW_UP_OUTCOMES = {"resumed": "trains again", "fell back": "fell back", "stuck": "is stuck"}


def headline_of(f: Mapping[str, str]) -> str:
    """The one-line summary: the handled notice, or what the follow-up saw of the run afterwards."""
    if f["outcome"] in FOLLOW_UP_OUTCOMES:
        return (f"run {f['run']} {FOLLOW_UP_OUTCOMES[f['outcome']]} (stage {f['stage']}, capacity {f['capacity']}, "
                f"{f['seconds_from_notice']}s after the notice; step {f['checkpoint_step']})")
    return (f"{f['kind']} on {f['instances']}, run {f['run']}: {f['outcome']}; "
            f"checkpoint step {f['checkpoint_step']} durable {f['durable']}, "
            f"steps lost {f['steps_lost']}, capacity {f['capacity']}")


def slack_body(facts: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
    """The default body: Slack's ``text`` (fallback, and what other chat webhooks show) and blocks."""
    f = flat(facts)
    headline = headline_of(f)
    fields = [("Kind", "kind"), ("Instance(s)", "instances"), ("Run", "run"),
              ("Drained nodes", "drained"), ("Checkpoint step", "checkpoint_step"),
              ("Durable", "durable"), ("Steps lost", "steps_lost"), ("Capacity", "capacity"),
              ("Capacity reason", "capacity_reason"), ("Outcome", "outcome"), ("Stage", "stage"),
              ("Seconds from the notice", "seconds_from_notice")]
    if f["lost_gpu_seconds"] != "-" or f["goodput"] != "-":  # the ledger, on resumed and stuck
        fields += [("Lost GPU-seconds", "lost_gpu_seconds"), ("Premium over Spot (USD)", "premium_usd"),
                   ("Goodput", "goodput")]
    blocks: list[JsonValue] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*resilienced*: {headline}"}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{title}*\n{f[key]}"}
                                       for title, key in fields]},
        {"type": "context", "elements": [{"type": "mrkdwn",
                                          "text": f"event {f['event_id']} at {f['time']}"
                                                  + (f"; {f['reason']}" if f["reason"] != "-" else "")}]},
    ]
    return {"text": f"resilienced: {headline}", "blocks": blocks}


class Notifier:
    """POSTs facts to ``url`` from a background task; see the module docstring."""

    def __init__(self, *, url: str, template: str | None = None, timeout_s: float = 5.0,
                 retries: int = 2, metrics: NotifyMetrics | None = None,
                 queue_size: int = QUEUE_SIZE, backoff_s: float = 0.5) -> None:
        self.url = url
        self.template = template
        self.timeout_s = timeout_s
        self.retries = retries
        self.metrics = metrics
        self.backoff_s = backoff_s
        self._queue: asyncio.Queue[dict[str, JsonValue]] = asyncio.Queue(maxsize=queue_size)
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log = log.get("resilienced.notify")

    def body(self, facts: Mapping[str, JsonValue]) -> JsonValue:
        if self.template is None:
            return slack_body(facts)
        return render(self.template, flat(facts))

    def submit(self, facts: Mapping[str, JsonValue]) -> None:
        """Queue one notification; returns at once (drops and counts it when the queue is full)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._worker(),
                                                                name="resilienced.notify")
        try:
            self._queue.put_nowait(dict(facts))
        except asyncio.QueueFull:
            self._count("dropped")
            self._log.warning("notification dropped: the queue is full", run=facts.get("run"),
                              event_id=facts.get("event_id"))

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued within ``timeout_s``, then stop (what is left is dropped)."""
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._queue.join()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while not self._queue.empty():
            self._queue.get_nowait()
            self._count("dropped")
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _worker(self) -> None:
        while True:
            facts = await self._queue.get()
            try:
                await self._send(facts)
            except asyncio.CancelledError:  # close() gave up on it
                self._count("dropped")
                raise
            except Exception as e:  # never let one notification stop the others
                self._count("failed")
                self._log.warning("notification failed", run=facts.get("run"), error=f"{type(e).__name__}: {e}")
            finally:
                self._queue.task_done()

    async def _send(self, facts: Mapping[str, JsonValue]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        payload = json.dumps(self.body(facts)).encode()
        error, attempt = "", 0
        async for attempt in retry.attempts(self.retries + 1, backoff=Backoff(self.backoff_s)):
            try:
                async with self._session.post(self.url, data=payload,
                                              headers={"Content-Type": "application/json"}) as resp:
                    if resp.status < 300:
                        self._count("sent")
                        return
                    error = f"HTTP {resp.status}"
                    if resp.status != 429 and resp.status < 500:
                        break  # the webhook refuses this body: retrying cannot help
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                error = f"{type(e).__name__}: {e}"
        self._count("failed")
        self._log.warning("notification failed", run=facts.get("run"), event_id=facts.get("event_id"),
                          attempts=attempt + 1, error=error)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.notifications.labels(outcome=outcome).inc()
