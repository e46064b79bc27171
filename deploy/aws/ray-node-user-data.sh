#!/usr/bin/env bash
# resilienced: user-data of a Ray worker node launched by ray mode's EC2 node provider
# (resilienced.aws.ec2nodes.Ec2NodeProvider; docs/ray.md "Ray on EC2: the replacement nodes").
#
# Put it in the launch template the daemon launches from (--ec2-launch-template), after whatever
# your image needs first (drivers, the Ray auth token: RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
#
# The contract with the daemon (tests/deploy/test_user_data.py runs this script against it):
#   * the daemon launches the instance with these tags (TagSpecifications, so they exist at boot):
#       resilienced.io/gcs-address           the Ray cluster's GCS, host:port: what the node joins
#       resilienced.io/replaces              the lost instance this node stands in for
#       resilienced.io/capacity-type         spot | capacity-block | on-demand
#       resilienced.io/capacity-reservation-id   the Capacity Block (block launches only)
#       resilienced.io/elastic               true, for an elastic run's workers
#       resilienced.io/launched-by, resilienced.io/launch-token   the daemon's own (not labels)
#   * this script reads its instance id and region from the instance metadata (IMDSv2) and its
#     tags through the EC2 API (DescribeTags: the node's role needs ec2:DescribeTags; EC2's tag
#     view in the instance metadata cannot show keys containing '/'), then runs
#       ray start --address=<gcs-address> --labels=<every resilienced.io/ tag but the daemon's own
#                 and the address>,resilienced.io/instance-id=<its instance id>
#     so the daemon's follow-up finds the node by the labels it asked for.
#
# Settings (environment): RAY_START_ARGS (more `ray start` arguments, e.g. --num-gpus=8),
# RESILIENCED_TAG_WAIT_SECONDS (how long to wait for the tags, default 120),
# RESILIENCED_IMDS_ENDPOINT and RESILIENCED_RAY (the metadata service and the ray command: tests).
set -euo pipefail

IMDS="${RESILIENCED_IMDS_ENDPOINT:-http://169.254.169.254}"
RAY="${RESILIENCED_RAY:-ray}"
TAG_WAIT_S="${RESILIENCED_TAG_WAIT_SECONDS:-120}"

TOKEN=$(curl -fsS --retry 5 --retry-connrefused -X PUT \
  -H "X-aws-ec2-metadata-token-ttl-seconds: 300" "$IMDS/latest/api/token")
imds() { curl -fsS --retry 5 --retry-connrefused -H "X-aws-ec2-metadata-token: $TOKEN" "$IMDS/latest/meta-data/$1"; }
INSTANCE_ID=$(imds instance-id)
REGION=$(imds placement/region)

deadline=$((SECONDS + TAG_WAIT_S))
while :; do
  TAGS=$(aws ec2 describe-tags --region "$REGION" --filters "Name=resource-id,Values=$INSTANCE_ID" \
           --query 'Tags[].[Key,Value]' --output text || true)
  GCS=$(printf '%s\n' "$TAGS" | awk -F'\t' '$1 == "resilienced.io/gcs-address" { print $2 }')
  [ -n "$GCS" ] && break
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "resilienced: no resilienced.io/gcs-address tag on $INSTANCE_ID after ${TAG_WAIT_S}s" >&2
    exit 1
  fi
  sleep 2
done

LABELS=$(printf '%s\n' "$TAGS" | awk -F'\t' -v id="$INSTANCE_ID" '
  $1 ~ /^resilienced\.io\// && $1 != "resilienced.io/gcs-address" && $1 != "resilienced.io/launched-by" \
    && $1 != "resilienced.io/launch-token" && $1 != "resilienced.io/instance-id" {
    out = out (out == "" ? "" : ",") $1 "=" $2
  }
  END { print out (out == "" ? "" : ",") "resilienced.io/instance-id=" id }')

echo "resilienced: $INSTANCE_ID joins $GCS with labels $LABELS"
# shellcheck disable=SC2086  # RAY_START_ARGS is a list of arguments
exec $RAY start --address="$GCS" --labels="$LABELS" ${RAY_START_ARGS:-}
