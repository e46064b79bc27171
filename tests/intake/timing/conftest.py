"""Every test of this folder runs on the virtual clock (tests/support/virtualtime.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.virtualtime import VirtualClockLoop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Any:
    return {"virtual-clock": VirtualClockLoop}
