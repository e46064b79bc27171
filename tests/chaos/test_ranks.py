"""tests/support/ranks.py: a rendezvous port taken before rank 0 listens on it is not a failure.

Found by the campaign's scenario 5 (many rank sets started one after another): the free port
run_ranks picks is closed before rank 0's TCPStore binds it, and another process took it in
between (EADDRINUSE); every rank is now started again on another port.
"""

from __future__ import annotations

import socket

import pytest

from tests.chaos import ckpt_ranks
from tests.support import ranks

pytestmark = pytest.mark.e2e


def test_a_taken_rendezvous_port_starts_the_ranks_again_on_another(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = ranks._free_port
    ports = iter([taken.getsockname()[1]])  # the first pick: a port another process holds
    monkeypatch.setattr(ranks, "_free_port", lambda: next(ports, None) or real())
    try:
        results = ranks.run_ranks(ckpt_ranks.resume_and_go_on, 2, [str(tmp_path)], timeout=300)
    finally:
        taken.close()
    assert [r.unwrap()[0]["final"] for r in results] == [1, 1]  # nothing to resume: step 1 saved
