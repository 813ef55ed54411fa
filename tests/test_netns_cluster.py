"""scripts/netns_cluster.sh: up / limited rate / down round trip with a real transfer between the namespaces.

Skipped (with the script's own message) where network namespaces are not permitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "netns_cluster.sh"
PREFIX = f"dpt{os.getpid() % 10000}_n"  # unique per test run, <= 15 chars with the "0v" suffix
ENV = {**os.environ, "DISTPLAN_NETNS_PREFIX": PREFIX}
NBYTES = 2_000_000  # 16 Mbit: 0.16 s at 100 Mbit/s, milliseconds unlimited
PORT = 29517

_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.77.0.2", int(sys.argv[1]))); s.listen(1); s.settimeout(20)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(20); n = 0
    while n < int(sys.argv[2]):
        chunk = c.recv(1 << 16)
        if not chunk: break
        n += len(chunk)
    c.sendall(b"k"); c.close(); print(n, flush=True)
    """
)
_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    for _ in range(100):  # the server may still be binding
        try:
            c = socket.create_connection(("10.77.0.2", int(sys.argv[1])), timeout=20); break
        except OSError:
            time.sleep(0.05)
    data = b"x" * int(sys.argv[2]); t0 = time.perf_counter()
    c.sendall(data); c.recv(1)
    print(time.perf_counter() - t0)
    """
)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=60, check=check)


def _transfer_seconds(port: int) -> float:
    """Seconds to send NBYTES from namespace 0 (10.77.0.1) to namespace 1 (10.77.0.2) and get an ack."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", f"{PREFIX}1", sys.executable, "-c", _SERVER, str(port), str(NBYTES)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = subprocess.run(
            ["ip", "netns", "exec", f"{PREFIX}0", sys.executable, "-c", _CLIENT, str(port), str(NBYTES)],
            capture_output=True, text=True, timeout=30, check=True,
        )
        received = int(server.communicate(timeout=30)[0].strip())
        assert received == NBYTES
        return float(out.stdout.strip())
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _run_cleaning_up(cmd: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """Run a script that sets up this test's namespaces; past ``timeout`` it gets a SIGTERM (so it removes them itself,
    where subprocess.run's SIGKILL left them behind), and whatever is left is removed afterwards anyway."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    finally:
        _sh("down", check=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def cluster():
    probe = _sh("status", check=False)
    up = _sh("up", "--rate", "unlimited", check=False)
    if up.returncode == 77:
        pytest.skip(up.stderr.strip())
    assert up.returncode == 0, up.stderr
    assert probe.returncode == 0
    try:
        yield
    finally:
        _sh("down", check=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_up_limit_down_round_trip(cluster):
    status = _sh("status").stdout
    assert f"{PREFIX}0 {PREFIX}0v 10.77.0.1/24" in status and f"{PREFIX}1 {PREFIX}1v 10.77.0.2/24" in status
    assert "tbf" not in status
    fast = _transfer_seconds(PORT)

    again = _sh("up", "--rate", "100mbit")  # idempotent: re-shapes the existing cluster
    assert "existing" in again.stdout
    status = _sh("status").stdout
    assert status.count("rate 100Mbit") == 2, status  # both veth ends are limited
    slow = _transfer_seconds(PORT + 1)
    mbit_per_s = NBYTES * 8 / slow / 1e6
    # 2 MB through a 100 Mbit/s token bucket needs >= ~0.16 s minus the initial burst
    assert mbit_per_s < 130, f"limited link moved {mbit_per_s:.0f} Mbit/s"
    assert slow > 3 * fast, (slow, fast)

    assert "removed" in _sh("down").stdout
    assert "nothing to remove" in _sh("down").stdout  # idempotent
    assert "status down" in _sh("status").stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert PREFIX not in listed


def test_bad_arguments_fail_clearly():
    bad = _sh("up", "--rate", "10gbit", check=False)
    assert bad.returncode == 1 and "--rate must be 100mbit, 1gbit or unlimited" in bad.stderr and "HINT" in bad.stderr
    bad = _sh("sideways", check=False)
    assert bad.returncode == 1 and "unknown action" in bad.stderr and "HINT" in bad.stderr
    # a prefix ip cannot use is an error, not "namespaces are not permitted here" (exit 77, which skips the tests)
    for prefix, why in (("run/x", "must start with a letter or digit and hold only"), ("-x", "must start with a letter or digit"),
                        ("p" * 14, "is 14 characters; the interface")):
        res = subprocess.run(["bash", str(SCRIPT), "up"], env={**ENV, "DISTPLAN_NETNS_PREFIX": prefix}, capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and why in res.stderr and "HINT" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_skip_message_without_privileges():
    """As an unprivileged user the script exits 77 with a clear message and changes nothing."""
    if os.geteuid() != 0:
        res = _sh("up", check=False)
    else:
        nobody = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True)
        if nobody.returncode != 0 or not Path("/usr/sbin/runuser").exists() and not Path("/sbin/runuser").exists():
            pytest.skip("no 'nobody' user or runuser to drop privileges with")
        res = subprocess.run(
            ["runuser", "-u", "nobody", "--", "bash", str(SCRIPT), "up"],
            env={**ENV, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}, capture_output=True, text=True, timeout=30,
        )
    assert res.returncode == 77, (res.returncode, res.stderr)
    assert "skipped" in res.stderr and "HINT" in res.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_gloo_hand_over_crosses_the_link_only_once_the_receiver_posts(tmp_path):
    """benchmarks/gloo_rendezvous.py at 100 Mbit/s: a recv posted late still waits the message's whole link time,
    and a batched exchange crosses one direction after the other.

    The cost model's stage programs rest on this (a stage cannot receive in the background; over gloo
    1F1B's exchanges take two hand-overs).
    """
    import json

    out = tmp_path / "rdv.json"
    res = _run_cleaning_up([sys.executable, str(SCRIPT.parents[1] / "benchmarks" / "gloo_rendezvous.py"), "--delay", "0.2", "--port", "29519",
                            "--out", str(out)], timeout=240)
    if res.returncode == 77:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["bytes"], r["recv_posted_after_s"] > 0): r for r in json.loads(out.read_text())["exchanges"]}
    for nbytes in (256 << 10, 1 << 20):
        link_s = nbytes * 8 / 100e6  # 21 ms and 84 ms at 100 Mbit/s
        prompt, late = rows[(nbytes, False)], rows[(nbytes, True)]
        assert prompt["recv_after_posting_s"] > 0.7 * link_s
        # posted 0.2 s after the send, the recv still takes the transfer time: nothing crossed before
        assert late["recv_after_posting_s"] > 0.7 * link_s
        assert late["sender_wait_s"] >= 0.2  # and the sender's wait ended only once the recv was posted
    # batched [send, recv] as Schedule1F1B posts them: the rank posting second waits for both messages in turn
    # (its recv's "ready" notice travels behind its own data), one message time when its recv is listed first
    batched = {(r["bytes"], r["first"], r["rank"]): r["wait_s"] for r in json.loads(out.read_text())["batched"]}
    for nbytes in (256 << 10, 1 << 20):
        link_s = nbytes * 8 / 100e6
        assert batched[(nbytes, "send", 1)] > 1.6 * link_s
        assert batched[(nbytes, "recv", 1)] < 0.8 * batched[(nbytes, "send", 1)]
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(PREFIX)  # torn down


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_up_interrupted_half_way_leaves_nothing_behind(tmp_path):
    """Ctrl-C (or kill, timeout) while `up` builds the cluster: what it made so far is removed (bash runs no EXIT
    trap on a signal by itself)."""
    import shutil
    import signal

    real_ip = shutil.which("ip")
    if real_ip is None:
        pytest.skip("no `ip` command")
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "ip").write_text(f"#!/bin/sh\nsleep 0.3\nexec {real_ip} \"$@\"\n")
    (slow / "ip").chmod(0o755)
    env = {**ENV, "PATH": f"{slow}:{os.environ['PATH']}"}

    def as_from_a_terminal() -> None:
        # A shell started from a terminal has SIGINT/SIGTERM at their defaults; a child of this test process inherits
        # what the process has (ignored or blocked signals survive exec, and bash cannot trap a signal ignored on entry).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(["bash", str(SCRIPT), "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=as_from_a_terminal)
        deadline = time.monotonic() + 30
        while f"{PREFIX}0" not in subprocess.run([real_ip, "netns", "list"], capture_output=True, text=True).stdout:
            if proc.poll() is not None:  # refused at once: no permission for namespaces here
                assert proc.returncode == 77, proc.stderr.read()
                pytest.skip(proc.stderr.read().strip())
            assert time.monotonic() < deadline, "the first namespace never appeared"
            time.sleep(0.05)
        time.sleep(0.4)  # one or two more `ip` calls in: the second namespace or the veth pair half made
        try:
            state = " ".join(line.strip() for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("Sig"))
        except OSError:
            state = "gone"
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C reaches the whole process group
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "up failed, cleaning up" in out + err, (sig, proc.returncode, state, out, err)
        listed = subprocess.run([real_ip, "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run([real_ip, "-br", "link"], capture_output=True, text=True).stdout
        assert PREFIX not in listed and PREFIX not in links, (sig, listed, links)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_sweep_stopped_by_an_error_between_settings_keeps_what_it_measured_beside_an_earlier_partial_file(tmp_path):
    """benchmarks/cpu_cluster_sweep.py kept the settings measured so far on Ctrl-C only: a rate that could not be applied
    (here `tc` refuses 1gbit) ended the sweep with a traceback and nothing written, after every setting of the rates before.
    And a second stopped sweep with the same --out replaced the first one's <out>.partial.json (hours of runs on a full
    sweep) without a word: with an earlier stopped sweep's file there, this one writes <out>.partial.2.json and says so.
    (A first stopped sweep's own <out>.partial.json: test_a_stopped_sweep_keeps_what_its_failed_and_its_interrupted_settings_measured.)"""
    import json
    import shutil

    real_tc = shutil.which("tc")
    if real_tc is None:
        pytest.skip("no `tc` command")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "tc").write_text(f'#!/bin/sh\ncase "$*" in *1gbit*) echo "tc: refused" >&2; exit 2;; esac\nexec {real_tc} "$@"\n')
    (shim / "tc").chmod(0o755)
    out = tmp_path / "sweep.json"
    earlier = tmp_path / "sweep.partial.json"  # an earlier stopped sweep's settings
    earlier.write_text(json.dumps({"schema": "distplan-cpu-cluster-sweep/1", "stopped": "interrupted",
                                   "settings": [{"model_key": "mlp", "rate": "100mbit", "error": "interrupted; exit codes [-15, -15]"}]}))
    first = earlier.read_bytes()
    # --timeout 1: the one unlimited setting is stopped at once and recorded as failed, which is enough to keep
    cmd = [sys.executable, str(SCRIPT.parents[1] / "benchmarks" / "cpu_cluster_sweep.py"), "--quick", "--models", "mlp",
           "--rates", "unlimited,1gbit", "--timeout", "1", "--out", str(out)]
    proc = subprocess.Popen(cmd, env={**ENV, "PATH": f"{shim}:{os.environ['PATH']}"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=30)
        _sh("down", check=False)
    if proc.returncode == 77 or "skipped" in stderr:
        pytest.skip(stderr.strip())
    assert proc.returncode == 1, stderr[-2000:]
    assert "Traceback" not in stderr and "cpu_cluster_sweep: stopped by RuntimeError: netns_cluster.sh up --rate 1gbit failed" in stderr
    assert stderr.strip().splitlines()[-1].endswith(
        f"; an earlier stopped sweep's {earlier} is kept, and the 1 setting(s) run are in {tmp_path / 'sweep.partial.2.json'}."), stderr[-2000:]
    assert earlier.read_bytes() == first  # the earlier sweep's file, untouched
    partial = json.loads((tmp_path / "sweep.partial.2.json").read_text())
    assert [(s["model_key"], s["rate"]) for s in partial["settings"]] == [("mlp", "unlimited")]
    assert partial["stopped"].startswith("stopped by RuntimeError") and not out.exists()
    assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # torn down


STOPPING_MODELS = """
import os
import time
from pathlib import Path

from lightning_distplan.bench.models import WideMLP

FITS = []  # the plan fits this process ran


class FailsEveryPlan(WideMLP):
    def on_train_batch_start(self, batch, batch_idx):  # profiled fine; every plan's run fails, on both ranks
        raise RuntimeError("simulated failure of every run")


class HangsInItsSecondPlan(WideMLP):
    def on_fit_start(self):
        FITS.append(self.trainer.global_rank)

    def on_train_batch_start(self, batch, batch_idx):
        if len(FITS) == 2:  # the second plan's run, on both ranks: the sweep is stopped here
            Path(os.environ["DISTPLAN_TEST_MARK"]).touch()
            time.sleep(600)
"""

_SWEEP_DRIVER = """
import functools
import json
import sys
sys.path.insert(0, sys.argv[1])
import cpu_cluster_sweep as sweep
sweep.QUICK.update({key: {**sweep.QUICK["mlp"], "model": model} for key, model in json.loads(sys.argv[2]).items()})
# The hung workers ignore SIGTERM (Lightning's handler in a fit), so the stop always ran into the 10 s grace before SIGKILL:
# 1 s is as good a grace here (test_a_stopped_setting_gives_its_two_nodes_one_grace_period_together tests the grace itself)
sweep._stop_nodes = functools.partial(sweep._stop_nodes, grace_s=1.0)
sys.exit(sweep.main(sys.argv[3:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_a_stopped_sweep_keeps_what_its_failed_and_its_interrupted_settings_measured(tmp_path):
    """One sweep of two settings (the nodes' start is most of a setting's time; one sweep run proves both):

    * a setting whose bench wrote its result and exited non-zero (here: no plan produced a measurement, status 1; or a
      plan not every rank finished, status 2, after the plans before it were measured) was recorded as 'exit codes
      [1, 1]' and a log tail; the result file, each plan's prediction and error, went with the temporary folder;
    * a sweep stopped (SIGTERM, Ctrl-C) while a setting ran kept only the settings before it: the plans that setting had
      measured, minutes of runs, went with its temporary folder.

    Both records now go into <out>.partial.json with what they measured; and the nodes' logs are shown without their
    'result written to /tmp/tmpXXXX/bench.json', a folder gone by then."""
    import json
    import signal

    if shutil_which("ip") is None:
        pytest.skip("no `ip` command")
    (tmp_path / "stopping_models.py").write_text(STOPPING_MODELS)
    out = tmp_path / "sweep.json"
    models = {"fails": "stopping_models:FailsEveryPlan", "hangs": "stopping_models:HangsInItsSecondPlan"}
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]),
           "DISTPLAN_TEST_MARK": str(tmp_path / "hung")}
    cmd = [sys.executable, "-c", _SWEEP_DRIVER, str(SCRIPT.parents[1] / "benchmarks"), json.dumps(models), "--quick", "--models", "fails,hangs",
           "--rates", "unlimited", "--passes", "1", "--confirm", "0", "--min-time", "0", "--steps", "1", "--warmup", "0", "--plans", "1,2",
           "--timeout", "400", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (tmp_path / "hung").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None and (tmp_path / "hung").exists():
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _sh("down", check=False)
    if proc.returncode == 77 or "skipped" in stderr:
        pytest.skip(stderr.strip())
    assert proc.returncode == 130, (stdout[-3000:], stderr[-3000:])
    assert "Traceback" not in stderr and "the 2 setting(s) run (the one it stopped in with the plans it had measured) are in" in stderr, stderr[-2000:]
    failed, stopped = json.loads((tmp_path / "sweep.partial.json").read_text())["settings"]
    # the failed setting: its bench's result file, both plans' predictions and errors, kept under partial_result
    assert failed["model_key"] == "fails" and failed["error"] == "failed; exit codes [1, 1]" and "summary" not in failed
    kept = failed["partial_result"]
    # --plans 1,2 names the first profile's ranks (the final ones, from the mean of the profiles, may differ)
    assert kept["schema"] == "distplan-bench/1" and sorted(p["first_profile"]["rank"] for p in kept["plans"]) == [1, 2]
    assert all("simulated failure of every run" in p["error"] and p["predicted_step_time_s"] > 0 for p in kept["plans"])
    assert kept["ranks_per_host"] == 1  # 2 nodes of 1 rank: what a replay prices the plans with
    assert len(failed["plan_runs"]) == 2 and all(": failed: RuntimeError" in r for r in failed["plan_runs"])
    assert "FAILED (failed; exit codes [1, 1]" in stdout and "its result file kept as partial_result" in stdout
    # the interrupted setting: the plan run before the second hung, as the bench reported it
    assert stopped["model_key"] == "hangs" and stopped["error"].startswith("interrupted") and "summary" not in stopped
    runs = stopped["plan_runs"]
    assert len(runs) == 1 and all(" rank " in r and ": measured " in r and "predicted" in r for r in runs), runs
    # the nodes' logs are shown without the line naming the deleted temporary folder's result file
    assert "result written to" not in stdout and "result written to" not in failed["log_tail"], stdout[-3000:]
    assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # torn down
    left = subprocess.run(["pgrep", "-f", "stopping_models:HangsInItsSecondPlan"], capture_output=True, text=True).stdout.split()
    assert left == []  # no node left running


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


_IGNORES_SIGTERM = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a torchrun agent waiting for a worker in a fit, which ignores SIGTERM
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
                 start_new_session=True)  # its worker, in a session of its own
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sweep reads the process tree from /proc")
def test_a_stopped_setting_gives_its_two_nodes_one_grace_period_together():
    """The sweep stopped a setting's two torchrun agents one after the other, each given 10 s to stop its worker (which
    ignores SIGTERM in a fit) before SIGKILL: a Ctrl-C took ~19 s to come back (measured on the namespace cluster, a
    plan hung), ~12 s now. Both are sent SIGTERM at once and share the grace; here 1 s, for two agents that ignore it."""
    sys.path.insert(0, str(SCRIPT.parents[1] / "benchmarks"))
    from cpu_cluster_sweep import _descendants, _stop_nodes

    procs = [subprocess.Popen([sys.executable, "-c", _IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        workers = [pid for p in procs for pid in _descendants(p.pid)]
        assert len(workers) == 2
        t0 = time.monotonic()
        _stop_nodes(procs, grace_s=1.0)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
    assert [p.returncode for p in procs] == [-9, -9]  # SIGKILL after the grace
    assert took < 1.8, took  # one grace for both (one after the other: 2 s and more)
    time.sleep(0.2)
    assert not [pid for pid in workers if _running(pid)]  # the workers, in sessions of their own, are gone too


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (an orphan whose reaper has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
