"""Settings: grouped, documented, from flags with environment defaults, validated once.

Every setting is a field of a frozen dataclass *group* (``QueueSettings``, ``IntakeSettings``,
``ModeSettings``, ``RecoverySettings``, ``CapacityPolicy``, ``HttpSettings``, ``LogSettings``,
``NotifySettings``, ``FollowUpSettings``, ``LedgerSettings``).
A field is declared with :func:`~resilienced.options.option` (the machinery lives in
:mod:`resilienced.options`), which carries its
flag (``--visibility-timeout``), its environment variables (``RESILIENCED_VISIBILITY_TIMEOUT``,
plus standard fallbacks such as ``AWS_REGION``), how to parse it from a string, its range
(``bounds``: checked by ``Group.check_bounds``, shown where its help says ``{range}``), and its
documentation (units, and why the default is what it is).  The CLI flags, the environment
lookup and the settings table in ``docs/intake.md`` all come from that one declaration.  A setting
with a fixed set of values holds an enum (``Mode``, ``RebalancePolicy``, ``ExportMode``), parsed
from its text once (``choice_of``); the flags and environment values are that text.

Precedence: flag, then the environment variables in order, then the default.  Parsing errors
and range errors raise :class:`~resilienced.errors.ConfigError` naming the flag; the CLI prints
``resilienced: error: <flag>: <message>`` and exits 2.  ``Settings.validate()`` runs once at
start-up; nothing downstream re-checks.

Adding a group (another issue's ``ModeSettings``, ``RaySettings`` ...): write the dataclass
with ``option()`` fields and a ``TITLE``, add a field to :class:`Settings` and an entry to
``Settings.GROUPS``.  That is all the CLI needs.
"""


from __future__ import annotations

import argparse
import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from resilienced.capacity.policy import CapacityPolicy
from resilienced.errors import ConfigError
from resilienced.model import CAPACITY_NAMES
from resilienced.options import (
    ACCOUNT_RE,
    REGION_RE,
    _AWS_QUEUE_HOST_RE,
    Group,
    Option,
    require_within,
    show_bound,
    _require_url,
    _show_default,
    boolean,
    choice,
    choice_of,
    csv,
    env_of,
    flag_of,
    integer,
    option,
    seconds,
    text,
)


# --------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class QueueSettings(Group):
    """The SQS queue the daemon consumes (EventBridge rules target it)."""

    TITLE: ClassVar[str] = "queue"

    queue_url: str | None = option(
        None, parse=text, metavar="URL",
        help="URL of the SQS queue EventBridge delivers interruption events to. Required by `run`.")
    region: str | None = option(
        None, parse=text, fallback_env=("AWS_REGION", "AWS_DEFAULT_REGION"), metavar="REGION",
        help="AWS region of the queue, and of every other AWS call (S3, EC2, FSx, Auto Scaling). "
             "When unset, taken from an AWS queue URL (https://sqs.<region>.amazonaws.com/...).")
    endpoint_url: str | None = option(
        None, parse=text, fallback_env=("AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"), metavar="URL",
        help="AWS endpoint override for every client (SQS, S3, EC2, FSx, Auto Scaling), for moto "
             "or LocalStack, such as http://127.0.0.1:5000. Unset in production: botocore picks "
             "each service's regional endpoint.")
    wait_seconds: int = option(
        20, parse=integer, bounds=(0, 20), unit="s", metavar="S",
        help="Long-poll wait of one ReceiveMessage, in seconds ({range}). 20 is SQS's maximum: "
             "fewest empty receives, and a new message is still returned as soon as it arrives.")
    batch_size: int = option(
        10, parse=integer, bounds=(1, 10), metavar="N",
        help="Messages asked for per ReceiveMessage ({range}). 10 is SQS's maximum, as NTH and "
             "Karpenter use.")
    concurrency: int = option(
        10, parse=integer, bounds=(1, 1000), metavar="N",
        help="Messages handled at the same time ({range}). 10 matches NTH's workers and "
             "Karpenter's per-batch parallelism; a mass interruption is a few hundred messages.")
    visibility_timeout: int = option(
        60, parse=integer, bounds=(2, 43200), unit="s", metavar="S",
        help="Visibility timeout given to received messages, in seconds ({range}). While a "
             "message is being handled it is extended every visibility/3, so this bounds how "
             "long a crashed replica's message stays hidden, not how long handling may take. "
             "60 s: a dead replica's work is picked up within a minute, at 3 extensions a minute.")
    shutdown_timeout: float = option(
        30.0, parse=seconds, bounds=(0, 3600), unit="s", metavar="S",
        help="On SIGTERM, how long in-flight messages may take to finish before they are "
             "released (visibility 0) for another replica, in seconds ({range}). Keep it below "
             "the pod's terminationGracePeriodSeconds (Kubernetes default 30 s) minus a few "
             "seconds; 30 s suits a grace period of 45 s or more.")
    allow_no_dlq: bool = option(
        False, parse=boolean, is_switch=True,
        help="Start even when the queue has no redrive policy (no DLQ). Poison messages are "
             "then deleted with an error log after --max-receives-without-dlq receives instead "
             "of moving to a DLQ. Off by default: nothing should be silently dropped.")
    max_receives_without_dlq: int = option(
        5, parse=integer, bounds=(1, 1000), metavar="N",
        help="With --allow-no-dlq: receives after which a poison message is deleted ({range}). "
             "5 gives a transient problem a few chances while a poison body cannot loop forever.")

    def validate(self, *, require_queue: bool = True) -> None:
        if self.queue_url is None:
            if require_queue:
                raise ConfigError("--queue-url", "required (flag --queue-url or env "
                                                 "RESILIENCED_QUEUE_URL)")
        else:
            _require_url("--queue-url", self.queue_url)
        if self.endpoint_url is not None:
            _require_url("--endpoint-url", self.endpoint_url)
        if require_queue and self.effective_region is None:
            raise ConfigError("--region", "not set and not derivable from the queue URL (flag "
                                          "--region or env RESILIENCED_REGION / AWS_REGION)")
        if self.effective_region is not None and not REGION_RE.fullmatch(self.effective_region):
            raise ConfigError("--region", f"{self.effective_region!r} is not an AWS region name")
        self.check_bounds()

    @property
    def effective_region(self) -> str | None:
        """The region given, else the one in an AWS queue URL."""
        if self.region:
            return self.region
        if self.queue_url:
            match = _AWS_QUEUE_HOST_RE.fullmatch(urlsplit(self.queue_url).hostname or "")
            if match:
                return match.group(1)
        return None


class RebalancePolicy(str, enum.Enum):
    """What a rebalance recommendation asks for."""

    NOTIFY = "notify"  # record it; nothing else
    CHECKPOINT_AHEAD = "checkpoint-ahead"  # get a durable checkpoint now; keep running
    DRAIN = "drain"  # treat it as an interruption notice


@dataclass(frozen=True)
class IntakeSettings(Group):
    """What counts as an event to act on, and the policies that shape its plan."""

    TITLE: ClassVar[str] = "intake"

    allowed_accounts: tuple[str, ...] = option(
        (), parse=csv, metavar="A,B",
        help="Comma-separated 12-digit AWS account ids whose events are accepted; others are "
             "invalid. Unset: any account, and events without an `account` field (moto's "
             "EventBridge omits it) are accepted.")
    allowed_regions: tuple[str, ...] = option(
        (), parse=csv, metavar="R,S",
        help="Comma-separated regions whose events are accepted; others are invalid. Unset: any.")
    rebalance_policy: RebalancePolicy = option(
        RebalancePolicy.NOTIFY, parse=choice_of(RebalancePolicy), metavar="POLICY",
        help="notify | checkpoint-ahead | drain. Rebalance recommendations are frequent and "
             "only mean elevated risk (AWS documents no lead time), so the default only "
             "records them; checkpoint-ahead gets a durable checkpoint without stopping the "
             "run; drain treats the recommendation as an interruption notice.")
    asg_deadline_seconds: float = option(
        120.0, parse=seconds, bounds=(1, 172800), unit="s", metavar="S",
        help="Deadline of an ASG terminate lifecycle action, in seconds after the event "
             "({range}). The hook's heartbeat timeout (30-7200 s, AWS default 3600) is not in "
             "the event; 120 s treats a terminate hook like a Spot notice, which is never too "
             "late. Set it to your hook's timeout to let runs use the slack.")
    notice_seconds: float = option(
        120.0, parse=seconds, bounds=(5, 120), unit="s", metavar="S",
        help="Lead time of a Spot interruption notice, in seconds ({range}): the deadline is the "
             "event's time plus this (also for a capacity-reservation interruption without "
             "instance-termination-time, and a rebalance under the drain policy). EC2 gives "
             "120 s; only the local drill shortens it, to play the story in less time.")
    stale_after_seconds: float = option(
        300.0, parse=seconds, bounds=(0, 86400), unit="s", metavar="S",
        help="A notice whose deadline (or, without one, whose time) passed more than this long "
             "ago is stale: acknowledged with the reason, counted in "
             "resilienced_stale_events_total, not acted on. In seconds ({range}). 5 min covers "
             "a queue backlog or a retried delivery while the run can still use the notice; "
             "older, the instance is gone and acting would drain or requeue on old news. An "
             "ASG lifecycle action is judged by its own timeout (--asg-deadline-seconds) "
             "instead: once that passed, the ASG has gone on without us.")
    future_skew_seconds: float = option(
        300.0, parse=seconds, bounds=(1, 86400), unit="s", metavar="S",
        help="A notice whose time is more than this ahead of the daemon's clock is from the "
             "future: acknowledged with the reason, counted, not acted on. In seconds "
             "({range}). EventBridge stamps events with AWS's clock; 5 min is far more than "
             "NTP-synced clocks disagree by, so only a forged or corrupted time trips it.")
    dedupe_seconds: float = option(
        86400.0, parse=seconds, bounds=(60, 1209600), unit="s", metavar="S",
        help="How long a handled event id is remembered, so a duplicate is acknowledged "
             "without acting again, in seconds ({range}). 24 h is EventBridge's default "
             "maximum event age for retried deliveries.")

    def validate(self) -> None:
        for account in self.allowed_accounts:
            if not ACCOUNT_RE.fullmatch(account):
                raise ConfigError("--allowed-accounts", f"{account!r} is not a 12-digit AWS account id")
        for region in self.allowed_regions:
            if not REGION_RE.fullmatch(region):
                raise ConfigError("--allowed-regions", f"{region!r} is not an AWS region name")
        self.check_bounds()

    @property
    def notice(self) -> timedelta:
        """The lead time of a Spot (or interruptible reservation) notice."""
        return timedelta(seconds=self.notice_seconds)


@dataclass(frozen=True)
class HttpSettings(Group):
    """The HTTP server: /metrics (Prometheus), /healthz, /readyz."""

    TITLE: ClassVar[str] = "http"

    http_host: str = option(
        "0.0.0.0", parse=lambda v: v.strip(), metavar="HOST",
        help="Address the HTTP server listens on. All interfaces, so the kubelet and "
             "Prometheus can reach it in a pod.")
    http_port: int = option(
        8080, parse=integer, bounds=(0, 65535), metavar="PORT",
        help="Port of /metrics, /healthz and /readyz (0 picks a free port; the bound port is "
             "logged). 8080 as Karpenter's metrics port.")

    def validate(self) -> None:
        if not self.http_host:
            raise ConfigError("--http-host", "must not be empty")
        self.check_bounds()


@dataclass(frozen=True)
class LogSettings(Group):
    """Logging: JSON lines on stdout, one `decision` line per message."""

    TITLE: ClassVar[str] = "log"

    log_level: str = option(
        "info", parse=choice("debug", "info", "warning", "error"), metavar="LEVEL",
        help="debug | info | warning | error. info shows one decision line per message.")

    def validate(self) -> None:
        pass


class Mode(str, enum.Enum):
    """Where the daemon finds and acts on Ray runs."""

    PLAN = "plan"  # only compute and log each plan: nothing outside is touched
    KUBERNETES = "kubernetes"  # KubeRay on Kubernetes (EKS)
    RAY = "ray"  # one Ray cluster without Kubernetes (EC2 cluster launcher, the local drill)


@dataclass(frozen=True)
class ModeSettings(Group):
    """Where the Ray runs are: KubeRay on Kubernetes, a Ray cluster without it, or plan only."""

    TITLE: ClassVar[str] = "mode"

    mode: Mode = option(
        Mode.PLAN, parse=choice_of(Mode), metavar="MODE",
        help="plan | kubernetes | ray. plan computes and logs each event's plan and touches "
             "nothing (a safe default for a daemon whose job is to drain nodes: acting is "
             "opted into); kubernetes finds KubeRay runs through the API server; ray acts on "
             "the one Ray cluster at --ray-address.")
    kubeconfig: str | None = option(
        None, parse=text, metavar="PATH",
        help="Kubeconfig file (kubernetes mode). Unset: the in-cluster ServiceAccount.")
    kube_context: str | None = option(
        None, parse=text, metavar="NAME", help="Kubeconfig context (kubernetes mode).")
    claims_namespace: str = option(
        "resilienced", parse=lambda v: v.strip(), fallback_env=("POD_NAMESPACE",),
        metavar="NS",
        help="Namespace of the Leases that make replicas act once per event and run "
             "(kubernetes mode); the daemon's own namespace.")
    kueue_api_version: str = option(
        "auto", parse=choice("auto", "v1beta2", "v1beta1"), metavar="VERSION",
        help="Kueue Workload API version (kubernetes mode): auto asks the API server's discovery at "
             "start-up and takes v1beta2 (Kueue >= 0.15) where served, else v1beta1 (Kueue 0.14); "
             "v1beta2 or v1beta1 forces it (a cluster whose discovery the daemon may not read).")
    ray_address: str | None = option(
        None, parse=text, metavar="HOST:PORT",
        help="GCS address of the Ray cluster (ray mode), such as 10.0.0.5:6379.")
    ray_token_file: str | None = option(
        None, parse=text, metavar="PATH",
        help="File holding the Ray cluster's auth token (ray mode). Unset: RAY_AUTH_TOKEN, "
             "then ~/.ray/auth_token, as Ray itself looks; a cluster without auth needs none.")
    instance_label: str = option(
        "resilienced.io/instance-id", parse=lambda v: v.strip(), metavar="KEY",
        help="Ray node label holding the EC2 instance id (ray mode). Start nodes with "
             "`ray start --labels=resilienced.io/instance-id=$(ec2-metadata -i | cut -d' ' -f2)`; "
             "unlabelled nodes are found by private IP through DescribeInstances.")
    checkpoint_uri: str | None = option(
        None, parse=text, metavar="S3URI",
        help="S3 prefix of the run's checkpoints, s3://bucket/prefix (ray mode; in kubernetes "
             "mode the RayJob/RayCluster annotation resilienced.io/checkpoint-uri says it).")
    instance_type: str | None = option(
        None, parse=text, metavar="TYPE",
        help="Instance type of the Ray cluster's worker pool (ray mode), for the capacity "
             "decision; kubernetes mode reads it from the Node's labels.")

    def validate(self) -> None:
        if self.mode is Mode.RAY and not self.ray_address:
            raise ConfigError("--ray-address", "required in ray mode (flag --ray-address or env "
                                               "RESILIENCED_RAY_ADDRESS)")
        if self.checkpoint_uri is not None and not self.checkpoint_uri.startswith("s3://"):
            raise ConfigError("--checkpoint-uri", f"expected s3://bucket/prefix, got {self.checkpoint_uri!r}")
        if not self.instance_label:
            raise ConfigError("--instance-label", "must not be empty")
        if not self.claims_namespace:
            raise ConfigError("--claims-namespace", "must not be empty")


class ExportMode(str, enum.Enum):
    """How a checkpoint reaches S3 from FSx."""

    AUTO = "auto"  # the data repository association auto-exports; the daemon watches S3
    TASK = "task"  # the daemon starts an FSx export task and waits for it


@dataclass(frozen=True)
class RecoverySettings(Group):
    """How a notice becomes a durable checkpoint: export mode, waits, FSx."""

    TITLE: ClassVar[str] = "recovery"

    export_mode: ExportMode = option(
        ExportMode.AUTO, parse=choice_of(ExportMode), metavar="MODE",
        help="auto | task. auto: the FSx data repository association auto-exports new and "
             "changed files, and the daemon watches S3 until the checkpoint is there. task: the "
             "daemon starts an FSx export task for the run's checkpoint path and waits for it "
             "(auto-export and export tasks cannot run at the same time on one association).")
    fsx_file_system_id: str | None = option(
        None, parse=text, metavar="FS",
        help="FSx for Lustre file system id, fs-... (export mode task).")
    fsx_file_system_path: str = option(
        "/", parse=lambda v: v.strip() or "/", metavar="PATH",
        help="File system path of the data repository association (export mode task), such "
             "as /checkpoints: with --fsx-data-repository-path it maps a run's checkpoint URI "
             "to the path an export task exports.")
    fsx_data_repository_path: str | None = option(
        None, parse=text, metavar="S3URI",
        help="S3 path of the data repository association (export mode task), such as "
             "s3://bucket/checkpoints.")
    durable_grace_seconds: float = option(
        60.0, parse=seconds, bounds=(0, 3600), unit="s", metavar="S",
        help="How long after the deadline S3 is still watched for the checkpoint, in seconds "
             "({range}): FSx may still be exporting what the run saved just before the node "
             "went.")
    durable_poll_seconds: float = option(
        2.0, parse=seconds, bounds=(0.05, 60), unit="s", metavar="S",
        help="Seconds between looks at S3 (and at an export task) while waiting ({range}). "
             "2 s: a list of a checkpoint prefix is cheap; FSx task status only updates every 30 s.")
    checkpoint_ahead_seconds: float = option(
        600.0, parse=seconds, bounds=(10, 86400), unit="s", metavar="S",
        help="Drain deadline given when an event has none (rebalance with checkpoint-ahead), in "
             "seconds ({range}).")
    node_join_seconds: tuple[str, ...] = option(
        (), parse=lambda v: _join_priors(v), bounds=(1, 3600), unit="s", metavar="S|KIND=S,...",
        help="Elastic runs: how long a replacement node takes to join the Ray cluster (launch, "
             "boot, image pull, ray start), in seconds ({range}), for all capacity kinds (240) or "
             "per kind (spot=240,on-demand=180,capacity-block=120). Used until the daemon has "
             "measured joins of that kind in the cluster; unset: no estimate before one is "
             "measured (the run then shrinks at once). docs/requeue.md, \"Elastic runs\".")

    def validate(self) -> None:
        if self.export_mode is ExportMode.TASK:
            if not self.fsx_file_system_id:
                raise ConfigError("--fsx-file-system-id", "required with --export-mode task")
            if not self.fsx_data_repository_path or not self.fsx_data_repository_path.startswith("s3://"):
                raise ConfigError("--fsx-data-repository-path",
                                  "required with --export-mode task, as s3://bucket/prefix")
        self.check_bounds()
        for kind, value in self.node_join_priors.items():
            require_within(f"--node-join-seconds ({kind})", value, self.bounds_of("node_join_seconds"), "s")

    @property
    def node_join_priors(self) -> dict[str, float]:
        """``--node-join-seconds`` as {capacity kind: seconds}."""
        return {kind: float(value) for kind, value in (item.split("=", 1) for item in self.node_join_seconds)}

    def export_paths(self, checkpoint_uri: str) -> list[str]:
        """The FSx path(s) an export task exports for a run whose checkpoints are at ``checkpoint_uri``."""
        base = (self.fsx_data_repository_path or "").rstrip("/")
        if not checkpoint_uri.startswith(base + "/") and checkpoint_uri.rstrip("/") != base:
            raise ConfigError("--fsx-data-repository-path",
                              f"checkpoint URI {checkpoint_uri} is not under the association's "
                              f"S3 path {base}")
        rest = checkpoint_uri[len(base):].strip("/")
        root = self.fsx_file_system_path.rstrip("/")
        return [f"{root}/{rest}" if rest else (root or "/")]


@dataclass(frozen=True)
class NotifySettings(Group):
    """Where a message goes once a run has been handled (a chat webhook)."""

    TITLE: ClassVar[str] = "notify"

    notify_webhook: str | None = option(
        None, parse=text, metavar="URL",
        help="Webhook URL that gets one POST per run per event once it is handled (Slack "
             "incoming webhook, or any HTTP endpoint taking JSON). Unset: no notifications. "
             "It holds a secret: in Kubernetes give --notify-webhook-file instead (the Secret "
             "resilienced-notify mounted as a file), never the ConfigMap.")
    notify_webhook_file: str | None = option(
        None, parse=text, metavar="PATH",
        help="File holding the webhook URL (a mounted Secret; read once at start). A file that "
             "does not exist turns notifications off (the Secret is optional); an empty file or "
             "one without an http(s) URL is an error. Not with --notify-webhook.")
    notify_template: str | None = option(
        None, parse=text, metavar="FILE",
        help="JSON body template replacing the Slack-compatible default, with $placeholders "
             "(event_id, kind, time, instances, run, drained, checkpoint_step, durable, "
             "steps_lost, capacity, capacity_reason, outcome, reason, stage, "
             "seconds_from_notice); see docs/operations.md.")
    notify_timeout_seconds: float = option(
        5.0, parse=seconds, bounds=(0.1, 60), unit="s", metavar="S",
        help="Total time one POST may take, in seconds ({range}). Slack answers in well under a "
             "second; 5 s bounds a hanging endpoint. The recovery never waits for it.")
    notify_retries: int = option(
        2, parse=integer, bounds=(0, 10), metavar="N",
        help="Retries of a POST that timed out, could not connect or got 429/5xx ({range}), after "
             "0.5 s, 1 s, 2 s ... Then the failure is counted and logged.")

    def validate(self) -> None:
        if self.notify_webhook is not None and self.notify_webhook_file is not None:
            raise ConfigError("--notify-webhook-file", "give --notify-webhook or "
                                                       "--notify-webhook-file, not both")
        if self.notify_webhook is not None:
            _require_url("--notify-webhook", self.notify_webhook)
        if self.notify_template is not None and self.notify_webhook is None \
                and self.notify_webhook_file is None:
            raise ConfigError("--notify-template", "given without --notify-webhook")
        self.webhook_url()
        self.check_bounds()

    def webhook_url(self) -> str | None:
        """The URL given, else the one in --notify-webhook-file (None: no notifications)."""
        if self.notify_webhook_file is None:
            return self.notify_webhook
        try:
            url = Path(self.notify_webhook_file).read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError("--notify-webhook-file", f"cannot read {self.notify_webhook_file}: "
                                                       f"{e.strerror or e}") from None
        if not url:
            raise ConfigError("--notify-webhook-file", f"{self.notify_webhook_file} is empty")
        try:
            _require_url("--notify-webhook-file", url)
        except ConfigError:  # not echoing the file: what it holds may be the secret
            raise ConfigError("--notify-webhook-file", f"{self.notify_webhook_file} does not hold "
                                                       "an http(s) URL") from None
        return url


@dataclass(frozen=True)
class FollowUpSettings(Group):
    """After the requeue: following each run until it trains again, and falling back when it stalls."""

    TITLE: ClassVar[str] = "follow-up"

    follow_up: bool = option(
        True, parse=boolean, metavar="BOOL",
        help="Follow every requeued run until it trains again (kubernetes and ray modes): admitted, "
             "scheduled (ray mode: joined), training; fall back to the next capacity when a stage "
             "stalls. false: a recovery ends with the requeue, as before (docs/requeue.md).")
    admitted_bound_seconds: float = option(
        600.0, parse=seconds, bounds=(5, 86400), unit="s", metavar="S",
        help="How long a Kueue-managed run's Workload may stay pending after the requeue before the "
             "recovery counts as stalled, in seconds ({range}). 10 min: Kueue admits within seconds "
             "when quota is free; minutes of pending mean quota or flavors do not fit.")
    scheduled_bound_seconds: float = option(
        900.0, parse=seconds, bounds=(5, 86400), unit="s", metavar="S",
        help="How long the gang's worker pods may wait for Nodes of the decided capacity (ray mode: "
             "for the replacement node to join) before the recovery counts as stalled, in seconds "
             "({range}). 15 min: Karpenter launches and a GPU node boots and joins in 3-10 min.")
    training_bound_seconds: float = option(
        900.0, parse=seconds, bounds=(5, 86400), unit="s", metavar="S",
        help="How long the run may take to train a step again once scheduled (image pull, Ray start, "
             "checkpoint restore), in seconds ({range}). 15 min covers a multi-GB image and a large "
             "restore; the trainer's resume record says when it trained again.")
    max_fallbacks: int = option(
        2, parse=integer, bounds=(0, 10), metavar="N",
        help="Moves to the next capacity a stalled recovery may make before the run is stuck ({range}). "
             "2: Spot -> Capacity Block -> On-Demand covers the ranking; more moves restart the gang "
             "for little.")
    fallback_cooldown_seconds: float = option(
        1800.0, parse=seconds, bounds=(60, 604800), unit="s", metavar="S",
        help="How long capacity that stalled a run's recovery is not tried again for that run, in "
             "seconds ({range}). 30 min: longer than a stall bound, shorter than a Spot wave.")
    follow_up_interval_seconds: float = option(
        15.0, parse=seconds, bounds=(0.2, 600), unit="s", metavar="S",
        help="Seconds between two looks at every followed run ({range}). 15 s: a few API reads per "
             "run, small next to the bounds.")
    follow_up_claim_ttl_seconds: float = option(
        60.0, parse=seconds, bounds=(10, 3600), unit="s", metavar="S",
        help="TTL of a run's move claim held by the follow-up while it looks at or moves the run, "
             "renewed every third of it, in seconds ({range}). 60 s, as the run claims (the "
             "visibility timeout): a replica that dies mid-move leaves the run to another within "
             "it. (The requeue step of a notice holds the same claim with the run claim's TTL.)")

    def validate(self) -> None:
        self.check_bounds()


def _ratio(value: str) -> float:
    """A ratio, refused as it is read when outside ``--goodput-floor``'s declared bounds."""
    number = float(value)
    low, high = LedgerSettings.bounds_of("goodput_floor")
    assert isinstance(low, (int, float)) and isinstance(high, (int, float))
    if not low <= number <= high:
        raise ValueError(f"expected a ratio between {show_bound(low)} and {show_bound(high)}, got {value!r}")
    return number


@dataclass(frozen=True)
class LedgerSettings(Group):
    """The ledger: what each interruption cost and what the capacity cost (docs/operations.md)."""

    TITLE: ClassVar[str] = "ledger"

    on_demand_prices: str | None = option(
        None, parse=text, metavar="FILE",
        help="JSON file of On-Demand prices per instance-hour in USD ({\"on-demand\": {\"p5.48xlarge\": "
             "98.32, \"us-west-2/p5.48xlarge\": ...}, \"capacity-block\": {\"cr-...\": {\"upfront_fee\": ..., "
             "\"hours\": ..., \"instances\": ...}}}), read first; what it lacks is asked of the AWS Pricing API "
             "(GetProducts, us-east-1). For clusters that cannot reach the Pricing API. Unset: the API only.")
    goodput_floor: float = option(
        0.8, parse=_ratio, bounds=(0, 1), metavar="RATIO",
        help="The goodput below which a run is alerted on (ResilienceRunGoodputLow), {range}: exported as "
             "resilienced_goodput_floor_ratio for the alert rule. 0.8: a run that loses a fifth of its "
             "GPU time to interruptions is worth a look.")

    def validate(self) -> None:
        self.check_bounds()
        if self.on_demand_prices is not None:  # read once here; its entries are checked as the daemon opens it
            try:
                json.loads(Path(self.on_demand_prices).read_text())
            except (OSError, ValueError) as e:
                raise ConfigError("--on-demand-prices", f"{self.on_demand_prices}: {e}") from None


@dataclass(frozen=True)
class Ec2NodeSettings(Group):
    """Ray mode on EC2: the replacement nodes the daemon launches (docs/ray.md, "Ray on EC2")."""

    TITLE: ClassVar[str] = "ec2 nodes"

    ec2_launch_template: str | None = option(
        None, parse=text, metavar="ID|NAME",
        help="Launch template (lt-... id or name) the replacement nodes of ray mode are launched from "
             "with RunInstances, one per lost node, on the decided capacity (Spot one-time, the "
             "Capacity Block, On-Demand). Its user-data runs deploy/aws/ray-node-user-data.sh. Unset: "
             "no EC2 node provider (nothing is launched; Ray's autoscaler or you replace the nodes).")
    ec2_launch_template_version: str = option(
        "$Default", parse=lambda v: v.strip(), metavar="VERSION",
        help="Version of --ec2-launch-template: $Default, $Latest or a number.")
    ec2_subnets: tuple[str, ...] = option(
        (), parse=csv, metavar="ZONE=SUBNET,...",
        help="Subnet per Availability Zone, such as us-east-1a=subnet-0abc...,us-east-1b=subnet-0def...: "
             "a replacement goes into the subnet of its pool's zone (a block's zone). Unset: the "
             "launch template's network settings.")
    ec2_owner: str = option(
        "resilienced", parse=lambda v: v.strip(), metavar="NAME",
        help="Value of the resilienced.io/launched-by tag on the instances the daemon launches: "
             "one per Ray cluster. The daemon lists and terminates only instances with it, and the "
             "IAM policy (deploy/aws, Ec2NodeOwner) lets it launch and terminate no other.")
    ec2_on_demand_reservation_preference: str | None = option(
        None, parse=lambda v: choice("open", "none", "capacity-reservations-only")(v) if v.strip() else None,
        metavar="PREF",
        help="CapacityReservationPreference of On-Demand launches: open | none | "
             "capacity-reservations-only. Unset: the launch template's.")
    ec2_gcs_address: str | None = option(
        None, parse=text, metavar="HOST:PORT",
        help="GCS address the new nodes join (the resilienced.io/gcs-address tag the user-data "
             "reads). Unset: --ray-address.")
    ec2_autoscaler_capacities: tuple[str, ...] = option(
        (), parse=csv, metavar="KIND,...",
        help="Capacities Ray's own autoscaler gives on this cluster (its node types), such as "
             "spot,on-demand: the daemon launches none of them (the autoscaler replaces the node) "
             "and falls back to what only it launches, a Capacity Block. Unset: the daemon "
             "launches every capacity (a cluster without an autoscaler).")

    def validate(self) -> None:
        for entry in self.ec2_subnets:
            zone, sep, subnet = (part.strip() for part in entry.partition("="))
            if not sep or not zone or not re.fullmatch(r"subnet-[0-9a-f]{8,17}", subnet):
                raise ConfigError("--ec2-subnets", f"{entry!r}: expected ZONE=subnet-<hex>")
        for kind in self.ec2_autoscaler_capacities:
            if kind not in CAPACITY_NAMES:
                raise ConfigError("--ec2-autoscaler-capacities",
                                  f"{kind!r}: expected one of {', '.join(CAPACITY_NAMES)}")
        if not self.ec2_owner or not re.fullmatch(r"[A-Za-z0-9_.:=+@-]{1,128}", self.ec2_owner):
            raise ConfigError("--ec2-owner", f"{self.ec2_owner!r}: 1-128 of letters, digits and _.:=+@-")


# --------------------------------------------------------------------------- all groups

def _join_priors(value: str) -> tuple[str, ...]:
    """``240`` or ``spot=240,on-demand=180`` -> ("capacity-block=240", ...): one per kind given."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if len(items) == 1 and "=" not in items[0]:
        return tuple(f"{kind}={seconds(items[0])}" for kind in CAPACITY_NAMES)
    out = {}
    for item in items:
        kind, sep, number = item.partition("=")
        kind = kind.strip().lower()
        if not sep or kind not in CAPACITY_NAMES:
            raise ValueError(f"expected seconds or KIND=seconds with KIND one of {', '.join(CAPACITY_NAMES)}, "
                             f"got {item!r}")
        out[kind] = seconds(number)
    return tuple(f"{kind}={out[kind]}" for kind in sorted(out))


@dataclass(frozen=True)
class Settings:
    """Every group the daemon reads.  Build with :meth:`from_args`, then :meth:`validate` once."""

    queue: QueueSettings = field(default_factory=QueueSettings)
    intake: IntakeSettings = field(default_factory=IntakeSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    log: LogSettings = field(default_factory=LogSettings)
    mode: ModeSettings = field(default_factory=ModeSettings)
    recovery: RecoverySettings = field(default_factory=RecoverySettings)
    capacity: CapacityPolicy = field(default_factory=CapacityPolicy)
    notify: NotifySettings = field(default_factory=NotifySettings)
    follow_up: FollowUpSettings = field(default_factory=FollowUpSettings)
    ledger: LedgerSettings = field(default_factory=LedgerSettings)
    ec2_nodes: Ec2NodeSettings = field(default_factory=Ec2NodeSettings)
    # -- Another group: add a field and an entry in GROUPS; `run` then takes its flags.

    GROUPS: ClassVar[dict[str, type[Group]]] = {
        "queue": QueueSettings,
        "intake": IntakeSettings,
        "http": HttpSettings,
        "log": LogSettings,
        "mode": ModeSettings,
        "recovery": RecoverySettings,
        "capacity": CapacityPolicy,
        "notify": NotifySettings,
        "follow_up": FollowUpSettings,
        "ledger": LedgerSettings,
        "ec2_nodes": Ec2NodeSettings,
    }

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for group in cls.GROUPS.values():
            group.add_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace | Sequence[str] | None,
                  environ: Mapping[str, str]) -> Settings:
        """Settings from parsed flags (or a list of flag strings) and the environment."""
        if args is None or not isinstance(args, argparse.Namespace):
            parser = argparse.ArgumentParser(prog="resilienced run")
            cls.add_arguments(parser)
            args = parser.parse_args(list(args or []))
        groups: dict[str, Any] = {name: group.from_args(args, environ) for name, group in cls.GROUPS.items()}
        return cls(**groups)  # each name's group, as GROUPS pairs them

    def validate(self) -> Settings:
        """Check every group once; raise ConfigError naming the first bad setting."""
        for name in self.GROUPS:
            getattr(self, name).validate()
        if self.ec2_nodes.ec2_launch_template and self.mode.mode is not Mode.RAY:
            raise ConfigError("--ec2-launch-template", f"launches ray mode's replacement nodes; --mode is "
                                                       f"{self.mode.mode.value}")
        return self


def documented_options() -> list[tuple[str, str, str, str, str]]:
    """(group, flag, env, default, help) for every setting: the docs table is made from this."""
    rows = []
    for title, group in Settings.GROUPS.items():
        for f in group.options():
            meta: Option = f.metadata["option"]
            rows.append((title, flag_of(f), " / ".join(env_of(f)), _show_default(f.default), meta.help))
    return rows
