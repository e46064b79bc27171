"""Prices per instance-hour for the ledger (``resilienced.ops.ledger``): Spot, On-Demand, a Capacity Block.

* Spot: EC2 ``DescribeSpotPriceHistory`` for the instance type in the zone (``ProductDescriptions``
  ``Linux/UNIX`` and ``Linux/UNIX (Amazon VPC)``, ``StartTime`` = ``EndTime`` = the moment asked:
  the API then answers the price in effect then, per zone); the newest entry of the zone at or
  before the moment.
* On-Demand: the ``--on-demand-prices`` file first (where the Pricing API is not reachable: a
  private cluster without its endpoint, a region without it), else the AWS Price List API's
  ``GetProducts`` (``ServiceCode AmazonEC2``; ``TERM_MATCH`` on the instance type, the region
  code, Linux, shared tenancy, no pre-installed software, capacity status ``Used``; the Pricing
  API answers in us-east-1, eu-central-1 and ap-south-1 only: its client is opened in
  :data:`PRICING_REGION`), the ``OnDemand`` term's price per ``Hrs`` in USD.
* A Capacity Block: its upfront fee over its duration and instances
  (:func:`resilienced.ops.ledger.block_price`), from the offering the daemon bought, or the file's
  ``capacity-block`` entry for the reservation.

Nothing here raises: a price that cannot be read is ``Price(None, source, reason)`` with the
translated error (the one rule of :mod:`resilienced.aws.errors`), and the ledger shows ``null``
with that reason (never a guess); the recovery never waits on a price.  Answers are cached per
(instance type, zone, hour) for Spot and per instance type for On-Demand.

The ``--on-demand-prices`` file (JSON)::

    {"on-demand": {"p5.48xlarge": 98.32, "us-west-2/p5.48xlarge": 98.32},
     "capacity-block": {"cr-0123...": {"upfront_fee": 1440.0, "hours": 24, "instances": 2}}}

(a bare ``{"p5.48xlarge": 98.32}`` is read as its ``on-demand`` part; a ``region/type`` key wins
over the bare type).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from resilienced.aws import errors
from resilienced.errors import ConfigError
from resilienced.ops.ledger import Price, block_price
from resilienced.model import CapacityOffering, JsonValue

#: Every IAM action this module calls; the deploy/ IAM policy grants them.
IAM_ACTIONS: tuple[str, ...] = ("ec2:DescribeSpotPriceHistory", "pricing:GetProducts")
#: Where the Pricing API's client is opened (it answers in three regions only).
PRICING_REGION = "us-east-1"
SPOT_PRODUCTS = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]


def product_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    """GetProducts' filters for one Linux, shared-tenancy On-Demand instance type in ``region``."""
    terms = {"instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux",
             "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used"}
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()]


def on_demand_from_price_list(items: list[str]) -> float | None:
    """The USD per hour of the ``OnDemand`` term of GetProducts' ``PriceList`` (JSON strings)."""
    for raw in items:
        product = json.loads(raw)
        for term in ((product.get("terms") or {}).get("OnDemand") or {}).values():
            for dim in (term.get("priceDimensions") or {}).values():
                usd = (dim.get("pricePerUnit") or {}).get("USD")
                if dim.get("unit") == "Hrs" and usd is not None and float(usd) > 0:
                    return float(usd)
    return None


class PriceFile:
    """The ``--on-demand-prices`` file (see the module docstring); ConfigError naming the flag when malformed."""

    def __init__(self, data: Mapping[str, Any], *, where: str = "--on-demand-prices") -> None:
        on_demand = data.get("on-demand", None)
        blocks = data.get("capacity-block") or {}
        if on_demand is None:
            on_demand = {k: v for k, v in data.items() if k != "capacity-block"}
        try:
            self.on_demand = {str(k): float(v) for k, v in dict(on_demand).items()}
            self.blocks = {str(k): (float(v["upfront_fee"]), float(v["hours"]), int(v["instances"]))
                           for k, v in dict(blocks).items()}
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError("--on-demand-prices", f"{where}: {type(e).__name__}: {e}") from None
        self.where = where

    @classmethod
    def read(cls, path: str | Path) -> PriceFile:
        try:
            return cls(json.loads(Path(path).read_text()), where=str(path))
        except (OSError, ValueError) as e:
            raise ConfigError("--on-demand-prices", f"{path}: {e}") from None

    def on_demand_price(self, instance_type: str, region: str | None) -> float | None:
        return self.on_demand.get(f"{region}/{instance_type}", self.on_demand.get(instance_type))


class Prices:
    """Prices per instance-hour (see the module docstring).

    Args:
        ec2: an aiobotocore ``ec2`` client (Spot); None: Spot prices unknown.
        pricing: an aiobotocore ``pricing`` client (On-Demand); None: the file only.
        file: the ``--on-demand-prices`` file, read.  region: the run's region.
    """

    def __init__(self, *, ec2: Any | None = None, pricing: Any | None = None, file: PriceFile | None = None,
                 region: str | None = None) -> None:
        self.ec2, self.pricing, self.file, self.region = ec2, pricing, file, region
        self._spot: dict[tuple[str, str, str], Price] = {}
        self._on_demand: dict[str, Price] = {}

    async def spot(self, *, instance_type: str | None, zone: str | None, at: datetime) -> Price:
        source = f"ec2 DescribeSpotPriceHistory {instance_type} {zone}"
        if not instance_type or not zone:
            return Price.unknown(source, "the run's instance type or zone is not known")
        if self.ec2 is None:
            return Price.unknown(source, "no EC2 client")
        key = (instance_type, zone, at.strftime("%Y-%m-%dT%H"))
        if key in self._spot:
            return self._spot[key]
        try:
            answer = await self.ec2.describe_spot_price_history(
                InstanceTypes=[instance_type], ProductDescriptions=SPOT_PRODUCTS, StartTime=at, EndTime=at,
                Filters=[{"Name": "availability-zone", "Values": [zone]}], MaxResults=100)
        except Exception as e:  # noqa: BLE001 - a price never stops a recovery: the reason is kept
            return Price.unknown(source, str(errors.translate(e, backend="ec2",
                                                              operation="DescribeSpotPriceHistory")))
        entries = [h for h in answer.get("SpotPriceHistory") or () if h.get("AvailabilityZone") == zone
                   and h.get("InstanceType") == instance_type]
        if not entries:
            price = Price.unknown(source, f"no Spot price history for {instance_type} in {zone}")
        else:
            newest = max(entries, key=lambda h: h.get("Timestamp") or datetime.min)
            price = Price(float(newest["SpotPrice"]), f"{source} at {at.isoformat()}")
        self._spot[key] = price
        return price

    async def on_demand(self, *, instance_type: str | None) -> Price:
        if not instance_type:
            return Price.unknown("on-demand", "the run's instance type is not known")
        if instance_type in self._on_demand:
            return self._on_demand[instance_type]
        price = await self._read_on_demand(instance_type)
        if price.usd_per_hour is not None or self.pricing is None:
            self._on_demand[instance_type] = price  # a failed call is asked again next time
        return price

    async def _read_on_demand(self, instance_type: str) -> Price:
        if self.file is not None:
            value = self.file.on_demand_price(instance_type, self.region)
            if value is not None:
                return Price(value, f"{self.file.where} {instance_type}")
        source = f"pricing GetProducts AmazonEC2 {instance_type} {self.region}"
        if self.pricing is None:
            why = (f"not in {self.file.where}; " if self.file is not None else "") + "no Pricing API client"
            return Price.unknown("on-demand", why)
        if not self.region:
            return Price.unknown(source, "the region is not known")
        try:
            answer = await self.pricing.get_products(
                ServiceCode="AmazonEC2", Filters=product_filters(instance_type, self.region),
                FormatVersion="aws_v1", MaxResults=10)
            value = on_demand_from_price_list(list(answer.get("PriceList") or ()))
        except (ValueError, TypeError, AttributeError) as e:
            return Price.unknown(source, f"unreadable PriceList: {e}")
        except Exception as e:  # noqa: BLE001 - a price never stops a recovery: the reason is kept
            return Price.unknown(source, str(errors.translate(e, backend="pricing", operation="GetProducts")))
        if value is None:
            return Price.unknown(source, "no OnDemand hourly price in the answer")
        return Price(value, source)

    def capacity_block(self, *, reservation_id: str | None, offering: CapacityOffering | None = None) -> Price:
        """A block's price per instance-hour: its offering's fee (bought by the daemon), else the file's entry."""
        if offering is not None:
            hours = (offering.end - offering.start).total_seconds() / 3600
            return block_price(upfront_fee=float(offering.upfront_fee), hours=hours,
                               instances=offering.instance_count, source=f"offering {offering.offering_id}")
        if self.file is not None and reservation_id in self.file.blocks:
            fee, hours, instances = self.file.blocks[reservation_id]
            return block_price(upfront_fee=fee, hours=hours, instances=instances,
                               source=f"{self.file.where} {reservation_id}")
        return Price.unknown(f"capacity-block {reservation_id}", "the block's upfront fee is not known (not "
                             "bought by this daemon, not in --on-demand-prices); DescribeCapacityReservations "
                             "does not say it")


def prices_json(prices: Mapping[str, Price]) -> dict[str, JsonValue]:
    return {k: v.as_json() for k, v in prices.items()}
