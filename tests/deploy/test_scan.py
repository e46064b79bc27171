"""checkov on what an operator applies and builds: the built kustomizations (base and example
overlay), the CloudFormation templates and both Dockerfiles.

Open-source checkov has no severities (they come from Prisma Cloud), so the bar is stricter than
"no HIGH/CRITICAL": no failed check at all.  Each finding that does not apply is skipped where it
arises (a checkov.io/skip annotation, a Metadata.checkov entry, a ``# checkov:skip`` comment)
with its reason, and listed in docs/deploy.md; this test holds all three together.
"""

from __future__ import annotations

import json

import pytest

from .tools import DOCKERFILES, REPO, TEMPLATES, built_text, run, tool

pytestmark = pytest.mark.integration

#: (framework, check id) of every answered finding; docs/deploy.md explains each.
ANSWERED = {
    ("kubernetes", "CKV_K8S_43"),  # image by digest: set per release in the overlay
    ("kubernetes", "CKV_K8S_38"),  # ServiceAccount token: the daemon calls the Kubernetes API
    ("cloudformation", "CKV_AWS_27"),  # SQS encryption: SSE-SQS, which the check does not see
    ("dockerfile", "CKV_DOCKER_2"),  # HEALTHCHECK in the trainer image: KubeRay probes instead
}
#: At least this many checks must have passed per framework (the scan really ran on each).
MIN_PASSED = {"kubernetes": 150, "cloudformation": 10, "dockerfile": 50}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("checkov")
    files = []
    for name in ("base", "overlay"):
        path = folder / f"{name}.yaml"
        path.write_text(built_text(name))
        files.append(path)
    files += [*TEMPLATES, *DOCKERFILES]
    args = [tool("checkov"), "--skip-download", "--output", "json",
            "--framework", "kubernetes", "cloudformation", "dockerfile"]
    for path in files:
        args += ["-f", str(path)]
    done = run(args, timeout=300, env={"BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_OUTPUT_COLOR": "1"})
    assert done.returncode == 0 or done.stdout.strip(), done.stderr
    parsed = json.loads(done.stdout)
    return {r["check_type"]: r for r in (parsed if isinstance(parsed, list) else [parsed])}


def test_checkov_scanned_every_framework(reports: dict[str, dict]) -> None:
    assert set(reports) == set(MIN_PASSED)
    for framework, minimum in MIN_PASSED.items():
        assert reports[framework]["summary"]["parsing_errors"] == 0
        assert reports[framework]["summary"]["passed"] >= minimum, framework


def test_checkov_finds_nothing_unanswered(reports: dict[str, dict]) -> None:
    failed = [(framework, c["check_id"], c["resource"], c["check_name"])
              for framework, report in reports.items() for c in report["results"]["failed_checks"]]
    assert not failed, json.dumps(failed, indent=1)


def test_every_skip_is_answered_with_a_reason_here_and_in_the_docs(reports: dict[str, dict]) -> None:
    skipped = [(framework, c["check_id"], (c["check_result"].get("suppress_comment") or "").strip())
               for framework, report in reports.items() for c in report["results"]["skipped_checks"]]
    assert {(f, cid) for f, cid, _ in skipped} == ANSWERED
    assert all(len(reason) > 30 for _, _, reason in skipped), skipped
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert all(cid in docs for _, cid in ANSWERED)
