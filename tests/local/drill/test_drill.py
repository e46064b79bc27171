"""The drill, as CI runs it: the whole chain on this machine, checked through its JSON report.

Each test runs ``resilienced drill`` as a subprocess (moto, a real multi-node Ray cluster, the
trainer with FSDP2 on gloo, the FSx stand-in, the daemon in ray mode) with small sizes, then
checks the report and that nothing the drill started is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

def port_closed(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def moto_port(output: str) -> int:
    import re

    found = re.search(r"moto on http://127\.0\.0\.1:(\d+)", output)
    assert found, output[-3000:]
    return int(found.group(1))


#: Small sizes.  The notice gives the daemon and the trainer 15 s to save (EC2: 120 s): on a loaded
#: machine a notice took the daemon more than 6 s to act on (Dec 3, make test-long with a core kept
#: busy: the instance went before the drain, 3 steps lost).  The 34 steps of 0.6 s after the notice
#: outlast it, so the run is still training at the deadline.
SMALL = ["--workers", "2", "--steps", "40", "--interrupt-at-step", "6", "--checkpoint-every", "3",
         "--notice-seconds", "15", "--step-seconds", "0.6", "--timeout", "240"]


def drill(tmp_path: Path, *args: str) -> dict:
    short = Path(tempfile.mkdtemp(prefix="dt-", dir="/tmp"))  # Ray's unix sockets need a short path
    try:
        return _drill(tmp_path, short / "w", *args)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _drill(tmp_path: Path, workdir: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "resilienced", "drill", *SMALL, *args, "--workdir", str(workdir),
         "--json-report", str(report)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert report.exists(), f"no report; exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # nothing is left behind without --keep: the work dir (ray temp dir, checkpoints, logs) is gone
    assert not workdir.exists(), f"the drill left {workdir} behind"
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes of the drill still running: {leftovers}"
    assert port_closed(moto_port(proc.stdout)), "the drill's moto server still listens"
    data = json.loads(report.read_text())
    assert proc.returncode == (0 if data["ok"] else 1), proc.stderr[-2000:]
    if not data["ok"]:  # what the drill printed (its timeline, the logs' tails) goes with the report
        data["stdout"], data["stderr"] = proc.stdout[-12000:].splitlines(), proc.stderr[-8000:].splitlines()
    # what the daemon logged of its ledger, for a failed assertion on it to show why
    data["_ledger_log"] = [line for line in (proc.stdout + proc.stderr).splitlines() if "ledger" in line][-20:]
    return data


class Webhook:
    """A webhook on 127.0.0.1 (a thread) that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        posts = self.posts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Webhook":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block(tmp_path: Path) -> None:
    with Webhook() as hook:
        report = drill(tmp_path, "--scenario", "spot", "--spot-capacity", "0", "--notify-webhook", hook.url,
                       "--plot", str(tmp_path / "drill.png"))
    assert report["ok"], json.dumps(report, indent=2)
    # the ledger (issue #43): the notice caught, no step trained twice; priced by moto and the price file
    ledger = report["ledger"]
    assert ledger["parts"]["steps_repeated"] == 0 and ledger["parts"]["idle"] > 0
    assert ledger["lost_gpu_seconds"] == pytest.approx(sum(v or 0 for v in ledger["parts"].values()), abs=0.01)
    assert ledger["cost"]["prices"] == {"spot": 0.00001, "capacity-block": 0.05, "on-demand": 0.096}
    assert ledger["cost"]["premium"] > 0 and 0 < ledger["goodput"] < 1
    balance = ledger["idle_vs_worker_seconds_idle"]
    assert balance["worker_seconds_idle"] == report["worker_seconds_idle"]
    assert balance["ledger_less_unheld_plus_surplus"] == pytest.approx(report["worker_seconds_idle"], abs=0.11)
    from resilienced.ops.plot import png_size

    assert png_size(tmp_path / "drill.png") == (1200, 600)
    # the daemon's own ledger, in its resumed notification
    (resumed,) = [p for p in hook.posts if "trains again" in p["text"]]
    assert "Lost GPU-seconds" in json.dumps(resumed["blocks"]), (resumed, report["_ledger_log"])
    # the drill's daemon posted the notice's facts once (Slack-compatible text + blocks)
    (notice,) = [p["text"] for p in hook.posts if "spot_interruption" in p["text"]]
    assert ": done" in notice and "durable yes" in notice and "capacity-block" in notice, notice
    assert report["steps_lost"] == 0 and report["steps_trained_twice"] == 0
    assert report["resumed_at_step"] == report["checkpoint_step"] + 1
    assert report["capacity"] == "capacity-block"
    assert report["losses_match_uninterrupted"] is True
    # both happened after the notice was sent (no wall-clock bound here). The durable step may
    # verify an earlier checkpoint than the one that holds the notice's step: any checkpoint
    # saved after the notice's time (EventBridge times have whole seconds) counts as durable.
    assert report["notice_to_checkpoint_s"] >= 0 and report["notice_to_durable_s"] >= 0


@pytest.mark.long(  # make test-long (docs/development.md, "Long stories"); in make test at less cost:
    # the drill's chain, up to the run training again on the capacity decided
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
    # the follow-up: a stage that stalls falls back to the next capacity and the run trains again
    "tests/recovery/test_followup.py::test_unschedulable_pods_fall_back_to_the_next_capacity_and_the_run_trains_again",
    "tests/recovery/test_followup.py::test_an_attempt_that_never_trains_at_its_size_is_a_stall_and_a_stuck_run_"
    "that_trains_ends_resumed",
    "tests/capacity/test_fallback.py::test_a_fallback_passes_over_the_stalled_block_and_counts_nothing_again",
    # ray mode's "joined" stage read from the GCS's nodes, and the stalled capacity given back
    "tests/ray/test_progress.py::test_joined_means_an_alive_replacement_with_the_decided_labels",
    "tests/ray/test_progress.py::test_withdraw_gives_back_only_the_stalled_capacity_replacing_the_lost_instance",
)
def test_a_capacity_block_that_never_joins_is_left_for_on_demand_and_the_run_trains_again(tmp_path: Path) -> None:
    """The stalled story: the block accepts the launch, its node never joins; after the joined
    bound the daemon's follow-up moves the run to On-Demand (the provider has it here), and the run
    resumes from the step saved at the notice."""
    with Webhook() as hook:
        report = drill(tmp_path, "--scenario", "stalled", "--notify-webhook", hook.url)
    assert report["ok"], json.dumps(report, indent=2)
    assert [(f["from"].split()[0], f["to"]) for f in report["fallbacks"]] == [("capacity-block", "on-demand")]
    assert "joined not reached" in report["fallbacks"][0]["reason"]
    assert report["capacity"] == "on-demand" and report["steps_lost"] == 0 and report["steps_trained_twice"] == 0
    stages = report["recovery_stages"]
    assert set(stages) == {"joined", "training"} and stages["joined"] < stages["training"]
    assert stages["training"] == report["daemon_training_again_s"] > 0
    texts = [p["text"] for p in hook.posts]
    assert any("fell back" in t for t in texts) and any("trains again" in t and "on-demand" in t for t in texts), texts


@pytest.mark.long(  # make test-long (docs/development.md, "Long stories"); in make test at less cost:
    # the drill's chain with a notice; what an abrupt loss costs, counted from the trainer's events
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
    "tests/local/drill/test_report.py::test_an_abrupt_loss_counts_the_steps_since_the_last_periodic_checkpoint",
    # a run that crashed resumes exactly from its newest periodic checkpoint
    "tests/trainer/test_local_resume.py::test_async_checkpoints_resume_exactly_also_after_a_crash_right_after_the_rename",
)
def test_an_abrupt_loss_resumes_from_the_last_periodic_checkpoint_and_says_what_it_cost(tmp_path: Path) -> None:
    report = drill(tmp_path, "--scenario", "abrupt")
    assert report["ok"], json.dumps(report, indent=2)
    # no notice: the run resumes from the newest periodic checkpoint (every 3 steps)
    assert report["checkpoint_step"] % 3 == 0 and report["checkpoint_step"] <= report["interrupted_at_step"]
    assert report["steps_lost"] == report["interrupted_at_step"] - report["checkpoint_step"]
    assert report["steps_lost"] == report["steps_trained_twice"]
    assert report["notice_to_checkpoint_s"] is None
    assert report["losses_match_uninterrupted"] is True


#: A short story, so that every phase is reached soon.
FAST = ["--workers", "2", "--steps", "40", "--interrupt-at-step", "4", "--checkpoint-every", "4",
        "--notice-seconds", "5", "--step-seconds", "0.2", "--timeout", "240"]

#: Each phase of the drill, and the line printed just before it begins.
PHASES = {
    "moto starts": "resilienced drill: scenario",
    "the Ray cluster starts": "moto on http://",
    "the daemon starts": "auto-exports to s3://",
    "the trainer starts": "running in ray mode on",
    "the notice": "Spot interruption notice for",
    "the reference run": "running the uninterrupted reference",
}


def marked_processes(workdir: Path) -> list[str]:
    """Live processes carrying the drill's work-dir marker in their environment (any session)."""
    needle = f"RESILIENCED_DRILL_WORKDIR={workdir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(f"{proc.name} {command[:160]}")
    return found


def uptime() -> float:
    """Seconds since boot, the clock of /proc/<pid>/stat's start times."""
    return float(Path("/proc/uptime").read_text().split()[0])


def group_alive(pgid: int, *, started_by: float) -> bool:
    """Whether a process of group ``pgid`` started by ``started_by`` (seconds since boot) still runs.

    Only those are the drill's: once the drill is reaped its pid, the group's id, may be given to
    a later process group (pid_max is 32768 here, and the suite starts thousands of processes).
    """
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            data = (proc / "stat").read_text()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        state, group, started = fields[0], int(fields[2]), int(fields[19]) / tick
        if group == pgid and state not in ("Z", "X") and started <= started_by:
            return True
    return False


#: The notice's phase (the trainer training on Ray, the daemon draining) is in make test-long
#: (docs/development.md, "Long stories"): make test stops the drill in every other phase, the
#: trainer and the daemon each among them, and the daemon alone on SIGTERM and SIGINT.
NOTICE_QUICK = (
    "tests/local/drill/test_drill.py::test_a_stop_signal_in_any_phase_stops_everything_the_drill_started",
    "tests/intake/test_daemon.py::test_a_stop_signal_while_the_daemon_starts_ends_it_with_0",
)


@pytest.mark.parametrize(("phase", "signal_name", "code"),
                         [*(pytest.param(phase, "SIGINT", 130, id=f"ctrl-c while {phase}",
                                         marks=[pytest.mark.long(*NOTICE_QUICK)] if phase == "the notice" else [])
                            for phase in PHASES),
                          # SIGTERM in one phase: make test-long; make test stops that phase with Ctrl-C, and
                          # the daemon alone with SIGTERM
                          pytest.param("the Ray cluster starts", "SIGTERM", 143, id="sigterm while the Ray cluster starts",
                                       marks=pytest.mark.long(
                                           "tests/local/drill/test_drill.py::test_a_stop_signal_in_any_phase_stops_"
                                           "everything_the_drill_started[ctrl-c while the Ray cluster starts]",
                                           "tests/intake/test_daemon.py::test_a_stop_signal_while_the_daemon_"
                                           "starts_ends_it_with_0[sigterm]"))])
def test_a_stop_signal_in_any_phase_stops_everything_the_drill_started(phase: str, signal_name: str,
                                                                        code: int) -> None:
    """Ctrl-C (or SIGTERM) in any phase: exit 130 (143), nothing the drill started left running,
    in its own process group or in the sessions of its children (moto, Ray nodes, the trainer),
    and no work dir.  The drill is started as a terminal starts it: SIGINT at its default (a
    process started by a background job of a non-interactive shell would inherit it ignored)."""
    import signal
    import time

    short = Path(tempfile.mkdtemp(prefix="dc-", dir="/tmp"))
    workdir = short / "w"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
         "os.execv(sys.executable, [sys.executable, '-m', 'resilienced', 'drill', *sys.argv[1:]])",
         *FAST, "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if PHASES[phase] in line:
                break
        assert any(PHASES[phase] in s for s in seen), "".join(seen)
        proc.send_signal(getattr(signal, signal_name))
        try:
            rest, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
            pytest.fail(f"the drill did not stop within 180 s of {signal_name}:\n{''.join(seen)}{rest}")
        reaped_at = uptime()
        output = "".join(seen) + rest
        assert proc.returncode == code, output
        assert f"stopped by {'SIGTERM' if signal_name == 'SIGTERM' else 'Ctrl-C'}" in rest, output
        end = time.monotonic() + 30  # the drill reaped its children; allow the kernel to finish
        while time.monotonic() < end and (marked_processes(workdir) or group_alive(proc.pid, started_by=reaped_at)):
            time.sleep(0.2)
        assert not marked_processes(workdir), output
        assert not group_alive(proc.pid, started_by=reaped_at), output
        assert not workdir.exists(), output
        if "moto on http://" in output:
            assert port_closed(moto_port(output))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(short, ignore_errors=True)
