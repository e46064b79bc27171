"""EC2 capacity on an aiobotocore ``ec2`` client: the production :class:`~resilienced.ports.CapacitySource`.

Calls (and the IAM actions in :data:`IAM_ACTIONS`):

* ``DescribeCapacityReservations``, paginated, with ``Filter state=active`` as Karpenter does.
  The API has no reservation-type filter (the documented filters are instance-type, owner-id,
  instance-platform, availability-zone, tenancy, outpost-arn, state, start-date, end-date,
  end-date-type, instance-match-criteria, placement-group-arn), so ``ReservationType ==
  "capacity-block"`` is checked here, on the client side.
* ``DescribeInstances`` with filters ``capacity-reservation-id`` and
  ``instance-state-name=pending,running``: the instances in a reservation.
* Only when buying is on: ``DescribeCapacityBlockOfferings`` (``CapacityDurationHours`` is its
  only required parameter; durations are whole days up to 14 days, then weeks up to 182 days)
  and ``PurchaseCapacityBlock`` (``InstancePlatform`` required), with ``DryRun``.  A purchase
  is tagged ``resilienced.io/purchase-key`` so a redelivered event finds the block it already
  bought instead of buying another (PurchaseCapacityBlock takes no client token), and with
  ``--purchase-tags`` (the tags the EC2NodeClass selects reservations on: Karpenter launches
  only into reservations an EC2NodeClass selects).

PurchaseCapacityBlock is sent once per :meth:`Ec2Capacity.purchase`: the client's own retries
(botocore's standard mode, 3 retries after the first request) are turned off for that one operation.  The API takes no
client token, so a resent request is a second purchase: with the SDK's retries, one answer lost
after the purchase (the connection closed) bought two blocks (the reliability campaign's
``ec2-purchase-answer-lost`` trial; a 5xx after the purchase would do the same).  The caller's
retry (the event redelivered) instead looks the purchase key up first.

botocore and connection errors are translated here by the one rule of
:mod:`resilienced.aws.errors`: throttling, 429, 5xx and connection failures become
:class:`~resilienced.errors.BackendUnavailable` (retry later, in :data:`RETRY_DELAY_S`); anything
else the service refuses (UnauthorizedOperation, InvalidParameterValue, ...) becomes
:class:`~resilienced.errors.PermanentError`.  One named exception: a ``DryRunOperation`` answer to
a dry-run purchase is the dry run's success.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation

import botocore.exceptions
from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.capacity.decision import ACTIVE, CAPACITY_BLOCK_TYPE
from resilienced.capacity.policy import PURCHASE_KEY_TAG as POLICY_PURCHASE_KEY_TAG
from resilienced.clock import parse_time
from resilienced.errors import PermanentError
from resilienced.model import CapacityOffering, JsonValue
from resilienced.ports import CapacityReservation, PurchaseResult

#: Every EC2 action this module calls; the deploy/ IAM policy must grant exactly these.
#: The last two only when buying Capacity Blocks is on (``--purchase-blocks``).
IAM_ACTIONS: tuple[str, ...] = (
    "ec2:DescribeCapacityReservations",
    "ec2:DescribeInstances",
    "ec2:DescribeCapacityBlockOfferings",
    "ec2:PurchaseCapacityBlock",
    "ec2:CreateTags",  # PurchaseCapacityBlock with TagSpecifications needs it on capacity-reservation
)
#: The IAM actions needed without buying.
IAM_ACTIONS_READ_ONLY: tuple[str, ...] = IAM_ACTIONS[:2]

#: Tag put on a purchased block: the idempotency key of the purchase.
PURCHASE_KEY_TAG = POLICY_PURCHASE_KEY_TAG

#: Seconds before a retry of an EC2 call that could not be made.
RETRY_DELAY_S = 5.0

#: The botocore event asked whether to resend a failed PurchaseCapacityBlock.
PURCHASE_RETRY_EVENT = "needs-retry.ec2.PurchaseCapacityBlock"


def _send_once(**_: object) -> bool:
    """``needs-retry`` handler of PurchaseCapacityBlock: never resend it.

    Handlers of the most specific event name run first and aiobotocore's endpoint stops at the
    first answer that is not None; ``False`` there means "do not retry"
    (aiobotocore/endpoint.py ``_needs_retry``, aiobotocore 3.x).
    """
    return False


def translate(error: BaseException, *, action: str) -> Exception:
    """The resilienced error for a botocore / transport error raised by ``action`` (the one rule)."""
    return errors.translate(error, backend="ec2", operation=action, delay=RETRY_DELAY_S)


def _utc(value: object) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_time(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value


def reservation_from_api(item: Mapping[str, JsonValue]) -> CapacityReservation:
    """A :class:`CapacityReservation` from one ``CapacityReservations[]`` item of the API."""
    try:
        return CapacityReservation(
            reservation_id=item["CapacityReservationId"],
            instance_type=item.get("InstanceType", ""),
            availability_zone=item.get("AvailabilityZone", ""),
            reservation_type=item.get("ReservationType", "default"),
            state=item.get("State", ""),
            available_instances=int(item.get("AvailableInstanceCount", 0)),
            total_instances=int(item.get("TotalInstanceCount", 0)),
            start=_utc(item.get("StartDate")),
            end=_utc(item.get("EndDate")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PermanentError(f"ec2 DescribeCapacityReservations: unusable reservation {item!r}: {e}") from e


def offering_from_api(item: Mapping[str, JsonValue]) -> CapacityOffering:
    """A :class:`CapacityOffering` from one ``CapacityBlockOfferings[]`` item of the API."""
    try:
        return CapacityOffering(
            offering_id=item["CapacityBlockOfferingId"],
            instance_type=item["InstanceType"],
            availability_zone=item.get("AvailabilityZone", ""),
            instance_count=int(item["InstanceCount"]),
            start=_utc(item["StartDate"]),  # type: ignore[arg-type]
            end=_utc(item["EndDate"]),  # type: ignore[arg-type]
            upfront_fee=Decimal(str(item["UpfrontFee"])),
            currency=item.get("CurrencyCode", "USD"),
        )
    except (KeyError, TypeError, ValueError, InvalidOperation) as e:
        raise PermanentError(f"ec2 DescribeCapacityBlockOfferings: unusable offering {item!r}: {e}") from e


def block_duration_hours(needed: timedelta) -> int:
    """The shortest Capacity Block duration (hours) that covers ``needed``.

    Blocks come in 1-day steps up to 14 days, then 7-day steps up to 182 days.
    """
    if needed <= timedelta(0):
        raise ValueError(f"needed must be a positive duration, got {needed}")
    days = -(-needed // timedelta(days=1))  # ceil
    if days > 14:
        days = -(-days // 7) * 7
    if days > 182:
        raise ValueError(f"{needed} is longer than the longest Capacity Block (182 days)")
    return int(days) * 24


class Ec2Capacity:
    """:class:`~resilienced.ports.CapacitySource` on an aiobotocore ``ec2`` client.

    Args:
        client: an aiobotocore ``ec2`` client (entered; its lifetime is the caller's).
        page_size: MaxResults per page of the Describe calls (5-1000).
    """

    def __init__(self, client: AioBaseClient, *, page_size: int = 100) -> None:
        if not 5 <= page_size <= 1000:
            raise ValueError(f"page_size must be between 5 and 1000, got {page_size}")
        self._client = client
        self._page_size = page_size
        events = getattr(getattr(client, "meta", None), "events", None)
        if events is not None:  # a purchase is never resent by the SDK (see the module doc)
            events.register(PURCHASE_RETRY_EVENT, _send_once, unique_id="resilienced-purchase-sent-once")

    async def _pages(self, operation: str, action: str, **params: JsonValue) -> AsyncIterator[Mapping[str, JsonValue]]:
        paginator = self._client.get_paginator(operation)
        try:
            async for page in paginator.paginate(**params):
                yield page
        except Exception as e:  # translated at the boundary
            raise translate(e, action=action) from e

    # ------------------------------------------------------------------ CapacitySource
    async def reservations(self, *, instance_type: str | None = None) -> list[CapacityReservation]:
        """The active Capacity Blocks (optionally of one instance type), in API order."""
        filters = [{"Name": "state", "Values": [ACTIVE]}]
        if instance_type:
            filters.append({"Name": "instance-type", "Values": [instance_type]})
        out = []
        async for page in self._pages(
            "describe_capacity_reservations", "DescribeCapacityReservations",
            Filters=filters, PaginationConfig={"PageSize": self._page_size},
        ):
            for item in page.get("CapacityReservations", []):
                if item.get("ReservationType") == CAPACITY_BLOCK_TYPE and item.get("State") == ACTIVE:
                    out.append(reservation_from_api(item))
        return out

    async def reservation_instances(self, *, reservation_id: str) -> list[str]:
        """Ids of the pending or running instances launched into ``reservation_id``."""
        if not reservation_id or not reservation_id.startswith("cr-"):
            raise ValueError(f"reservation_id must be a Capacity Reservation id (cr-...), got {reservation_id!r}")
        ids: list[str] = []
        async for page in self._pages(
            "describe_instances", "DescribeInstances",
            Filters=[{"Name": "capacity-reservation-id", "Values": [reservation_id]},
                     {"Name": "instance-state-name", "Values": ["pending", "running"]}],
            PaginationConfig={"PageSize": self._page_size},
        ):
            for reservation in page.get("Reservations", []):
                ids.extend(i["InstanceId"] for i in reservation.get("Instances", []))
        return ids

    # ------------------------------------------------------------------ buying
    async def offerings(
        self,
        *,
        instance_type: str,
        instance_count: int,
        duration: timedelta,
        start_after: datetime,
        start_before: datetime,
    ) -> list[CapacityOffering]:
        """Capacity Block offerings for ``instance_count`` x ``instance_type`` lasting ``duration``
        (rounded up to a purchasable duration), starting between the two times."""
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")
        if start_before < start_after:
            raise ValueError("start_before must not be earlier than start_after")
        hours = block_duration_hours(duration)
        out = []
        async for page in self._pages(
            "describe_capacity_block_offerings", "DescribeCapacityBlockOfferings",
            InstanceType=instance_type, InstanceCount=instance_count,
            CapacityDurationHours=hours, StartDateRange=start_after,
            EndDateRange=start_before + timedelta(hours=hours),
        ):
            out.extend(offering_from_api(item) for item in page.get("CapacityBlockOfferings", []))
        return out

    async def purchased(self, *, purchase_key: str) -> CapacityReservation | None:
        """The block bought earlier under ``purchase_key`` (any state but cancelled/failed), if any."""
        async for page in self._pages(
            "describe_capacity_reservations", "DescribeCapacityReservations",
            Filters=[{"Name": f"tag:{PURCHASE_KEY_TAG}", "Values": [purchase_key]}],
        ):
            for item in page.get("CapacityReservations", []):
                if item.get("State") not in ("cancelled", "failed", "payment-failed", "expired"):
                    return reservation_from_api(item)
        return None

    async def purchase(
        self,
        offering: CapacityOffering,
        *,
        platform: str,
        purchase_key: str,
        dry_run: bool,
        price_cap: Decimal,
        tags: Mapping[str, str] | None = None,
    ) -> PurchaseResult:
        """Buy ``offering`` (or, with ``dry_run``, ask EC2 whether it would be bought).

        ``tags`` are put on the block besides the purchase key: what the EC2NodeClass's
        ``capacityReservationSelectorTerms`` select on, so Karpenter launches into it.

        Refuses (PermanentError) an offering above ``price_cap``: the cap is checked here too,
        right at the call that spends the money.  Idempotent per ``purchase_key``: a block
        already bought under it is returned instead of buying again.
        """
        if offering.upfront_fee > price_cap:
            raise PermanentError(f"offering {offering.offering_id} costs {offering.upfront_fee} "
                                 f"{offering.currency}, above the price cap {price_cap}")
        if not dry_run:
            existing = await self.purchased(purchase_key=purchase_key)
            if existing is not None:
                return PurchaseResult(offering.offering_id, False, existing,
                                      f"already bought under {purchase_key}: {existing.reservation_id}")
        params = {
            "CapacityBlockOfferingId": offering.offering_id,
            "InstancePlatform": platform,
            "DryRun": dry_run,
            "TagSpecifications": [{
                "ResourceType": "capacity-reservation",
                "Tags": [{"Key": PURCHASE_KEY_TAG, "Value": purchase_key},
                         *({"Key": k, "Value": v} for k, v in sorted((tags or {}).items()))],
            }],
        }
        try:
            response = await self._client.purchase_capacity_block(**params)
        except botocore.exceptions.ClientError as e:
            if dry_run and errors.error_code(e) == "DryRunOperation":
                return PurchaseResult(offering.offering_id, True, None,
                                      f"dry run: EC2 would buy {offering.offering_id} for "
                                      f"{offering.upfront_fee} {offering.currency}")
            raise translate(e, action="PurchaseCapacityBlock") from e
        except Exception as e:
            raise translate(e, action="PurchaseCapacityBlock") from e
        if dry_run:  # EC2 answers DryRunOperation; a success here would mean it bought anyway
            raise PermanentError("ec2 PurchaseCapacityBlock: a dry run returned a purchase")
        reservation = reservation_from_api(response["CapacityReservation"])
        return PurchaseResult(offering.offering_id, False, reservation,
                              f"bought {offering.offering_id} as {reservation.reservation_id} for "
                              f"{offering.upfront_fee} {offering.currency}")

