"""resilienced.aws.pricing: Spot prices from moto's DescribeSpotPriceHistory, On-Demand from the
Pricing API's GetProducts under botocore's Stubber (requests and responses checked against the
``pricing`` service model), the --on-demand-prices file, a block's fee; and a price that cannot
be read: null with the reason, nothing raised."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.stub import Stubber

from resilienced.aws.pricing import PriceFile, Prices, product_filters
from resilienced.errors import ConfigError
from resilienced.model import CapacityOffering

pytestmark = pytest.mark.integration

AT = datetime(2026, 12, 5, 8, 0, tzinfo=timezone.utc)


@pytest.fixture
async def ec2(aws: Any) -> AsyncIterator[Any]:
    async with AioSession().create_client("ec2", region_name="us-east-1", endpoint_url=aws.endpoint_url) as client:
        yield client


@pytest.fixture
async def pricing() -> AsyncIterator[tuple[Any, Stubber]]:
    async with AioSession().create_client("pricing", region_name="us-east-1", aws_access_key_id="testing",
                                          aws_secret_access_key="testing") as client:
        with Stubber(client) as stubber:
            yield client, stubber
            stubber.assert_no_pending_responses()


async def test_spot_price_from_moto(ec2: Any) -> None:
    prices = Prices(ec2=ec2)
    price = await prices.spot(instance_type="p5.48xlarge", zone="us-east-1a", at=AT)
    assert price.usd_per_hour == 0.00001  # what moto serves for every pool
    assert "DescribeSpotPriceHistory p5.48xlarge us-east-1a" in price.source and price.reason is None


async def test_spot_price_unknown_pool_and_unreachable_are_null_with_reason(ec2: Any) -> None:
    price = await Prices(ec2=ec2).spot(instance_type="x9.nonexistent", zone="us-east-1a", at=AT)
    assert price.usd_per_hour is None and "no Spot price history for x9.nonexistent" in (price.reason or "")
    config = AioConfig(retries={"max_attempts": 0}, connect_timeout=1)
    async with AioSession().create_client("ec2", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                                          aws_access_key_id="t", aws_secret_access_key="t", config=config) as dead:
        price = await Prices(ec2=dead).spot(instance_type="p5.48xlarge", zone="us-east-1a", at=AT)
    assert price.usd_per_hour is None and "DescribeSpotPriceHistory" in (price.reason or "")
    assert (await Prices().spot(instance_type=None, zone="us-east-1a", at=AT)).reason


def price_list(usd: str) -> list[str]:
    """One GetProducts PriceList item, in the shape AWS answers (a JSON string per product)."""
    return [json.dumps({
        "product": {"productFamily": "Compute Instance", "sku": "ABCD1234",
                    "attributes": {"instanceType": "p5.48xlarge", "regionCode": "us-east-1",
                                   "operatingSystem": "Linux", "tenancy": "Shared"}},
        "serviceCode": "AmazonEC2",
        "terms": {"OnDemand": {"ABCD1234.JRTCKXETXF": {
            "offerTermCode": "JRTCKXETXF", "sku": "ABCD1234",
            "priceDimensions": {"ABCD1234.JRTCKXETXF.6YS6EN2CT7": {
                "unit": "Hrs", "pricePerUnit": {"USD": usd}, "description": "$98.32 per On Demand Linux p5.48xlarge Instance Hour"}}}}},
        "version": "20261201000000", "publicationDate": "2026-12-01T00:00:00Z"})]


async def test_on_demand_price_from_get_products(pricing: tuple[Any, Stubber]) -> None:
    client, stubber = pricing
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": price_list("98.3200000000")},
                         {"ServiceCode": "AmazonEC2", "Filters": product_filters("p5.48xlarge", "us-east-1"),
                          "FormatVersion": "aws_v1", "MaxResults": 10})
    prices = Prices(pricing=client, region="us-east-1")
    price = await prices.on_demand(instance_type="p5.48xlarge")
    assert price.usd_per_hour == 98.32 and "GetProducts" in price.source
    assert (await prices.on_demand(instance_type="p5.48xlarge")) == price  # cached: no second call


async def test_on_demand_refused_is_null_with_reason_and_asked_again(pricing: tuple[Any, Stubber]) -> None:
    client, stubber = pricing
    stubber.add_client_error("get_products", service_error_code="AccessDeniedException",
                             service_message="not authorized to perform: pricing:GetProducts", http_status_code=400)
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": []})
    prices = Prices(pricing=client, region="us-east-1")
    price = await prices.on_demand(instance_type="p5.48xlarge")
    assert price.usd_per_hour is None and "AccessDeniedException" in (price.reason or "")
    price = await prices.on_demand(instance_type="p5.48xlarge")
    assert price.usd_per_hour is None and "no OnDemand hourly price" in (price.reason or "")


async def test_the_file_wins_and_names_itself(tmp_path: Any) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"on-demand": {"p5.48xlarge": 90.0, "us-west-2/p5.48xlarge": 99.0},
                                "capacity-block": {"cr-1": {"upfront_fee": 1440, "hours": 24, "instances": 2}}}))
    file = PriceFile.read(path)
    assert (await Prices(file=file, region="us-west-2").on_demand(instance_type="p5.48xlarge")).usd_per_hour == 99.0
    price = await Prices(file=file, region="us-east-1").on_demand(instance_type="p5.48xlarge")
    assert price.usd_per_hour == 90.0 and str(path) in price.source
    missing = await Prices(file=file).on_demand(instance_type="g6.xlarge")
    assert missing.usd_per_hour is None and "no Pricing API client" in (missing.reason or "")
    assert Prices(file=file).capacity_block(reservation_id="cr-1").usd_per_hour == 30.0
    unknown = Prices(file=file).capacity_block(reservation_id="cr-2")
    assert unknown.usd_per_hour is None and "upfront fee is not known" in (unknown.reason or "")
    path.write_text('{"on-demand": {"p5.48xlarge": "cheap"}}')
    with pytest.raises(ConfigError, match="--on-demand-prices"):
        PriceFile.read(path)


def test_block_price_from_the_offering() -> None:
    offering = CapacityOffering(offering_id="cbo-1", instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                instance_count=2, start=AT, end=AT.replace(day=6), upfront_fee=Decimal("1440"))
    price = Prices().capacity_block(reservation_id=None, offering=offering)
    assert price.usd_per_hour == 30.0 and price.source == "offering cbo-1"
