"""atheris target: ``intake.read`` on any bytes, under each intake policy (scenario 4).

Run by tests/chaos/fuzz.py as ``python tests/chaos/fuzz_intake.py <corpus> -max_total_time=S``
(libFuzzer flags). A body that makes ``intake.read`` raise, or leaves an input unclassified (no
kind, or not actionable without a reason), is a crash: libFuzzer stops and writes it to
``crash-*`` in the working directory.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["resilienced", "handlers"]):
    from resilienced.intake import pipeline as intake
    from resilienced.model import Kind
    from resilienced.settings import IntakeSettings

POLICIES = (IntakeSettings(), IntakeSettings(allowed_accounts=("123456789012",), allowed_regions=("us-east-1",)),
            IntakeSettings(rebalance_policy="drain"), IntakeSettings(rebalance_policy="checkpoint-ahead"))
KINDS = set(Kind)


def classify(data: bytes) -> None:
    policy = POLICIES[data[0] % len(POLICIES)] if data else POLICIES[0]
    for body in (data, data.decode("utf-8", "replace")):
        reading = intake.read(body, policy)
        plan = reading.plan
        if plan.event.kind not in KINDS:
            raise AssertionError(f"unclassified: kind {plan.event.kind!r}")
        if not plan.actionable and not plan.reason:
            raise AssertionError("not actionable, and no reason given")
        if not reading.decoded and plan.event.kind is not Kind.INVALID:
            raise AssertionError(f"undecodable body classified as {plan.event.kind}")
        if plan.deadline is not None and plan.deadline.tzinfo is None:
            raise AssertionError("a deadline without a time zone")


if __name__ == "__main__":
    atheris.Setup(sys.argv, classify)
    atheris.Fuzz()
