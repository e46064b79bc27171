"""resilienced.log: the project's structlog lines and libraries' stdlib records come out alike."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from resilienced import log

pytestmark = pytest.mark.unit


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """``log.configure`` on a buffer; the stdlib root and structlog are put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buffer = io.StringIO()
    log.configure(level="info", stream=buffer)
    try:
        yield buffer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.reset_defaults()


def lines(buffer: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_librarys_stdlib_record_is_a_structlog_json_line(stream: io.StringIO) -> None:
    library = logging.getLogger("botocore.endpoint")
    library.info("not shown: libraries log at warning and above")
    library.warning("retrying %s after %d attempts", "PutObject", 2)
    try:
        raise ConnectionError("reset by peer")
    except ConnectionError:
        library.error("request failed", exc_info=True)
    log.get("resilienced.aws.s3").info("uploaded", key="runs/a/manifest.json")

    warning, error, ours = lines(stream)
    assert {k: warning[k] for k in ("event", "level", "logger")} == {
        "event": "retrying PutObject after 2 attempts", "level": "warning", "logger": "botocore.endpoint"}
    assert warning["timestamp"].endswith("Z")  # type: ignore[union-attr]
    assert (error["level"], error["event"]) == ("error", "request failed")
    assert "ConnectionError: reset by peer" in error["exception"]  # type: ignore[operator]
    assert set(warning) == set(ours) - {"key"}, "both kinds of line carry the same fields"
    assert (ours["event"], ours["logger"], ours["key"]) == ("uploaded", "resilienced.aws.s3",
                                                            "runs/a/manifest.json")


def test_the_level_filters_the_projects_lines(stream: io.StringIO) -> None:
    log.configure(level="warning", stream=stream)
    logger = log.get("resilienced.kube.cache")
    logger.info("dropped")
    logger.warning("kubernetes cache: retrying", resource="pods")
    (line,) = lines(stream)
    assert (line["event"], line["level"], line["resource"]) == ("kubernetes cache: retrying", "warning", "pods")


def test_a_logger_made_before_configure_follows_it(stream: io.StringIO) -> None:
    structlog.reset_defaults()
    early = log.get("resilienced.kube.cluster")  # as a module-level logger is, at import
    log.configure(level="warning", stream=stream)
    early.info("dropped at warning")
    early.warning("kubernetes discovery failed", error="boom")
    (line,) = lines(stream)
    assert (line["event"], line["logger"], line["error"]) == (
        "kubernetes discovery failed", "resilienced.kube.cluster", "boom")
