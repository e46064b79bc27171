"""deploy/aws/ray-node-user-data.sh keeps the contract of resilienced.aws.ec2nodes.

The script runs as it would at boot, against an instance the daemon's ``Ec2NodeProvider``
launched on moto (over HTTP): the real ``aws`` CLI reads the instance's tags from moto, an
instance metadata stand-in (IMDSv2: token, instance id, region) answers on 127.0.0.1, and a
``ray`` stand-in records the command line it is given.  The labels it starts the node with are
the ones ``ec2nodes.labels_from_tags`` promises (what the drill's user-data hook uses, and what
the daemon's follow-up looks for).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiobotocore.session import AioSession

from resilienced.aws.ec2nodes import Ec2NodeProvider, labels_from_tags
from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from resilienced.model import Capacity

from .tools import REPO

pytestmark = pytest.mark.integration

SCRIPT = REPO / "deploy" / "aws" / "ray-node-user-data.sh"
REGION = "us-east-1"
GCS = "10.0.0.5:6379"
AWS_CLI = shutil.which("aws")


class Imds(http.server.BaseHTTPRequestHandler):
    """IMDSv2: PUT /latest/api/token, then GETs carrying the token."""

    instance_id = ""
    token = "imds-token-1"

    def do_PUT(self) -> None:  # noqa: N802
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._send(200 if ok else 400, self.token if ok else "")

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            return self._send(401, "")
        answers = {"/latest/meta-data/instance-id": self.instance_id,
                   "/latest/meta-data/placement/region": REGION}
        self._send(200, answers[self.path]) if self.path in answers else self._send(404, "")

    def _send(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), Imds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


async def _launch(endpoint: str, labels: dict[str, str], reservation_id: str | None) -> tuple[str, dict[str, str]]:
    async with AioSession().create_client("ec2", region_name=REGION, endpoint_url=endpoint,
                                          aws_access_key_id="testing", aws_secret_access_key="testing") as ec2:
        await ec2.create_launch_template(LaunchTemplateName="ray-workers",
                                         LaunchTemplateData={"ImageId": "ami-12c6146b"})
        provider = Ec2NodeProvider(ec2, launch_template="ray-workers", gcs_address=GCS, owner="cluster-a")
        capacity = Capacity.CAPACITY_BLOCK if reservation_id else Capacity.SPOT
        [node] = await provider.launch(capacity=capacity, node_labels=[labels], reservation_id=reservation_id)
        item = (await ec2.describe_instances(InstanceIds=[node.instance_id]))["Reservations"][0]["Instances"][0]
        return node.instance_id, {t["Key"]: t["Value"] for t in item["Tags"]}


def _run(tmp_path: Path, aws: MotoServer, imds: http.server.HTTPServer, **extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    args_file = tmp_path / "ray-args"
    fake_ray = tmp_path / "ray"
    fake_ray.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {args_file}\n')
    fake_ray.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **FAKE_CREDENTIALS,
           "AWS_ENDPOINT_URL": aws.endpoint_url, "RESILIENCED_IMDS_ENDPOINT": f"http://127.0.0.1:{imds.server_port}",
           "RESILIENCED_RAY": str(fake_ray), **extra}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    return done, args_file


@pytest.mark.skipif(AWS_CLI is None, reason="the aws CLI is not installed (the script calls it, as on EC2)")
@pytest.mark.parametrize("reservation_id", [None, "cr-0b10c000000000001"], ids=["spot", "capacity-block"])
def test_the_script_starts_ray_with_the_address_and_the_labels_of_the_tags(
        tmp_path: Path, aws: MotoServer, imds: http.server.HTTPServer, reservation_id: str | None) -> None:
    labels = {"resilienced.io/replaces": "i-0aaaaaaaaaaaaaaa1", "resilienced.io/elastic": "true"}
    instance_id, tags = asyncio.run(_launch(aws.endpoint_url, labels, reservation_id))
    Imds.instance_id = instance_id

    done, args_file = _run(tmp_path, aws, imds, RAY_START_ARGS="--num-gpus=8")

    assert done.returncode == 0, done.stderr
    start, address, label_arg, *more = args_file.read_text().splitlines()
    assert (start, address, more) == ("start", f"--address={GCS}", ["--num-gpus=8"])
    assert label_arg.startswith("--labels=")
    started = dict(pair.split("=", 1) for pair in label_arg.removeprefix("--labels=").split(","))
    assert started == labels_from_tags(tags, instance_id=instance_id)
    assert started["resilienced.io/capacity-type"] == ("capacity-block" if reservation_id else "spot")
    assert started.get("resilienced.io/capacity-reservation-id") == reservation_id
    assert started["resilienced.io/instance-id"] == instance_id and started["resilienced.io/elastic"] == "true"


@pytest.mark.skipif(AWS_CLI is None, reason="the aws CLI is not installed (the script calls it, as on EC2)")
def test_without_the_tags_the_script_gives_up_naming_the_missing_one(
        tmp_path: Path, aws: MotoServer, imds: http.server.HTTPServer) -> None:
    Imds.instance_id = "i-0123456789abcdef0"  # an instance with no tags
    done, args_file = _run(tmp_path, aws, imds, RESILIENCED_TAG_WAIT_SECONDS="0")
    assert done.returncode == 1 and not args_file.exists()
    assert "no resilienced.io/gcs-address tag on i-0123456789abcdef0" in done.stderr
