"""``make gpu-check``: safe without a GPU, and its parts (plan, op sweep, bandwidth, step cost,
the parallel CUDA test runner, verdicts, summary and archive) working on the CPU, so that the
one GPU run it exists for finds nothing of its own broken. Steps here are small Python commands
standing in for the build, tests and sanitizers."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bandwidth  # noqa: E402
import gpu_check  # noqa: E402
import gpu_cuda_tests  # noqa: E402
import gpu_ops_all  # noqa: E402
import gpu_step_cost  # noqa: E402
import gpu_step_profile  # noqa: E402
import native_trace  # noqa: E402

import fastddp  # noqa: E402
from fastddp.testing import slack  # noqa: E402


def _archived(out: Path) -> dict:
    """``name -> text`` of every file in ``out/logs.tar.gz``, by its path under ``logs/``."""
    with tarfile.open(out / gpu_check.ARCHIVE) as tar:
        return {
            m.name.removeprefix("logs/"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if m.isfile()
        }


@pytest.mark.multiproc  # runs the check in processes of its own
@pytest.mark.skipif(bool(gpu_check.gpu_names()), reason="a GPU is present: the check would run")
def test_make_gpu_check_without_a_gpu_says_so_and_builds_nothing(tmp_path):
    out = tmp_path / "out"
    res = slack.run(
        ["make", "-s", "gpu-check", f"OUT={out}", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=slack.guard(60),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "gpu-check: no GPU here (nvidia-smi lists none); nothing built or run"
    ]
    assert not out.exists()


@pytest.mark.multiproc  # runs the check in processes of its own
def test_the_op_sweep_runs_on_cpu():
    # It only computes: guarded by its CPU time, which a full machine does not stretch (its
    # wall time went from 6 s alone to over 130 s under the suite). The long length of 8 SMs,
    # not an H100's 132: 3 CPU s, not 12.
    cmd = [sys.executable, "benchmarks/gpu_ops_all.py", "--device", "cpu", "--sms", "8"]
    res = slack.run_busy(cmd, cpu_s=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "all results as expected" in res.stdout


def test_the_op_sweep_refuses_a_bad_sm_count(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_ops_all.main(["--device", "cpu", "--sms", "0"])
    assert exit_.value.code == 2 and "--sms must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.multiproc  # runs the check in processes of its own
def test_the_bandwidth_table_on_cpu(tmp_path):
    out = tmp_path / "bw.json"
    md = tmp_path / "bw.md"
    cmd = [sys.executable, "benchmarks/gpu_bandwidth.py", "--device", "cpu", "--sizes", "1MB"]
    cmd += ["--iters", "2", "--json", str(out), "--markdown", str(md)]
    res = slack.run_busy(cmd, cpu_s=120, cwd=ROOT)  # it only computes
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["copy (d2d)", *gpu_bandwidth.OPS, *gpu_bandwidth.REFERENCES]
    assert "dequantize+quantize_packed2" in gpu_bandwidth.REFERENCES
    assert {"quantize_packed4", "dequantize_packed2", "unpack_packed4"} <= set(gpu_bandwidth.OPS)
    assert set(gpu_bandwidth.TARGETS) == set(gpu_bandwidth.OPS)
    copy = next(r for r in rows if r["op"] == "copy (d2d)")
    assert copy["ratio_to_copy"] == 1.0 and all(r["gbs"] > 0 for r in rows)
    # The bucket's copy is its own copy of the same bytes; every other row is timed against one.
    assert copy["ratio_to_same_bytes"] == 1.0
    assert all(r["ratio_to_same_bytes"] > 0 for r in rows)
    pair = {r["op"]: r for r in rows if r["op"].endswith("quantize_int8")}
    assert pair["requantize_int8"]["bytes_moved"] == pair["dequantize+quantize_int8"]["bytes_moved"]
    assert "| 1MB | compress |" in md.read_text() and "vs a copy of its bytes" in md.read_text()


@pytest.mark.multiproc  # runs the script in a process of its own
def test_the_profile_driver_calls_each_op_on_cpu():
    cmd = [sys.executable, "benchmarks/gpu_kernel_profile.py", "--device", "cpu", "--size", "1MB"]
    res = slack.run_busy(cmd, cpu_s=120, cwd=ROOT)  # it only computes
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(", ".join(gpu_bandwidth.OPS))
    bad = slack.run_busy([*cmd, "--ops", "compress", "squash"], cpu_s=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown ops ['squash']" in bad.stderr


def test_verdicts_and_summary(tmp_path):
    assert gpu_check.sanitizer_verdict(0, "========= ERROR SUMMARY: 0 errors")[0] == "pass"
    bad = gpu_check.sanitizer_verdict(99, "========= ERROR SUMMARY: 3 errors")
    assert bad == ("FAIL", "ERROR SUMMARY: 3 errors")
    race = "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)"
    assert gpu_check.sanitizer_verdict(99, race) == ("FAIL", race.strip("= "))
    clean_race = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    assert gpu_check.sanitizer_verdict(0, clean_race)[0] == "pass"
    # Clean for the tool, but the op sweep itself found a wrong result.
    assert gpu_check.sanitizer_verdict(1, "========= ERROR SUMMARY: 0 errors")[0] == "FAIL"
    assert gpu_check.sanitizer_verdict(0, "no summary at all")[0] == "FAIL"
    assert gpu_check.pytest_verdict(1, "== 2 failed, 40 passed in 3.0s ==") == (
        "FAIL",
        "2 failed, 40 passed in 3.0s",
    )
    slow = gpu_check.run_step("slow", ["sleep", "5"], tmp_path, limit=0.5)
    assert slow.status == "FAIL" and "timed out" in slow.detail
    good = gpu_check.run_step("good", [sys.executable, "-c", "print(1)"], tmp_path, limit=30)
    assert good.ok and (tmp_path / "good.log").read_text().endswith("1\n")
    ok = gpu_check.write_summary(tmp_path, {"gpu": "test"}, [good, slow])
    assert not ok
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and [s["ok"] for s in summary["steps"]] == [True, False]
    assert (tmp_path / "summary.md").read_text().startswith("# gpu-check: FAILED")


@pytest.mark.parametrize(
    "output",
    [
        "========= COMPUTE-SANITIZER\n"
        "========= Error: Target application terminated before first instrumented API call\n"
        "========= Tracking kernels launched by child processes requires the --target-processes"
        " all option.",
        "========= Error: No attachable process found. compute-sanitizer timed-out.",
        "========= Internal Sanitizer Error: The Sanitizer got an error while launching",
        "========= Error: Device not supported",
        "========= Error: Debugger interface initialization failed (permission denied)",
    ],
)
def test_a_sanitizer_that_refuses_is_recorded_as_refused_not_failed(output):
    status, detail = gpu_check.sanitizer_verdict(1, output)
    first = next(line for line in output.splitlines() if "Error" in line)
    assert (status, detail) == ("refused", "refused: " + first.lstrip("= "))
    # An error found in the program outweighs any complaint.
    found = output + "\n========= ERROR SUMMARY: 1 error"
    assert gpu_check.sanitizer_verdict(99, found) == ("FAIL", "ERROR SUMMARY: 1 error")
    # The program's own failure under a working sanitizer is no refusal.
    own = (
        "========= Error: process didn't terminate successfully\n========= ERROR SUMMARY: 0 errors"
    )
    assert gpu_check.sanitizer_verdict(1, own)[0] == "FAIL"


def test_a_missing_tool_is_skipped_not_failed(tmp_path):
    step = gpu_check.run_step("sanitizer-memcheck", ["no-such-sanitizer", "--tool"], tmp_path, 30)
    assert (step.status, step.detail) == ("skipped", "skipped: no-such-sanitizer not found")
    assert step.ok and not (tmp_path / "sanitizer-memcheck.log").exists()


def test_the_plan_fits_one_command_of_480_s(capsys, monkeypatch):
    assert gpu_check.main(["--dry-run"]) == 0
    printed = capsys.readouterr().out
    label, phases = gpu_check.plan()
    assert gpu_check.command_seconds(phases) <= gpu_check.COMMAND_LIMIT == 480
    assert re.search(r"make gpu-check OUT=gpu-check-out   # at most (\d+) s of 480 s", printed)
    total = int(re.search(r"\n  total +(\d+) s\n", printed).group(1))
    assert total == gpu_check.command_seconds(phases) <= 480
    # Every step once: the build first, then the untimed steps at once, then each timed one
    # alone, so that nothing disturbs a timing.
    assert [s for phase in phases for s in phase] == list(gpu_check.STEPS)
    assert phases[0] == ("build",)
    sanitizers = {
        f"sanitizer-{tool}" for tool in ("memcheck", "racecheck", "synccheck", "initcheck")
    }
    assert set(phases[1]) == {"cuda-tests", *sanitizers}
    assert ("bandwidth",) in phases and ("step-cost",) in phases
    assert "phase 2: 5 steps at once" in printed and "sanitizer-initcheck  (260 s)" in printed
    # The parts, for a command cut short: each builds first, each fits, together every step.
    for i, part in enumerate(gpu_check.PARTS, 1):
        assert part[0] == "build"
        assert gpu_check.command_seconds(gpu_check.plan(part=i)[1]) <= 480
        assert f"make gpu-check OUT=gpu-check-out PART={i}   # " in printed
    assert {s for part in gpu_check.PARTS for s in part} == set(gpu_check.STEPS)
    assert gpu_check.main(["--dry-run", "--steps", "build,bandwidth"]) == 0
    assert gpu_check.main(["--dry-run", "--part", "2"]) == 0
    capsys.readouterr()
    # A plan that could run past the limit is refused: the whole one and the part.
    monkeypatch.setitem(gpu_check.STEPS, "sanitizer-racecheck", 300)
    assert gpu_check.main(["--dry-run"]) == 1
    printed = capsys.readouterr().out
    assert "the plan may take 515 s, over 480 s" in printed
    assert "PART=2 may take 435 s" not in printed  # 35 + 90 + 300 + 10 fits
    monkeypatch.setitem(gpu_check.STEPS, "build", 200)
    assert gpu_check.main(["--dry-run", "--part", "2"]) == 1
    assert "PART=2 may take 545 s, over 480 s" in capsys.readouterr().out


@pytest.mark.multiproc  # runs the check in processes of its own
def test_make_gpu_check_plan_passes():
    res = slack.run(
        ["make", "-s", "gpu-check-plan", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=slack.guard(60),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "of 480 s" in res.stdout and "over 480 s" not in res.stdout


def _fake_steps(commands):
    """Stand-ins for step_commands: step -> (command, env, verdict)."""
    return lambda python, logs, info: commands


def _on_a_fake_gpu(monkeypatch, commands):
    monkeypatch.setattr(gpu_check, "gpu_names", lambda: ["GPU 0: test"])
    monkeypatch.setattr(gpu_check, "versions", lambda python: {"gpu": "test"})
    monkeypatch.setattr(gpu_check, "step_commands", commands)


def test_each_step_is_recorded_as_soon_as_it_ends(tmp_path, monkeypatch):
    out = tmp_path / "out"
    # The second step reads the summary while it runs: the first is recorded, itself running.
    probe = (
        "import json, sys; s = json.load(open(sys.argv[1])); "
        "seen = {x['step']: x['status'] for x in s['steps']}; "
        "print(seen['build'], seen['cuda-tests'])"
    )
    refuse = (
        "print('========= Error: Target application terminated before first instrumented API call')"
    )
    _on_a_fake_gpu(
        monkeypatch,
        _fake_steps(
            {
                "build": ([sys.executable, "-c", "print('built')"], None, None),
                "cuda-tests": (
                    [sys.executable, "-c", probe, str(out / "summary.json")],
                    None,
                    None,
                ),
                "sanitizer-memcheck": (["no-such-sanitizer"], None, gpu_check.sanitizer_verdict),
                "sanitizer-racecheck": (
                    [sys.executable, "-c", refuse],
                    None,
                    gpu_check.sanitizer_verdict,
                ),
                "bandwidth": ([sys.executable, "-c", "raise SystemExit(3)"], None, None),
            }
        ),
    )
    steps = "build,cuda-tests,sanitizer-memcheck,sanitizer-racecheck"
    assert gpu_check.main([str(out), "--steps", steps]) == 0
    logs = _archived(out)
    assert logs["cuda-tests.log"].splitlines()[-1] == "pass running"
    assert logs["build.log"].endswith("built\n")
    summary = json.loads((out / "summary.json").read_text())
    assert {s["step"]: s["status"] for s in summary["steps"]} == {
        "build": "pass",
        "cuda-tests": "pass",
        "sanitizer-memcheck": "skipped",
        "sanitizer-racecheck": "refused",
    }
    details = {s["step"]: s["detail"] for s in summary["steps"]}
    assert details["sanitizer-memcheck"] == "skipped: no-such-sanitizer not found"
    assert details["sanitizer-racecheck"] == (
        "refused: Error: Target application terminated before first instrumented API call"
    )
    # The other parts have not run: not a pass yet.
    assert summary["verdict"] == "INCOMPLETE" and "bandwidth" in summary["not_run"]
    md = (out / "summary.md").read_text()
    assert md.startswith("# gpu-check: INCOMPLETE (1 skipped, 1 refused)")
    # A later command into the same folder adds to the summary and to the archive; its
    # failure fails it.
    assert gpu_check.main([str(out), "--steps", "bandwidth"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]][:4] == steps.split(",")
    assert summary["steps"][-1]["status"] == "FAIL" and summary["verdict"] == "FAILED"
    assert {"build.log", "cuda-tests.log", "bandwidth.log"} <= set(_archived(out))
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]


# A step that notes when it started and ended, sleeping between, and writes what it is given.
# A step: it marks its start, waits (up to 30 s, scaled) until the steps named in PEERS have
# started too, which they can only do if they run at the same time, then sleeps SECONDS and
# records its start, its end and whether it met them.
_TIMED = """
import os, sys, time
name, folder, seconds, peers = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
start = time.time()
open(f"{folder}/{name}.started", "w").close()
deadline = time.monotonic() + 30 * float(os.environ.get("FASTDDP_TEST_SLACK", 1))
met = lambda: all(os.path.exists(f"{folder}/{p}.started") for p in peers.split(",") if p)
while not met() and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(seconds)
open(f"{folder}/{name}.times", "w").write(f"{start} {time.time()} {int(met())}")
for path, text in zip(sys.argv[5::2], sys.argv[6::2]):
    open(path, "w").write(text)
"""


def _table(op_or_variant, ratio, meets):
    row = {"op": op_or_variant, "ratio": ratio, "target": 1.0, "meets_target": meets}
    return json.dumps({"rows": [row]})


def test_the_whole_plan_in_one_command_untimed_steps_at_once(tmp_path, monkeypatch):
    out, times = tmp_path / "out", tmp_path / "times"
    times.mkdir()

    def commands(python, logs, info):
        def timed(name, seconds, *files):
            peers = next(",".join(phase) for phase in gpu_check.PHASES if name in phase)
            cmd = [sys.executable, "-c", _TIMED, name, str(times), str(seconds), peers, *files]
            return (cmd, None, None)

        def table_step(name, row, table, verdict):
            # A timed step that writes its table as markdown and JSON, judged by the JSON.
            cmd = timed(name, 0.2, logs / f"{name}.md", row)[0]
            cmd += [str(logs / f"{name}.json"), table]
            return (cmd, None, gpu_check.table_verdict(logs / f"{name}.json", verdict))

        steps = {name: timed(name, 0.2) for name in gpu_check.STEPS}
        steps["bandwidth"] = table_step(
            "bandwidth", "| 1MB | compress | 0.9 |\n", _table("compress", 0.9, True), "targets met"
        )
        steps["step-cost"] = table_step(
            "step-cost",
            "| fastddp bf16 | 1.2 | MISSED |\n",
            _table("fastddp bf16", 1.2, False),
            "hooks within 1.03x",
        )
        (logs / "cuda-tests").mkdir()
        (logs / "cuda-tests" / "01-test_x.log").write_text("1 passed in 0.1s\n")
        return steps

    _on_a_fake_gpu(monkeypatch, commands)
    started = time.monotonic()
    assert gpu_check.main([str(out)]) == 0
    # The build, then the tests and the four sanitizers together, then the timings one by one;
    # nothing waited for a step's limit (the shortest is 45 s).
    assert time.monotonic() - started < min(gpu_check.STEPS.values())
    span = {
        name: tuple(map(float, (times / f"{name}.times").read_text().split()))
        for name in gpu_check.STEPS
    }
    phase2 = [span[n] for n in gpu_check.PHASES[1]]
    assert all(met for _, _, met in phase2)  # each saw every other start: all ran at once
    assert span["build"][1] <= min(s for s, _, _ in phase2)
    assert max(e for _, e, _ in phase2) <= span["bandwidth"][0]  # the timings alone
    assert span["bandwidth"][1] <= span["step-cost"][0]
    # At most 8 files: the summary twice and one archive of every log and table.
    files = sorted(p.name for p in out.iterdir())
    assert files == ["logs.tar.gz", "summary.json", "summary.md"]
    assert len(files) <= gpu_check.MAX_FILES
    logs = _archived(out)
    assert {f"{n}.log" for n in gpu_check.STEPS} <= set(logs)
    assert {"cuda-tests/01-test_x.log", "bandwidth.json", "step-cost.md"} <= set(logs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASSED" and summary["not_run"] == []
    details = {s["step"]: s["detail"] for s in summary["steps"]}
    assert details["bandwidth"] == "exit 0; 1 of 1 targets met"
    assert details["step-cost"] == "exit 0; 0 of 1 hooks within 1.03x"
    assert summary["tables"]["step-cost"][0]["ratio"] == 1.2
    md = (out / "summary.md").read_text()
    assert "## Bandwidth\n\n| 1MB | compress | 0.9 |" in md
    assert "## Step cost\n\n| fastddp bf16 | 1.2 | MISSED |" in md


@pytest.mark.multiproc  # runs the check in processes of its own
def test_a_step_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    # The step's own child (like pytest's ranks) goes with it.
    child_pid = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    # A limit the step outlives, with room to start its child first on a loaded machine (a
    # 3 s limit once ran out before it had).
    limit = round(slack.guard(10))
    step = gpu_check.run_step("slow", [sys.executable, "-c", script], tmp_path, limit=limit)
    assert (step.status, step.detail) == ("FAIL", f"timed out after {limit} s")
    assert child_pid.exists(), "the step was stopped before it started its child"
    _gone(int(child_pid.read_text()))


def _gone(pid, seconds=10):
    deadline = time.monotonic() + slack.guard(seconds)
    while Path(f"/proc/{pid}").exists():
        if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"process {pid} outlived its step")
        time.sleep(0.1)


_DRIVER = """
import sys
sys.path.insert(0, {benchmarks!r})
import gpu_check
gpu_check.gpu_names = lambda: ["GPU 0: test"]
import os, time
tempfile = __import__("tempfile")
tempfile.tempdir = {tmp!r}  # the logs' folder, where the test can see it go
sleeper = "import os, time; open({pid!r}, 'w').write(str(os.getpid())); time.sleep(60)"
def probing(python):  # the probes of the GPU and the tools, stopped in the middle
    open({pid!r}, 'w').write(str(os.getpid()))
    time.sleep(60)
gpu_check.versions = probing if {in_probes!r} else lambda python: {{}}
gpu_check.step_commands = lambda python, logs, info: {{
    "build": ([sys.executable, "-c", "print('built')"], None, None),
    "cuda-tests": ([sys.executable, "-c", sleeper], None, None),
}}
sys.exit(gpu_check.main([{out!r}, "--steps", "build,cuda-tests"]))
"""


def _stopped_once_started(tmp_path, in_probes: bool):
    """Run the check of _DRIVER; SIGTERM it once its step (or its probes) has started, as a
    runner does to a command at its limit. Returns the output folder and the stopped pid."""
    out, pid_file = tmp_path / "out", tmp_path / "started.pid"
    driver = _DRIVER.format(
        benchmarks=str(ROOT / "benchmarks"), pid=str(pid_file), out=str(out),
        tmp=str(tmp_path), in_probes=in_probes,
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", driver])
    try:
        deadline = time.monotonic() + slack.guard(60)
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=slack.guard(30)) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, int(pid_file.read_text())


@pytest.mark.multiproc  # runs the check in processes of its own
def test_a_killed_command_loses_only_its_running_step(tmp_path):
    out, step_pid = _stopped_once_started(tmp_path, in_probes=False)
    _gone(step_pid)  # the step's process went with the command
    assert "built" in _archived(out)["build.log"]
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("build", "pass"),
        ("cuda-tests", "stopped"),
    ]
    assert summary["steps"][1]["detail"].startswith("stopped after ")
    assert "the check itself was stopped" in _archived(out)["cuda-tests.log"]
    assert summary["verdict"] == "INCOMPLETE"
    assert not list(tmp_path.glob("gpu-check-logs-*"))


@pytest.mark.multiproc  # runs the check in processes of its own
def test_a_command_stopped_in_its_probes_leaves_a_summary_and_no_logs_folder(tmp_path):
    out, _ = _stopped_once_started(tmp_path, in_probes=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "INCOMPLETE" and summary["steps"] == []
    assert summary["not_run"] == list(gpu_check.STEPS)
    assert not list(tmp_path.glob("gpu-check-logs-*"))


@pytest.mark.multiproc  # runs the check in processes of its own
@pytest.mark.skipif(bool(gpu_check.gpu_names()), reason="a GPU is present: the check would run")
def test_make_gpu_check_part_without_a_gpu_says_so(tmp_path):
    res = slack.run(
        ["make", "-s", "gpu-check", f"OUT={tmp_path / 'out'}", "PART=2"]
        + [f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=slack.guard(60),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("gpu-check: no GPU here")
    plan = slack.run(
        ["make", "-s", "gpu-check-plan", "PART=2", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=slack.guard(60),
    )
    assert plan.returncode == 0 and "sanitizer-racecheck" in plan.stdout, plan.stderr


_FAKE_TESTS = {
    "pytest.ini": "[pytest]\nmarkers =\n    cuda: x\n    multiproc: y\n",
    "test_ops_like.py": """
import pytest
pytestmark = pytest.mark.cuda
@pytest.mark.parametrize("i", range(5))
def test_value(i):
    assert i != 3
def test_skipped():
    pytest.skip("no device")
""",
    "test_ranks_like.py": """
import os, sys, time, pytest
pytestmark = [pytest.mark.cuda, pytest.mark.multiproc]
def test_one():
    pass
def test_two():
    pass
def test_hangs():
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["HANG_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
""",
    "test_not_cuda.py": "def test_plain():\n    pass\n",
    # A process that dies before pytest can report (as a segfault in an extension does).
    "test_crashes.py": """
import ctypes, pytest
pytestmark = pytest.mark.cuda
def test_reads_address_zero():
    ctypes.string_at(0)
""",
}


def _fake_test_tree(tmp_path) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name, text in _FAKE_TESTS.items():
        (tree / name).write_text(text)
    return tree


def test_cuda_tests_are_split_by_file_and_multiproc_files_further():
    items = [(f"/t/a.py::t{i}", "/t/a.py", False) for i in range(5)]
    items += [(f"/t/b.py::r{i}", "/t/b.py", True) for i in range(7)]
    shards = gpu_cuda_tests.split(items, tests_per_process=3, multiproc_per_process=3)
    # As few processes as the counts allow, evenly filled (7 by 3: 3, 2, 2, not 3, 3, 1),
    # the longest expected first.
    assert [len(s.tests) for s in shards] == [3, 2, 2, 3, 2]
    assert [s.name for s in shards][:3] == ["01-b", "02-b", "03-b"]
    assert sum((s.tests for s in shards), []) == [i[0] for i in items[5:]] + [
        i[0] for i in items[:5]
    ]


@pytest.mark.parametrize(
    "rc, log, outcome, crash",
    [
        (-9, "..", "FAIL (exit -9: killed by SIGKILL)", "killed by SIGKILL"),
        (
            4,
            "ERROR: not found: /t/a.py::t[1]\n",
            "FAIL (exit 4: ERROR: not found: /t/a.py::t[1])",
            "",
        ),
        (1, ".F\n1 failed, 1 passed in 0.1s\n", "FAIL (exit 1)", ""),
    ],
    ids=["killed", "not-found", "failed"],
)
def test_a_process_without_counts_is_told_apart_from_a_crash(tmp_path, rc, log, outcome, crash):
    # A process killed (the OOM killer's SIGKILL writes no fatal line) is a crash; pytest
    # ending without counts (a test it could not find) is not, and says why.
    shard = gpu_cuda_tests.Shard(0, "/t/a.py", ["/t/a.py::t[1]"], False, 1.0, name="01-a")
    (tmp_path / "01-a.log").write_text(log)
    shard.rc, shard.started = rc, time.monotonic()
    gpu_cuda_tests.finish(shard, tmp_path)
    assert (shard.outcome, shard.crash) == (outcome, crash)
    assert bool(shard.failures) == (rc != 1)  # (the failed test's own line: none in this log)


# The frames of the H200's crash (run 8), as the tracer printed them under pytest: the
# handler, the C library's trampolines and raise, Python's faulthandler, then the fault.
_H200_FRAMES = """Fatal Python error: Segmentation fault
fastddp-native-trace: signal 11, 40 frames
fastddp-native-frame 0 /tmp/fastddp-trace-x/native_trace.so +0x1237 ?
fastddp-native-frame 1 /lib/x86_64-linux-gnu/libc.so.6 +0x45330 ?
fastddp-native-frame 2 /lib/x86_64-linux-gnu/libc.so.6 +0x9eb2c pthread_kill
fastddp-native-frame 3 python3 +0x2c1a2e ?
fastddp-native-frame 4 /lib/x86_64-linux-gnu/libc.so.6 +0x45330 ?
fastddp-native-frame 5 /w/_C.cpython-312-x86_64-linux-gnu.so +0x1de601 _ZNSo9_M_insertIlEERSoT_
fastddp-native-frame 6 /w/_C.cpython-312-x86_64-linux-gnu.so +0xd5626 ?
fastddp-native-frame 7 /opt/torch/lib/libtorch_cpu.so +0x66fbc8c ?
"""


def test_a_crash_names_its_innermost_native_frames():
    assert native_trace.frames(_H200_FRAMES)[0][:2] == (
        "/w/_C.cpython-312-x86_64-linux-gnu.so",
        0x1DE601,
    )
    told = native_trace.describe(_H200_FRAMES)
    so = "_C.cpython-312-x86_64-linux-gnu.so"
    assert told.startswith(f"native: {so} near ") and told.endswith(f" < {so} near +0xd5626")
    # demangled (c++filt's spelling varies) where c++filt is at hand
    name = "_M_insert<long>(long)" if shutil.which("c++filt") else "_ZNSo9_M_insertIlEERSoT_"
    assert name in told, told
    assert native_trace.describe("Fatal Python error: Segmentation fault\n") == ""
    text = gpu_cuda_tests._crash(_H200_FRAMES + '  File "/t/a.py", line 3 in test_x\n', -11)
    assert text == f"Segmentation fault in test_x; {told}"


@pytest.mark.multiproc  # runs the check in processes of its own
def test_cuda_tests_run_at_once_each_within_its_limit(tmp_path):
    tree, logs, pids = _fake_test_tree(tmp_path), tmp_path / "logs", tmp_path / "hang.pids"
    cmd = [sys.executable, "benchmarks/gpu_cuda_tests.py", str(tree), "--logs", str(logs)]
    # 20 s (scaled): a trivial pytest process must finish within it on a loaded machine, and
    # the hang (600 s) must be cut well before its end.
    limit = f"{slack.guard(20):.0f}"
    cmd += ["--process-limit", limit, "--tests-per-process", "3", "--multiproc-per-process", "1"]
    started = time.monotonic()
    res = slack.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(120),
        env=dict(os.environ, HANG_PIDS=str(pids)),
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "cuda-tests: 10 tests collected" in res.stdout and "6 processes" in res.stdout
    last = lines[-1]
    assert last.startswith("cuda-tests: 10 tests in 6 processes: ")
    assert "6 passed" in last and "1 failed" in last and "1 skipped" in last
    assert "did not finish: 03-test_ranks_like" in last  # test_hangs, cut at the limit
    assert any(line.startswith("FAILED ") and "test_value[3]" in line for line in lines)
    # The crash is named, with the test it was in and its innermost native frame outside the
    # C library (ctypes' module), and its test counted as not reported.
    assert "cuda-tests: native frames of a crash: on" in lines, lines
    assert "2 not reported" in last, last
    crashed = "Segmentation fault in test_reads_address_zero; native: _ctypes"
    assert f"crashed: 06-test_crashes ({crashed}" in last, last
    assert any(line.startswith("CRASHED 06-test_crashes") for line in lines), lines
    # Not one after another, not to the end of the hang.
    assert time.monotonic() - started < slack.guard(60)
    # The hung process went, with what it started.
    for pid in map(int, pids.read_text().split()):
        _gone(pid)
    names = sorted(p.name for p in logs.iterdir())
    assert "03-test_ranks_like.log" in names and "01-test_ranks_like.xml" in names
    assert gpu_check.tests_verdict(res.returncode, res.stdout) == ("FAIL", last[12:])


@pytest.mark.multiproc  # runs the check in processes of its own
def test_stopping_the_cuda_tests_stops_their_processes(tmp_path):
    tree, pids = _fake_test_tree(tmp_path), tmp_path / "hang.pids"
    cmd = [sys.executable, "benchmarks/gpu_cuda_tests.py", str(tree), "--logs"]
    cmd += [str(tmp_path / "logs")]
    step = gpu_check.Running(
        "cuda-tests", cmd, tmp_path, 60, env=dict(os.environ, HANG_PIDS=str(pids))
    )
    try:
        deadline = time.monotonic() + slack.guard(60)
        while not pids.exists() or len(pids.read_text().split()) < 2:
            assert time.monotonic() < deadline and step.proc.poll() is None
            time.sleep(0.1)
    finally:
        step.stop()  # as gpu_check does at a step's limit or when it is stopped itself
    for pid in map(int, pids.read_text().split()):
        _gone(pid)


@pytest.mark.multiproc  # runs the check in processes of its own
def test_the_cuda_tests_plan_on_the_real_tests():
    res = slack.run_busy(  # it only collects the suite's tests
        [sys.executable, "benchmarks/gpu_cuda_tests.py", "--dry-run", "--jobs", "16"],
        cpu_s=240,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    line = r"^(\d+)-(\w+): (\d+) tests, about (\d+) s beside the others$"
    shards = re.findall(line, res.stdout, re.M)
    files = {name for _, name, _, _ in shards}
    assert {"test_hooks_cuda", "test_packed_ops", "test_ops", "test_accum_ops"} <= files
    # The files of spawned ranks are cut into processes of a few tests each.
    assert all(int(n) <= 3 for _, name, n, _ in shards if name == "test_hooks_cuda")
    # No process expected to run longer than half the step's limit.
    assert max(int(s) for *_, s in shards) <= gpu_check.STEPS["cuda-tests"] / 2


@pytest.mark.multiproc  # runs the check in processes of its own
def test_the_step_cost_table_on_cpu(tmp_path):
    out, md = tmp_path / "step.json", tmp_path / "step.md"
    cmd = [sys.executable, "benchmarks/gpu_step_cost.py", "--device", "cpu", "--steps", "1"]
    cmd += ["--warmup", "1", "--min-rounds", "6", "--rounds", "6", "--json", str(out)]
    cmd += ["--markdown", str(md)]
    res = slack.run_busy(cmd, cpu_s=240, cwd=ROOT)  # one rank on this machine: it computes
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["rows"]
    got = [(r["variant"], r["registration"]) for r in rows]
    assert got[:2] == [
        ("plain DDP", "none"),
        ("torch fp16_compress_hook", "ddp.register_comm_hook"),
    ]
    assert got[2:] == [
        (f"fastddp {p}", how)
        for p in fastddp.PRESETS
        for how in ("ddp.register_comm_hook", "fastddp.register_comm_hook")
    ]
    assert rows[0]["ratio"] == 1.0 and rows[0]["meets_target"] is None
    assert all(r["rounds"] == 6 and r["finite_grads"] and r["ms_per_step"] > 0 for r in rows)
    # Plain DDP's runs sit between the hooked ones: the inner ones measure the noise.
    assert rows[0]["noise"]["runs"] == 6 * (len(rows) - 2)
    assert rows[0]["noise"]["low"] <= rows[0]["noise"]["median"] <= rows[0]["noise"]["high"]
    for r in rows[1:]:
        # 6 rounds: the whole range of the ratios, at 1 - 2/64 coverage, decides.
        assert r["target"] == 1.03 and r["coverage"] == 1 - 2 / 64
        assert r["ratio_low"] <= r["ratio"] <= r["ratio_high"], r
        want = "met" if r["ratio_high"] <= 1.03 else "missed" if r["ratio_low"] > 1.03 else None
        assert r["verdict"] == (want or "undecided"), r
        assert r["meets_target"] == {"met": True, "missed": False}.get(r["verdict"]), r
    assert "| fastddp int2-ef | fastddp.register_comm_hook |" in md.read_text()


def test_a_table_step_counts_the_targets_met_and_the_undecided(tmp_path):
    rows = [
        {"variant": "plain DDP", "target": None, "meets_target": None, "verdict": None},
        {"variant": "a", "target": 1.03, "meets_target": True, "verdict": "met"},
        {"variant": "b", "target": 1.03, "meets_target": None, "verdict": "undecided"},
        {"variant": "c", "target": 1.03, "meets_target": False, "verdict": "missed"},
    ]
    table = tmp_path / "step-cost.json"
    table.write_text(json.dumps({"rows": rows}))
    verdict = gpu_check.table_verdict(table, "hooks within 1.03x")
    assert verdict(0, "") == ("pass", "exit 0; 1 of 3 hooks within 1.03x, 1 undecided")
    assert verdict(1, "")[0] == "FAIL"
    table.write_text(json.dumps({"rows": rows[:2]}))
    assert verdict(0, "") == ("pass", "exit 0; 1 of 1 hooks within 1.03x")
    missing = gpu_check.table_verdict(tmp_path / "none.json", "hooks within 1.03x")
    assert missing(3, "") == ("FAIL", "exit 3, no table")


def test_the_interval_of_a_median_from_order_statistics():
    low, high, coverage = gpu_step_cost.median_interval([5, 1, 4, 2, 3, 6])
    assert (low, high, coverage) == (1, 6, 1 - 2 / 64)  # 6 values: the range, 96.9%
    ten = [float(x) for x in range(10, 0, -1)]
    # 10 values: the second from each end (97.9%); the third would cover 89%.
    assert gpu_step_cost.median_interval(ten) == (2.0, 9.0, 1 - 2 * (1 + 10) / 1024)
    assert gpu_step_cost.median_interval([1.0, 2.0, 3.0]) == (1.0, 3.0, 0.75)  # too few
    low, high, coverage = gpu_step_cost.median_interval([])
    assert math.isnan(low) and math.isnan(high) and coverage == 0.0


@pytest.mark.multiproc  # runs the profile in a process of its own
def test_the_step_profile_on_cpu(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "benchmarks/gpu_step_profile.py", "--device", "cpu", "--steps", "2"]
    cmd += ["--rounds", "1", "--json", str(out)]
    res = slack.run_busy(cmd, cpu_s=240, cwd=ROOT)  # one rank on this machine: it computes
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["models"]["cpu"]["rows"]
    assert [(r["variant"], r["registration"]) for r in rows][:3] == [
        ("plain DDP", "none"),
        ("torch fp16_compress_hook", "ddp.register_comm_hook"),
        ("fastddp bf16", "ddp.register_comm_hook"),
    ]
    assert rows[0]["ratio"] == 1.0 and rows[0]["host_over_plain"] == []
    # No GPU: no kernels and no runtime calls; the hooks' own ops are what they add on the host.
    assert all(r["kernels_per_step"] == 0 and r["gpu_busy_ms"] == 0 for r in rows)
    assert set(rows[0]["runtime_calls_per_step"]) == set(gpu_step_profile.RUNTIME)
    # The hooks' own ops, counted (their times rank among the noise of a loaded machine).
    assert rows[0]["calls_over_plain"] == {}
    assert {"fastddp::compress", "fastddp::decompress"} <= set(rows[2]["calls_over_plain"])
    assert "fastddp::quantize_int8" in rows[4]["calls_over_plain"]
    assert len(rows[2]["host_over_plain"]) == gpu_step_profile.TOP
    assert "| fastddp int8-ef | fastddp.register_comm_hook |" in res.stdout


@pytest.mark.parametrize("filters", [True, False], ids=["with-filters", "python-3.11.2"])
def test_an_earlier_archive_is_read_back_without_leaving_its_folder(tmp_path, monkeypatch, filters):
    if not filters:  # as on Python before 3.11.4, which has no extraction filters
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no extraction filters")
    out, src = tmp_path / "out", tmp_path / "src"
    (src / "logs").mkdir(parents=True)
    (src / "logs" / "build.log").write_text("built\n")
    (src / "escape").write_text("outside")
    out.mkdir()
    with tarfile.open(out / gpu_check.ARCHIVE, "w:gz") as tar:
        tar.add(src / "logs", arcname="logs")
        tar.add(src / "escape", arcname="logs/../../escape")
        link = tarfile.TarInfo("logs/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    logs = gpu_check.open_logs(out)
    try:
        assert (logs / "build.log").read_text() == "built\n"
        assert not (logs / "link").exists() and not (logs.parent / "escape").exists()
    finally:
        shutil.rmtree(logs)
