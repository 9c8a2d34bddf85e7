"""Hang guards scaled to the machine (``fastddp.testing.slack``): the factor and its errors, every
test's pytest time limit scaled by ``conftest.py``, ``tests/streams.py`` measuring the factor for
its streams, and the guard by CPU time of a process, or a command and its children, that only
computes."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[1]
NESTED = ["own_limit_is_scaled", "without_a_limit_gets_the_default_scaled"]


def test_a_guard_scales_by_the_variable(monkeypatch):
    monkeypatch.delenv(slack.VAR, raising=False)
    assert slack.factor() == 1.0 and slack.guard(120) == 120
    monkeypatch.setenv(slack.VAR, "2.5")
    assert slack.factor() == 2.5 and slack.guard(120) == 300


@pytest.mark.parametrize("bad", ["0.5", "9", "fast", "nan", ""])
def test_a_bad_factor_is_refused_with_the_fix(monkeypatch, bad):
    monkeypatch.setenv(slack.VAR, bad)
    with pytest.raises(ValueError, match=f"{slack.VAR}=.*give a number from 1 to 4.*or unset it"):
        slack.factor()


@pytest.mark.timeout(7)
def test_a_tests_own_limit_is_scaled(request):
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(7 * slack.factor())


def test_a_test_without_a_limit_gets_the_default_scaled(request, pytestconfig):
    mark = request.node.get_closest_marker("timeout")
    if slack.factor() == 1.0:
        assert mark is None  # pytest-timeout's own default applies
    else:
        want = float(pytestconfig.getini("timeout")) * slack.factor()
        assert mark.args[0] == pytest.approx(want)


def _nested(env: dict, *runner: str) -> subprocess.CompletedProcess:
    args = [str(ROOT / "tests" / "test_slack.py"), "-q", "-p", "no:cacheprovider"]
    args += ["-k", " or ".join(NESTED)]
    return slack.run([*runner, *args], cwd=ROOT, env=env, timeout=slack.guard(240))


@pytest.mark.multiproc
def test_the_suite_scales_every_limit_and_streams_measure_the_factor(tmp_path):
    # A pytest told that this machine is 2.5 times slower: the two tests above check their limits.
    env = {**os.environ, slack.VAR: "2.5", "TMPDIR": str(tmp_path)}
    res = _nested(env, sys.executable, "-m", "pytest")
    assert res.returncode == 0 and "2 passed" in res.stdout, res.stdout + res.stderr
    # streams.py without the variable measures the factor and hands it to its streams.
    del env[slack.VAR]
    res = _nested(env, sys.executable, str(ROOT / "tests" / "streams.py"), "--only", "single", "--")
    assert res.returncode == 0 and "2 passed" in res.stdout, res.stdout + res.stderr
    assert f"CPU s here, 1 where they were sized ({slack.VAR})" in res.stdout, res.stdout
    # Given one, streams.py keeps it.
    env[slack.VAR] = "1.5"
    res = _nested(env, sys.executable, str(ROOT / "tests" / "streams.py"), "--only", "single", "--")
    assert res.returncode == 0 and f"hang guards x 1.50 ({slack.VAR} is yours)" in res.stdout


def _exit_with(code):
    os._exit(code)


def _spin():
    while True:
        pass


def _sleep():
    time.sleep(600)


def _started(target, *args):
    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    return proc


@pytest.mark.timeout(60)
def test_a_busy_guard_returns_the_exit_code_of_a_process_that_ends(monkeypatch):
    monkeypatch.delenv(slack.VAR, raising=False)
    assert slack.join_busy(_started(_exit_with, 3), cpu_s=30, idle_s=30) == 3


@pytest.mark.timeout(60)
def test_a_busy_guard_stops_a_loop_by_its_cpu_time(monkeypatch):
    monkeypatch.delenv(slack.VAR, raising=False)
    proc = _started(_spin)
    assert slack.join_busy(proc, cpu_s=1, idle_s=30) is None
    assert not proc.is_alive() and proc.exitcode == -9


@pytest.mark.timeout(60)
def test_a_busy_guard_stops_a_process_that_uses_no_cpu(monkeypatch):
    monkeypatch.setenv(slack.VAR, "1.5")
    start = time.monotonic()
    proc = _started(_sleep)
    assert slack.join_busy(proc, cpu_s=30, idle_s=1) is None
    # Scaled: 1.5 s without a CPU tick, not 1.
    assert not proc.is_alive() and time.monotonic() - start >= 1.5


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie not yet reaped by its new parent counts)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(60)
def test_a_busy_guard_returns_the_exit_code_of_a_command(monkeypatch):
    monkeypatch.delenv(slack.VAR, raising=False)
    proc = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    assert slack.join_busy(proc, cpu_s=30, idle_s=30) == 3


@pytest.mark.timeout(60)
def test_a_busy_guard_counts_the_cpu_of_a_commands_children_and_stops_them_all(monkeypatch):
    # A shell that only waits while its child spins, as a compiler driver waits on cc1plus:
    # the shell's own CPU never moves, so without its child's the 600 s idle limit would apply.
    monkeypatch.delenv(slack.VAR, raising=False)
    spin = f"{sys.executable} -c 'while True: pass' & echo $!; wait"
    proc = subprocess.Popen(
        ["sh", "-c", spin], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(proc.stdout.readline())
    assert slack.join_busy(proc, cpu_s=1, idle_s=600) is None
    assert proc.returncode == -9 and _gone(child)
    proc.stdout.close()


@pytest.mark.timeout(60)
def test_run_busy_returns_what_a_command_wrote_and_stops_one_that_spins(monkeypatch):
    monkeypatch.delenv(slack.VAR, raising=False)
    done = slack.run_busy(["sh", "-c", "echo out; echo err >&2; exit 4"], cpu_s=30, idle_s=30)
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")
    spin = [sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"]
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        slack.run_busy(spin, cpu_s=1, idle_s=600)
    assert stopped.value.output == "spinning\n"


@pytest.mark.timeout(60)
def test_run_busy_stopped_itself_stops_its_command(monkeypatch, tmp_path):
    # As when the test's own time limit or Ctrl-C lands while it waits.
    monkeypatch.delenv(slack.VAR, raising=False)
    pid = tmp_path / "pid"
    code = f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); time.sleep(300)"

    def stop(*_):
        raise KeyboardInterrupt

    def stop_once_started(cancelled):
        # Once the command has written its pid, however long a loaded machine takes to start it.
        while not pid.exists() or not pid.read_text():
            if cancelled.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, stop)
    cancelled = threading.Event()
    stopper = threading.Thread(target=stop_once_started, args=(cancelled,), daemon=True)
    stopper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            slack.run_busy([sys.executable, "-c", code], cpu_s=600, idle_s=600)
    finally:
        cancelled.set()
        stopper.join()
        signal.signal(signal.SIGUSR1, old)
    assert _gone(int(pid.read_text()))


@pytest.mark.timeout(60)
def test_run_stops_a_command_past_its_timeout_with_what_it_started():
    # The child holds the pipes open, as a launcher's workers do; it leaves with the command.
    cmd = ["sh", "-c", "sleep 300 & echo $!; wait"]
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        slack.run(cmd, timeout=slack.guard(1))  # (long enough for sh to echo under load)
    child = int(stopped.value.output.split()[0])
    assert _gone(child)
    done = slack.run(["sh", "-c", "echo out; echo err >&2; exit 4"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")
