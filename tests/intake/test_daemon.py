"""``resilienced run`` as a real process against moto: start-up checks, HTTP, and SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import threading
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from resilienced.app import cli
from resilienced.local.aws import free_port

from . import payloads as p
from .conftest import REGION, make_queues
from .process import DaemonProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def processes() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for process in started:
        process.kill()


def run_flags(queues, port: int, *extra: str) -> list[str]:
    return ["--queue-url", queues.url, "--endpoint-url", queues.endpoint_url, "--region", REGION,
            "--wait-seconds", "1", "--http-host", "127.0.0.1", "--http-port", str(port), *extra]


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_run_refuses_a_queue_without_a_dlq(aws, capsys):
    bare = make_queues(aws, name="no-dlq", dlq=False)
    code = cli.main(["run", "--queue-url", bare.url, "--endpoint-url", bare.endpoint_url,
                     "--region", REGION, "--http-port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("resilienced: error: --queue-url: queue ")
    assert bare.url in err and "no redrive policy" in err and "--allow-no-dlq" in err


def test_run_exits_1_when_the_queue_does_not_answer(aws, capsys):
    port = free_port()
    code = cli.main(["run", "--queue-url", f"http://127.0.0.1:{port}/123456789012/q",
                     "--endpoint-url", f"http://127.0.0.1:{port}", "--region", REGION])
    assert code == 1
    assert "did not answer" in capsys.readouterr().err


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts, reads and never answers: a queue endpoint that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requested = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                self.requested.set()
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_signal_while_the_daemon_starts_ends_it_with_0(processes, sig):
    """SIGTERM (a pod deleted) or SIGINT while the start-up checks wait on a queue that does not
    answer: the start-up ends, the daemon says so and exits 0 (before: the default action, -15)."""
    server = SilentServer()
    try:
        daemon = DaemonProcess(["-m", "resilienced", "run", "--queue-url",
                                f"http://127.0.0.1:{server.port}/123456789012/q", "--endpoint-url",
                                f"http://127.0.0.1:{server.port}", "--region", REGION,
                                "--http-host", "127.0.0.1", "--http-port", str(free_port())],
                               env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        processes.append(daemon)
        assert server.requested.wait(60), f"the daemon never asked the queue; exit={daemon.proc.poll()}"
        daemon.proc.send_signal(sig)
        assert daemon.wait_exit(timeout=60) == 0, daemon.stderr()
    finally:
        server.close()
    assert [line["signal"] for line in daemon.events("signal")] == [sig.name]
    stopped, = daemon.events("stopped")
    assert stopped["during"] == "start-up" and stopped["released"] == 0
    assert daemon.events("started") == [] and daemon.events("decision") == []
    assert [line["event"] for line in daemon.lines][:1] == ["starting"]


def now_iso(shift: timedelta = timedelta(0)) -> str:
    return (datetime.now(UTC) + shift).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_run_decides_logs_serves_http_and_exits_0_on_sigterm(aws, processes):
    queues = make_queues(aws)
    port = free_port()
    for instance in ("i-00000001", "i-00000002"):
        queues.send(p.spot(instance, time=now_iso()))
    queues.send("not an event")
    daemon = DaemonProcess(["-m", "resilienced", "run", *run_flags(queues, port)])
    processes.append(daemon)
    daemon.wait_for(lambda lines: sum(1 for line in lines if line.get("event") == "decision"
                                      and line.get("outcome") == "done") == 2)
    started = daemon.events("started")[0]
    assert started["max_receive_count"] == 3 and started["http_port"] == port
    decision = next(d for d in daemon.events("decision") if d["outcome"] == "done")
    assert set(decision) >= {"event_id", "kind", "instance_ids", "outcome", "reason", "verdict",
                             "latency_s", "timestamp", "level"}
    assert http_get(port, "/healthz")[0] == 200
    assert http_get(port, "/readyz")[0] == 200
    status, metrics = http_get(port, "/metrics")
    assert status == 200
    assert 'resilienced_events_decided_total{kind="spot_interruption",outcome="done"} 2.0' in metrics
    # what the alerts read: ready, versions, process metrics, the queue's depth (read at start)
    assert "\nresilienced_ready 1.0" in metrics and "\nprocess_start_time_seconds " in metrics
    assert 'resilienced_build_info{ray_version="' in metrics and 'version="0.1.0"} 1.0' in metrics
    assert 'resilienced_queue_messages{state="visible"}' in metrics
    assert "resilienced_last_message_received_timestamp_seconds 0.0" not in metrics
    assert daemon.terminate() == 0
    assert daemon.events("stopped")


def test_sigterm_releases_unfinished_messages_and_loses_none(aws, processes):
    queues = make_queues(aws)
    port = free_port()
    sent = {queues.send(p.spot(f"i-0000000{n}", time=now_iso())) for n in range(1, 4)}
    daemon = DaemonProcess(["tests/intake/blocking_daemon.py",
                            *run_flags(queues, port, "--shutdown-timeout", "1")])
    processes.append(daemon)
    daemon.wait_for(lambda lines: len([line for line in lines if line.get("event") == "blocked"]) == 3)
    assert queues.counts() == (0, 3)
    assert daemon.terminate() == 0
    assert len(daemon.events("released")) == 3
    assert daemon.events("decision") == []  # nothing was settled, so nothing was deleted
    back = queues.receive_all(wait=1)  # released with visibility 0: visible at once
    assert {m["MessageId"] for m in back} == sent
    assert {json.loads(m["Body"])["detail"]["instance-id"] for m in back} == {
        "i-00000001", "i-00000002", "i-00000003"}


def test_run_acknowledges_stale_and_future_notices_without_acting_and_counts_them(aws, processes):
    """The daemon judges at its own clock: a 2024 notice and one an hour ahead are deleted, with
    the reason on the decision line and in resilienced_stale_events_total; a fresh one is done."""
    queues = make_queues(aws)
    port = free_port()
    queues.send(p.spot("i-00000001", time=now_iso()))
    queues.send(p.spot("i-00000002"))  # time 2024-01-01T00:00:00Z: its deadline is long gone
    queues.send(p.spot("i-00000003", time=now_iso(timedelta(hours=1))))
    daemon = DaemonProcess(["-m", "resilienced", "run", *run_flags(queues, port)])
    processes.append(daemon)
    daemon.wait_for(lambda lines: sum(1 for line in lines if line.get("event") == "decision") == 3)
    decisions = {d["instance_ids"][0]: d for d in daemon.events("decision")}
    assert decisions["i-00000001"]["outcome"] == "done" and "stale" not in decisions["i-00000001"]
    old, ahead = decisions["i-00000002"], decisions["i-00000003"]
    assert (old["outcome"], old["verdict"], old["stale"]) == ("not_actionable", "delete", "past")
    assert old["reason"].startswith("stale: its deadline 2024-01-01T00:02:00Z passed ")
    assert "(allowed: 300s, --stale-after-seconds): not acted on" in old["reason"]
    assert (ahead["outcome"], ahead["verdict"], ahead["stale"]) == ("not_actionable", "delete", "future")
    assert "--future-skew-seconds" in ahead["reason"]
    status, metrics = http_get(port, "/metrics")
    assert 'resilienced_stale_events_total{kind="spot_interruption",when="past"} 1.0' in metrics
    assert 'resilienced_stale_events_total{kind="spot_interruption",when="future"} 1.0' in metrics
    assert daemon.terminate() == 0
    assert queues.counts() == (0, 0)
