"""The capacity policy: the knobs of the capacity decision, each with its unit and why.

:class:`CapacityPolicy` is a settings group (see :mod:`resilienced.settings`): every field is
declared with ``option()``, so ``--interruption-threshold`` / ``RESILIENCED_INTERRUPTION_THRESHOLD``
and the docs table come from this one declaration.  To let the daemon take these flags, add
``capacity: CapacityPolicy`` to ``Settings`` and ``"capacity": CapacityPolicy`` to
``Settings.GROUPS``.

Durations are :class:`datetime.timedelta`; from a flag or the environment they are a number of
seconds or a number with a unit (``90s``, ``10m``, ``1h``, ``2d``).  Money is US dollars, the
currency EC2 quotes Capacity Block offerings in (``CurrencyCode`` ``USD``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import ClassVar

from resilienced.errors import ConfigError
from resilienced.options import Group, boolean, choice, csv, integer, option

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

#: Tag put on a purchased block: the idempotency key of the purchase (resilienced.capacity.ec2).
PURCHASE_KEY_TAG = "resilienced.io/purchase-key"

#: Platforms PurchaseCapacityBlock accepts that matter for training images (the model has more).
PLATFORMS = ("Linux/UNIX", "Ubuntu Pro", "Red Hat Enterprise Linux", "SUSE Linux")


def duration(value: str) -> timedelta:
    """Parse ``"600"``, ``"90s"``, ``"10m"``, ``"1.5h"``, ``"2d"`` into a timedelta."""
    match = _DURATION_RE.fullmatch(value)
    if not match:
        raise ValueError(f"expected seconds or a number with s/m/h/d, got {value!r}")
    return timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def money(value: str) -> Decimal | None:
    """Parse a dollar amount (``"2500"``, ``"2500.50"``); empty means no cap."""
    value = value.strip().lstrip("$")
    if not value:
        return None
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise ValueError(f"expected a dollar amount, got {value!r}") from None
    if not amount.is_finite():
        raise ValueError(f"expected a finite dollar amount, got {value!r}")
    return amount


@dataclass(frozen=True)
class CapacityPolicy(Group):
    """Where a requeued run goes: Spot, a Capacity Block, On-Demand, or nowhere yet."""

    TITLE: ClassVar[str] = "capacity"

    interruption_threshold: int = option(
        2, parse=integer, bounds=(1, 1000), metavar="N",
        help="Interruptions of a pool (instance type x AZ) within --interruption-window at which "
             "Spot counts as unreliable for it and the run leaves Spot ({range}). 2: one "
             "interruption is ordinary Spot life and moving a gang costs a restart; a second one "
             "within the window says the pool is being reclaimed.")
    interruption_window: timedelta = option(
        timedelta(hours=1), parse=duration, bounds=(timedelta(minutes=1), timedelta(days=7)), metavar="DURATION",
        help="Sliding window in which interruptions of a pool are counted ({range}). 1 h: Spot "
             "reclaims come in waves of minutes to hours; a longer window keeps runs off a pool "
             "that has since recovered.")
    allow_on_demand: bool = option(
        True, parse=boolean, metavar="BOOL",
        help="Whether a run may go to On-Demand when Spot is unreliable and no Capacity Block has "
             "room. False: the run waits (decision `wait`) instead of paying On-Demand prices.")
    spot_cooldown: timedelta = option(
        timedelta(hours=2), parse=duration, bounds=(timedelta(0), timedelta(days=7)), metavar="DURATION",
        help="How long a run moved off Spot stays off it, and how long the pool must have been "
             "quiet (no interruption) before the run goes back ({range}). 2 h: twice the default "
             "window, so a run does not bounce back into the wave that pushed it out.")
    block_end_margin: timedelta = option(
        timedelta(minutes=40), parse=duration, bounds=(timedelta(minutes=30), timedelta(days=1)), metavar="DURATION",
        help="A Capacity Block is never used within this time of its end ({range}). 40 min: EC2 "
             "starts terminating a block's instances 30 min before its end (60 min for "
             "UltraServers) and sends the expiration warning 40 min before; Karpenter drains at "
             "40 min too, so for a run on Karpenter's nodes (label karpenter.sh/nodepool) the "
             "margin used is never below 40 min, whatever this says.")
    min_block_time: timedelta = option(
        timedelta(hours=1), parse=duration, bounds=(timedelta(0), timedelta(days=7)), metavar="DURATION",
        help="When the run's remaining time is unknown, the least usable time (before "
             "--block-end-margin) a Capacity Block must still offer to be chosen ({range}). 1 h: a "
             "move costs a gang restart; a block that forces another move sooner is not worth it.")
    prefer_blocks: bool = option(
        False, parse=boolean, metavar="BOOL",
        help="Use an active Capacity Block with room before healthy Spot. A block is prepaid, so "
             "idle room in it is free (Karpenter's order: reserved, spot, on-demand); off by "
             "default because a run on a block must move again at the block's end.")
    purchase_blocks: bool = option(
        False, parse=boolean, metavar="BOOL",
        help="Buy a Capacity Block (DescribeCapacityBlockOfferings -> PurchaseCapacityBlock) when "
             "Spot is unreliable and no active block has room. Off: buying spends money up front "
             "and is not refundable.")
    price_cap: Decimal | None = option(
        None, parse=money, metavar="USD",
        help="The most a purchased block may cost up front (UpfrontFee, USD). Required when "
             "--purchase-blocks is on; offerings above it are never bought.")
    purchase_dry_run: bool = option(
        True, parse=boolean, metavar="BOOL",
        help="Call PurchaseCapacityBlock with DryRun: checks permissions and the offering and "
             "records what would be bought, buys nothing. On by default; turn off to really buy.")
    purchase_max_wait: timedelta = option(
        timedelta(minutes=30), parse=duration, bounds=(timedelta(0), timedelta(days=7)), metavar="DURATION",
        help="The latest an offering may start, from now, to be bought for a waiting run ({range}). "
             "30 min: a block starting later leaves the gang down too long; On-Demand or waiting "
             "for Spot is then the better answer.")
    purchase_platform: str = option(
        "Linux/UNIX", parse=choice(*(p.lower() for p in PLATFORMS)), metavar="PLATFORM",
        help="InstancePlatform of a purchased block (PurchaseCapacityBlock requires it).")
    purchase_tags: tuple[str, ...] = option(
        (), parse=csv, metavar="KEY=VALUE,...",
        help="Tags put on a purchased block besides resilienced.io/purchase-key: the tags your "
             "EC2NodeClass's capacityReservationSelectorTerms select on, so that Karpenter "
             "launches into the block (it launches only into reservations an EC2NodeClass "
             "selects). The IAM policy must allow exactly these keys (CloudFormation parameter "
             "CapacityBlockTagKeys). Empty: only the purchase key.")
    wait_retry: timedelta = option(
        timedelta(minutes=1), parse=duration, bounds=(timedelta(seconds=1), timedelta(hours=1)), metavar="DURATION",
        help="After a `wait` decision, when the requeue is worth trying again ({range}). 1 min: "
             "below Karpenter's 3 min ICE cache, so a freed pool is noticed soon.")

    def __post_init__(self) -> None:
        super().__post_init__()
        # ``choice`` lower-cases; keep the AWS spelling.
        for platform in PLATFORMS:
            if self.purchase_platform.lower() == platform.lower():
                object.__setattr__(self, "purchase_platform", platform)
        self.validate()

    def validate(self) -> None:
        if isinstance(self.interruption_threshold, bool) or not isinstance(self.interruption_threshold, int):
            raise ConfigError("--interruption-threshold", f"expected a whole number, got {self.interruption_threshold!r}")
        self.check_bounds()
        if self.price_cap is not None and self.price_cap <= 0:
            raise ConfigError("--price-cap", f"must be a positive dollar amount, got {self.price_cap}")
        if self.purchase_blocks and self.price_cap is None:
            raise ConfigError("--price-cap", "is required when --purchase-blocks is on")
        if self.purchase_platform not in PLATFORMS:
            raise ConfigError("--purchase-platform", f"expected one of {', '.join(PLATFORMS)}, "
                                                     f"got {self.purchase_platform!r}")
        self.purchase_tag_map  # noqa: B018 - validates --purchase-tags

    @property
    def purchase_tag_map(self) -> dict[str, str]:
        """``--purchase-tags`` as a dict; ConfigError naming the flag for a malformed tag."""
        tags: dict[str, str] = {}
        for item in self.purchase_tags:
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise ConfigError("--purchase-tags", f"expected KEY=VALUE, got {item!r}")
            if key.lower().startswith("aws:") or key == PURCHASE_KEY_TAG:
                raise ConfigError("--purchase-tags", f"{key!r} is reserved (aws:*, {PURCHASE_KEY_TAG})")
            if len(key) > 128 or len(value) > 256 or key in tags:
                raise ConfigError("--purchase-tags", f"{key!r}: a tag key is unique, at most 128 "
                                                     "characters, its value at most 256")
            tags[key] = value
        return tags

