"""``make gpu-check``: safe without a GPU, and its parts (plan, op sweep, bandwidth, verdicts,
summary) working on the CPU, so that the one GPU run it exists for finds nothing of its own
broken. Steps here are small Python commands standing in for the build, tests and sanitizers."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(bool(gpu_check.gpu_names()), reason="a GPU is present: the check would run")
def test_make_gpu_check_without_a_gpu_says_so_and_builds_nothing(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["make", "-s", "gpu-check", f"OUT={out}", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "gpu-check: no GPU here (nvidia-smi lists none); nothing built or run"
    ]
    assert not out.exists()


def test_the_op_sweep_runs_on_cpu():
    res = subprocess.run(
        [sys.executable, "benchmarks/gpu_ops_all.py", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "all results as expected" in res.stdout


def test_the_bandwidth_table_on_cpu(tmp_path):
    out = tmp_path / "bw.json"
    md = tmp_path / "bw.md"
    cmd = [sys.executable, "benchmarks/gpu_bandwidth.py", "--device", "cpu", "--sizes", "1MB"]
    cmd += ["--iters", "2", "--json", str(out), "--markdown", str(md)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} >= {
        "copy (d2d)",
        "compress",
        "decompress",
        "sum_chunks",
        "quantize_int8",
        "dequantize_int8",
        "unpack_int8",
        "torch to(bf16).div_ + copy_",
    }
    copy = next(r for r in rows if r["op"] == "copy (d2d)")
    assert copy["ratio_to_copy"] == 1.0 and all(r["gbs"] > 0 for r in rows)
    assert "| 1MB | compress |" in md.read_text()


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


def test_the_plan_fits_each_command_in_540_s(capsys, monkeypatch):
    assert gpu_check.main(["--dry-run"]) == 0
    printed = capsys.readouterr().out
    for i, steps in enumerate(gpu_check.PARTS, 1):
        assert gpu_check.command_seconds(steps) <= gpu_check.COMMAND_LIMIT == 540
        assert f"make gpu-check OUT=gpu-check-out PART={i}" in printed
    # Every step has a part; every part builds first, so that it runs on a fresh machine too.
    assert {s for part in gpu_check.PARTS for s in part} == set(gpu_check.STEPS)
    assert all(part[0] == "build" for part in gpu_check.PARTS)
    assert re.search(r"\n  sanitizer-initcheck +120 s\n", printed)
    assert gpu_check.main(["--dry-run", "--steps", "build,bandwidth"]) == 0
    # A plan that could run past the limit is refused.
    monkeypatch.setitem(gpu_check.STEPS, "cuda-tests", 400)
    assert gpu_check.main(["--dry-run", "--part", "1"]) == 1
    assert "PART=1 may take 660 s, over 540 s" in capsys.readouterr().out


def _fake_steps(commands):
    """Stand-ins for step_commands: step -> (command, env, verdict)."""
    return lambda python, out, info: commands


def test_each_step_is_recorded_as_soon_as_it_ends(tmp_path, monkeypatch):
    out = tmp_path / "out"
    # The second step reads the summary while it runs: the first is recorded, itself running.
    probe = (
        "import json, sys; s = json.load(open(sys.argv[1])); "
        "print({x['step']: x['status'] for x in s['steps']})"
    )
    refuse = (
        "print('========= Error: Target application terminated before first instrumented API call')"
    )
    monkeypatch.setattr(gpu_check, "gpu_names", lambda: ["GPU 0: test"])
    monkeypatch.setattr(gpu_check, "versions", lambda python: {"gpu": "test"})
    monkeypatch.setattr(
        gpu_check,
        "step_commands",
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
    seen = (out / "cuda-tests.log").read_text().splitlines()[-1]
    assert seen == "{'build': 'pass', 'cuda-tests': 'running'}"
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
    # A later command into the same folder adds to the summary; its failure fails it.
    assert gpu_check.main([str(out), "--steps", "bandwidth"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]][:4] == steps.split(",")
    assert summary["steps"][-1]["status"] == "FAIL" and summary["verdict"] == "FAILED"


_DRIVER = """
import sys
sys.path.insert(0, {benchmarks!r})
import gpu_check
gpu_check.gpu_names = lambda: ["GPU 0: test"]
gpu_check.versions = lambda python: {{}}
sleeper = "import os, time; open({pid!r}, 'w').write(str(os.getpid())); time.sleep(60)"
gpu_check.step_commands = lambda python, out, info: {{
    "build": ([sys.executable, "-c", "print('built')"], None, None),
    "cuda-tests": ([sys.executable, "-c", sleeper], None, None),
}}
sys.exit(gpu_check.main([{out!r}, "--steps", "build,cuda-tests"]))
"""


def test_a_killed_command_loses_only_its_running_step(tmp_path):
    out, pid_file = tmp_path / "out", tmp_path / "step.pid"
    driver = _DRIVER.format(benchmarks=str(ROOT / "benchmarks"), pid=str(pid_file), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", driver])
    step_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        step_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)  # what a runner does to a command at its limit
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    # The step's process went with the command.
    deadline = time.monotonic() + 10
    while Path(f"/proc/{step_pid}").exists():
        state = Path(f"/proc/{step_pid}/status").read_text()
        if "\nState:\tZ" in state:
            break
        if time.monotonic() > deadline:
            os.kill(step_pid, signal.SIGKILL)
            raise AssertionError("the running step outlived its command")
        time.sleep(0.1)
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("build", "pass"),
        ("cuda-tests", "running"),
    ]
    assert summary["verdict"] == "INCOMPLETE"


@pytest.mark.skipif(bool(gpu_check.gpu_names()), reason="a GPU is present: the check would run")
def test_make_gpu_check_part_without_a_gpu_says_so(tmp_path):
    res = subprocess.run(
        ["make", "-s", "gpu-check", f"OUT={tmp_path / 'out'}", "PART=2"]
        + [f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("gpu-check: no GPU here")
    plan = subprocess.run(
        ["make", "-s", "gpu-check-plan", "PART=2", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0 and "sanitizer-racecheck" in plan.stdout, plan.stderr
