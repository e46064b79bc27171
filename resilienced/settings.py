"""Settings: grouped, documented, from flags with environment defaults, validated once.

Every setting is a field of a frozen dataclass *group* (``QueueSettings``, ``IntakeSettings``,
``HttpSettings``, ``LogSettings``).  A field is declared with :func:`option`, which carries its
flag (``--visibility-timeout``), its environment variables (``RESILIENCED_VISIBILITY_TIMEOUT``,
plus standard fallbacks such as ``AWS_REGION``), how to parse it from a string, and its
documentation (units, and why the default is what it is).  The CLI flags, the environment
lookup and the settings table in ``docs/intake.md`` all come from that one declaration.

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
import dataclasses
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from resilienced.errors import ConfigError

ENV_PREFIX = "RESILIENCED_"

ACCOUNT_RE = re.compile(r"[0-9]{12}")
REGION_RE = re.compile(r"[a-z]{2}(?:-[a-z]+)+-[0-9]{1,2}")
_AWS_QUEUE_HOST_RE = re.compile(r"sqs\.([a-z]{2}(?:-[a-z]+)+-[0-9]{1,2})\.amazonaws\.com(?:\.cn)?")


# --------------------------------------------------------------------------- declaring options
@dataclass(frozen=True)
class Option:
    """How one setting is given and documented (kept in the dataclass field's metadata)."""

    help: str
    parse: Callable[[str], Any]
    flag: str | None = None  # default: --field-name
    env: tuple[str, ...] = ()  # default: (RESILIENCED_FIELD_NAME,)
    fallback_env: tuple[str, ...] = ()  # standard variables read after ours (AWS_REGION ...)
    metavar: str | None = None
    is_switch: bool = False  # a flag without a value (store_true)


def option(default: Any, *, help: str, parse: Callable[[str], Any], flag: str | None = None,
           fallback_env: Sequence[str] = (), metavar: str | None = None,
           is_switch: bool = False) -> Any:
    """Declare a setting: its default, documentation, and how to parse it from a string."""
    meta = Option(help=help, parse=parse, flag=flag, fallback_env=tuple(fallback_env),
                  metavar=metavar, is_switch=is_switch)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use an immutable default (a tuple)")
    return field(default=default, metadata={"option": meta})


def flag_of(f: dataclasses.Field) -> str:
    meta: Option = f.metadata["option"]
    return meta.flag or "--" + f.name.replace("_", "-")


def env_of(f: dataclasses.Field) -> tuple[str, ...]:
    meta: Option = f.metadata["option"]
    return (meta.env or (ENV_PREFIX + f.name.upper(),)) + meta.fallback_env


# --------------------------------------------------------------------------- parsers (str -> value)
def text(value: str) -> str | None:
    value = value.strip()
    return value or None


def integer(value: str) -> int:
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ValueError(f"expected a whole number, got {value!r}") from None


def seconds(value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number of seconds, got {value!r}")
    return number


def boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        value = value.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value
    return parse


# --------------------------------------------------------------------------- the group machinery
G = TypeVar("G", bound="Group")


class Group:
    """Mixin for a settings group: argparse flags, env lookup, and ``validate()``."""

    TITLE: ClassVar[str] = "settings"

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "option" in f.metadata]  # type: ignore[arg-type]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, only: Sequence[str] | None = None) -> None:
        """Add this group's flags (all, or the named fields) to ``parser``.

        Every flag defaults to ``None`` so that :meth:`from_args` can tell "not given" from a
        value and fall back to the environment.
        """
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None
        group = parser.add_argument_group(cls.TITLE, doc)
        for f in cls.options():
            if only is not None and f.name not in only:
                continue
            meta: Option = f.metadata["option"]
            envs = " / ".join(env_of(f))
            default = _show_default(f.default)
            help_text = f"{meta.help.split('. ')[0].rstrip('.')}. [env {envs}; default {default}]"
            if meta.is_switch:
                group.add_argument(flag_of(f), dest=f.name, action="store_const", const="true",
                                   default=None, help=help_text)
            else:
                group.add_argument(flag_of(f), dest=f.name, default=None, metavar=meta.metavar,
                                   help=help_text)

    @classmethod
    def from_args(cls: type[G], args: argparse.Namespace | None, environ: Mapping[str, str]) -> G:
        """Build the group from parsed flags (strings) and the environment; parse errors raise ConfigError."""
        values: dict[str, Any] = {}
        for f in cls.options():
            meta: Option = f.metadata["option"]
            raw = getattr(args, f.name, None) if args is not None else None
            origin = flag_of(f)
            if raw is None:
                for name in env_of(f):
                    if environ.get(name) not in (None, ""):
                        raw, origin = environ[name], f"env {name}"
                        break
            if raw is None:
                continue
            try:
                values[f.name] = meta.parse(raw)
            except ValueError as e:
                raise ConfigError(flag_of(f), f"{e} (from {origin})") from None
        return cls(**values)

    def validate(self) -> None:  # pragma: no cover - every group overrides
        """Raise ConfigError for a value that cannot work."""


def _show_default(value: Any) -> str:
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _require_range(flag: str, value: float, low: float, high: float, unit: str = "") -> None:
    if not (low <= value <= high):
        suffix = f" {unit}" if unit else ""
        raise ConfigError(flag, f"must be between {_show_default(float(low))} and "
                                f"{_show_default(float(high))}{suffix}, got {_show_default(value)}")


def _require_url(flag: str, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(flag, f"expected an http(s) URL, got {value!r}")


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
        help="AWS region of the queue. When unset, taken from an AWS queue URL "
             "(https://sqs.<region>.amazonaws.com/...).")
    endpoint_url: str | None = option(
        None, parse=text, fallback_env=("AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"), metavar="URL",
        help="SQS endpoint override, for moto or LocalStack, such as http://127.0.0.1:5000. "
             "Unset in production: botocore picks the regional endpoint.")
    wait_seconds: int = option(
        20, parse=integer, metavar="S",
        help="Long-poll wait of one ReceiveMessage, in seconds (0-20). 20 is SQS's maximum: "
             "fewest empty receives, and a new message is still returned as soon as it arrives.")
    batch_size: int = option(
        10, parse=integer, metavar="N",
        help="Messages asked for per ReceiveMessage (1-10). 10 is SQS's maximum, as NTH and "
             "Karpenter use.")
    concurrency: int = option(
        10, parse=integer, metavar="N",
        help="Messages handled at the same time (1-1000). 10 matches NTH's workers and "
             "Karpenter's per-batch parallelism; a mass interruption is a few hundred messages.")
    visibility_timeout: int = option(
        60, parse=integer, metavar="S",
        help="Visibility timeout given to received messages, in seconds (2-43200). While a "
             "message is being handled it is extended every visibility/3, so this bounds how "
             "long a crashed replica's message stays hidden, not how long handling may take. "
             "60 s: a dead replica's work is picked up within a minute, at 3 extensions a minute.")
    shutdown_timeout: float = option(
        30.0, parse=seconds, metavar="S",
        help="On SIGTERM, how long in-flight messages may take to finish before they are "
             "released (visibility 0) for another replica, in seconds (0-3600). Keep it below "
             "the pod's terminationGracePeriodSeconds (Kubernetes default 30 s) minus a few "
             "seconds; 30 s suits a grace period of 45 s or more.")
    allow_no_dlq: bool = option(
        False, parse=boolean, is_switch=True,
        help="Start even when the queue has no redrive policy (no DLQ). Poison messages are "
             "then deleted with an error log after --max-receives-without-dlq receives instead "
             "of moving to a DLQ. Off by default: nothing should be silently dropped.")
    max_receives_without_dlq: int = option(
        5, parse=integer, metavar="N",
        help="With --allow-no-dlq: receives after which a poison message is deleted (1-1000). "
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
        _require_range("--wait-seconds", self.wait_seconds, 0, 20, "s")
        _require_range("--batch-size", self.batch_size, 1, 10)
        _require_range("--concurrency", self.concurrency, 1, 1000)
        _require_range("--visibility-timeout", self.visibility_timeout, 2, 43200, "s")
        _require_range("--shutdown-timeout", self.shutdown_timeout, 0, 3600, "s")
        _require_range("--max-receives-without-dlq", self.max_receives_without_dlq, 1, 1000)

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
    rebalance_policy: str = option(
        RebalancePolicy.NOTIFY.value, parse=choice(*(p.value for p in RebalancePolicy)),
        metavar="POLICY",
        help="notify | checkpoint-ahead | drain. Rebalance recommendations are frequent and "
             "only mean elevated risk (AWS documents no lead time), so the default only "
             "records them; checkpoint-ahead gets a durable checkpoint without stopping the "
             "run; drain treats the recommendation as an interruption notice.")
    asg_deadline_seconds: float = option(
        120.0, parse=seconds, metavar="S",
        help="Deadline of an ASG terminate lifecycle action, in seconds after the event "
             "(1-172800). The hook's heartbeat timeout (30-7200 s, AWS default 3600) is not in "
             "the event; 120 s treats a terminate hook like a Spot notice, which is never too "
             "late. Set it to your hook's timeout to let runs use the slack.")
    dedupe_seconds: float = option(
        86400.0, parse=seconds, metavar="S",
        help="How long a handled event id is remembered, so a duplicate is acknowledged "
             "without acting again, in seconds (60-1209600). 24 h is EventBridge's default "
             "maximum event age for retried deliveries.")

    def validate(self) -> None:
        for account in self.allowed_accounts:
            if not ACCOUNT_RE.fullmatch(account):
                raise ConfigError("--allowed-accounts", f"{account!r} is not a 12-digit AWS account id")
        for region in self.allowed_regions:
            if not REGION_RE.fullmatch(region):
                raise ConfigError("--allowed-regions", f"{region!r} is not an AWS region name")
        RebalancePolicy(self.rebalance_policy)  # parse() already restricted it
        _require_range("--asg-deadline-seconds", self.asg_deadline_seconds, 1, 172800, "s")
        _require_range("--dedupe-seconds", self.dedupe_seconds, 60, 1209600, "s")

    @property
    def rebalance(self) -> RebalancePolicy:
        return RebalancePolicy(self.rebalance_policy)


@dataclass(frozen=True)
class HttpSettings(Group):
    """The HTTP server: /metrics (Prometheus), /healthz, /readyz."""

    TITLE: ClassVar[str] = "http"

    http_host: str = option(
        "0.0.0.0", parse=lambda v: v.strip(), metavar="HOST",
        help="Address the HTTP server listens on. All interfaces, so the kubelet and "
             "Prometheus can reach it in a pod.")
    http_port: int = option(
        8080, parse=integer, metavar="PORT",
        help="Port of /metrics, /healthz and /readyz (0 picks a free port; the bound port is "
             "logged). 8080 as Karpenter's metrics port.")

    def validate(self) -> None:
        if not self.http_host:
            raise ConfigError("--http-host", "must not be empty")
        _require_range("--http-port", self.http_port, 0, 65535)


@dataclass(frozen=True)
class LogSettings(Group):
    """Logging: JSON lines on stdout, one `decision` line per message."""

    TITLE: ClassVar[str] = "log"

    log_level: str = option(
        "info", parse=choice("debug", "info", "warning", "error"), metavar="LEVEL",
        help="debug | info | warning | error. info shows one decision line per message.")

    def validate(self) -> None:
        pass


# --------------------------------------------------------------------------- all groups
@dataclass(frozen=True)
class Settings:
    """Every group the daemon reads.  Build with :meth:`from_args`, then :meth:`validate` once."""

    queue: QueueSettings = field(default_factory=QueueSettings)
    intake: IntakeSettings = field(default_factory=IntakeSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    log: LogSettings = field(default_factory=LogSettings)
    # -- Other groups go here (ModeSettings, RaySettings, CheckpointSettings ...): add a field
    # -- and an entry in GROUPS; the `run` subcommand then takes their flags.

    GROUPS: ClassVar[dict[str, type[Group]]] = {
        "queue": QueueSettings,
        "intake": IntakeSettings,
        "http": HttpSettings,
        "log": LogSettings,
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
        return cls(**{name: group.from_args(args, environ) for name, group in cls.GROUPS.items()})

    def validate(self) -> Settings:
        """Check every group once; raise ConfigError naming the first bad setting."""
        for name in self.GROUPS:
            getattr(self, name).validate()
        return self


def documented_options() -> list[tuple[str, str, str, str, str]]:
    """(group, flag, env, default, help) for every setting: the docs table is made from this."""
    rows = []
    for title, group in Settings.GROUPS.items():
        for f in group.options():
            meta: Option = f.metadata["option"]
            rows.append((title, flag_of(f), " / ".join(env_of(f)), _show_default(f.default), meta.help))
    return rows
