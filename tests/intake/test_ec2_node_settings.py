"""The EC2 node provider's settings (ray mode): flags and RESILIENCED_ variables, checked once."""

from __future__ import annotations

import pytest

from resilienced.errors import ConfigError
from resilienced.settings import Settings

pytestmark = pytest.mark.unit

RAY = ["--queue-url", "https://sqs.us-east-1.amazonaws.com/123456789012/q", "--mode", "ray",
       "--ray-address", "10.0.0.5:6379"]


def settings(args: list[str], environ: dict[str, str] | None = None) -> Settings:
    return Settings.from_args(args, environ or {}).validate()


def test_unset_there_is_no_ec2_provider_and_the_defaults_say_so() -> None:
    s = settings(RAY).ec2_nodes
    assert s.ec2_launch_template is None and s.ec2_launch_template_version == "$Default"
    assert s.ec2_owner == "resilienced" and s.ec2_subnets == () and s.ec2_autoscaler_capacities == ()
    assert s.ec2_on_demand_reservation_preference is None and s.ec2_gcs_address is None


def test_flags_and_environment_variables_set_each() -> None:
    s = settings([*RAY, "--ec2-launch-template", "ray-workers", "--ec2-subnets",
                  "us-east-1a=subnet-0abc12345,us-east-1b=subnet-0def67890"], {
        "RESILIENCED_EC2_OWNER": "train-a", "RESILIENCED_EC2_ON_DEMAND_RESERVATION_PREFERENCE": "None",
        "RESILIENCED_EC2_AUTOSCALER_CAPACITIES": "spot,on-demand", "RESILIENCED_EC2_GCS_ADDRESS": "10.0.1.5:6379",
        "RESILIENCED_EC2_LAUNCH_TEMPLATE_VERSION": "7"}).ec2_nodes
    assert (s.ec2_launch_template, s.ec2_launch_template_version, s.ec2_owner) == ("ray-workers", "7", "train-a")
    assert s.ec2_subnets == ("us-east-1a=subnet-0abc12345", "us-east-1b=subnet-0def67890")
    assert s.ec2_on_demand_reservation_preference == "none" and s.ec2_gcs_address == "10.0.1.5:6379"
    assert s.ec2_autoscaler_capacities == ("spot", "on-demand")


@pytest.mark.parametrize(("args", "flag", "message"), [
    (["--ec2-subnets", "us-east-1a:subnet-0abc12345"], "--ec2-subnets", "expected ZONE=subnet-<hex>"),
    (["--ec2-autoscaler-capacities", "spot,reserved"], "--ec2-autoscaler-capacities", "'reserved'"),
    (["--ec2-owner", "two words"], "--ec2-owner", "1-128 of letters"),
    (["--ec2-on-demand-reservation-preference", "targeted"], "--ec2-on-demand-reservation-preference",
     "expected one of open, none, capacity-reservations-only"),
], ids=["subnet", "capacity", "owner", "preference"])
def test_a_bad_value_is_refused_naming_its_flag(args: list[str], flag: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings([*RAY, *args])
    assert caught.value.setting == flag and message in caught.value.message


def test_a_launch_template_outside_ray_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="--ec2-launch-template: launches ray mode's replacement nodes; --mode is plan"):
        settings(["--queue-url", "https://sqs.us-east-1.amazonaws.com/123456789012/q",
                  "--ec2-launch-template", "lt-0123456789abcdef0"])
