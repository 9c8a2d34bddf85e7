"""``tests/streams.py``, the runner of ``make test``: its streams split the suite, and a stream
that fails fails the command."""

import ast
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from fastddp.testing import slack
from tests import streams

RUNNER = Path(streams.__file__)


def _env(tmp_path: Path) -> dict:
    # A failed run keeps its logs' folder for the reader: here, in the test's own folder.
    return {**os.environ, "TMPDIR": str(tmp_path)}


def test_the_streams_run_every_test_exactly_once():
    # Whatever markers a test has, exactly one stream's expression selects it.
    names = ["emu", "planted", "netns", "faults", "launcher", "multiproc", "cuda", "nccl_sim"]
    exprs = {name: Expression.compile(marks) for name, (marks, _, _) in streams.STREAMS.items()}
    for k in range(len(names) + 1):
        for marks in itertools.combinations(names, k):
            has = frozenset(marks).__contains__
            chosen = [n for n, e in exprs.items() if e.evaluate(lambda m, has=has, **_: has(m))]
            assert len(chosen) == 1, (marks, chosen)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_failing_stream_fails_the_command_and_shows_its_output(tmp_path):
    tests = tmp_path / "test_some.py"
    bad = "def test_bad():\n    raise AssertionError('the planted failure')\n"
    tests.write_text("def test_good():\n    pass\n\n" + bad)
    run = [sys.executable, str(RUNNER), "--only", "single", "emu", "--", str(tests), "-q"]
    res = subprocess.run(
        run, capture_output=True, text=True, timeout=slack.guard(100), env=_env(tmp_path)
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "test_bad" in res.stdout and "the planted failure" in res.stdout, res.stdout
    assert "failed streams: single" in res.stdout, res.stdout
    # The emu stream found nothing to run in this file: not a failure.
    tests.write_text("def test_good():\n    pass\n")
    res = subprocess.run(
        run, capture_output=True, text=True, timeout=slack.guard(100), env=_env(tmp_path)
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "single exit 0" in res.stdout and "emu exit 5" in res.stdout, res.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_streams_run_niced_and_an_also_command_counts_as_a_stream(tmp_path):
    # Niceness adds to the caller's: this test may itself run in a niced stream.
    single, also = (min(19, os.nice(0) + n) for n in (streams.NICE["single"], streams.ALSO_NICE))
    tests = tmp_path / "test_nice.py"
    # Each stream is a session, so an autogroup, of its own, at the stream's niceness.
    check = f"import os\n\ndef test_nice():\n    assert os.nice(0) == {single}\n"
    check += f"    assert os.getsid(0) == os.getpid() != {os.getsid(0)}\n"
    tests.write_text(check)
    group = "; cat /proc/self/autogroup" if os.path.exists("/proc/self/autogroup") else ""
    command = f"{sys.executable} -c 'import os; print(\"the command at\", os.nice(0))'"
    command += f"{group}; exit 5"
    run = [sys.executable, str(RUNNER), "--only", "single", "--also", "exit5", command]
    res = subprocess.run(
        [*run, "--also", "nodes", "true"], capture_output=True, text=True, env=_env(tmp_path)
    )
    assert res.returncode == 2 and "give each command a name of its own" in res.stderr, res.stderr
    assert not list(tmp_path.glob("fastddp-tests-*")), "a refused command started streams"
    res = subprocess.run(
        [*run, "--", str(tests), "-q"], capture_output=True, text=True, timeout=slack.guard(100),
        env=_env(tmp_path),
    )  # fmt: skip
    assert "single exit 0" in res.stdout, res.stdout + res.stderr
    # Exit 5 is pytest's "nothing collected", which passes a stream, but fails a command.
    assert res.returncode == 1 and "failed streams: exit5" in res.stdout, res.stdout
    assert f"the command at {also}" in res.stdout, res.stdout
    if group:
        assert re.search(rf"/autogroup-\d+ nice {streams.ALSO_NICE}\n", res.stdout), res.stdout


def _waits_for(seen: Path, then: Path) -> str:
    """A command that waits for ``seen`` to appear (for a minute at most), then copies it."""
    return f"for i in $(seq 600); do [ -e {seen} ] && break; sleep 0.1; done; cp {seen} {then}"


def _mark(seen: Path) -> str:
    """A command that writes ``seen`` whole: renamed into place, for ``echo x > seen`` makes
    the file before it writes, and a waiter could copy it empty (it once did, under load)."""
    return f"echo x > {seen}.tmp && mv {seen}.tmp {seen}"


def _with(tmp_path, run: list, step: str, command: str, tests: Path):
    return subprocess.run(
        [*run, f"--{step}", command, "--", str(tests), "-q"], capture_output=True, text=True,
        timeout=slack.guard(100), env=_env(tmp_path),
    )  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_first_command_runs_beside_the_also_commands_and_before_the_tests(tmp_path):
    seen, built = tmp_path / "seen", tmp_path / "built"
    tests = tmp_path / "test_first.py"
    tests.write_text(f"def test_after_first():\n    assert open({str(built)!r}).read() == 'x\\n'\n")
    # The first command ends only once the --also command has run: they run side by side.
    run = [sys.executable, str(RUNNER), "--only", "single", "--also", "mark", _mark(seen)]
    res = _with(tmp_path, run, "first", _waits_for(seen, built), tests)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout and "first exit 0" in res.stdout, res.stdout
    # A first command that fails fails the command, and no test runs.
    built.unlink()
    res = _with(tmp_path, run, "first", "exit 3", tests)
    assert res.returncode == 1 and "'exit 3'; no test was run" in res.stdout, res.stdout
    assert "test_after_first" not in res.stdout, res.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_setup_runs_first_with_the_early_commands_beside_it_and_python_runs_the_tests(tmp_path):
    seen, installed, after = tmp_path / "seen", tmp_path / "installed", tmp_path / "after"
    tests = tmp_path / "test_setup.py"
    tests.write_text(f"def test_after_setup():\n    assert open({str(after)!r}).read() == 'x\\n'\n")
    # The tests' Python, a wrapper that leaves a line for each process it starts.
    python, started = tmp_path / "python", tmp_path / "started"
    python.write_text(f'#!/bin/sh\necho $$ >> {started}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    # The setup ends only once the --early command has run; the --also command starts after it.
    run = [sys.executable, str(RUNNER), "--only", "single", "--python", str(python)]
    run += ["--early", "mark", _mark(seen), "--also", "after", f"cp {installed} {after}"]
    # An --early command named as a step or as another command is refused before anything runs.
    for clash in (["--early", "setup", "true"], ["--early", "after", "true"]):
        res = subprocess.run([*run, *clash], capture_output=True, text=True, env=_env(tmp_path))
        assert res.returncode == 2 and "a name of its own, none of" in res.stderr, res.stderr
    assert not list(tmp_path.glob("fastddp-tests-*")), "a refused command started streams"
    res = _with(tmp_path, run, "setup", _waits_for(seen, installed), tests)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout and "setup exit 0" in res.stdout, res.stdout
    assert "mark exit 0" in res.stdout and "after exit 0" in res.stdout, res.stdout
    assert started.read_text().strip(), "the single stream did not run on --python"
    # A setup that fails fails the command: no --also command starts, and no test runs.
    after.unlink()
    res = _with(tmp_path, run, "setup", "exit 4", tests)
    assert res.returncode == 1 and "'exit 4'; no test was run" in res.stdout, res.stdout
    assert "test_after_setup" not in res.stdout and not after.exists(), res.stdout


def _marks(node: ast.AST) -> set[str]:
    """The ``pytest.mark.NAME`` names used anywhere in ``node``."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
    }  # fmt: skip


def _launches(node: ast.AST) -> bool:
    """Whether ``node`` builds a command line ``..., "-m", "fastddp.launch"`` (or torchrun's)."""
    for n in ast.walk(node):
        if isinstance(n, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
            if any(a == "-m" and b in ("fastddp.launch", "torch.distributed.run")
                   for a, b in zip(words, words[1:])):  # fmt: skip
                return True
    return False


def test_a_test_that_starts_a_launcher_is_marked_so():
    # The launcher streams hold the jobs that start launchers; a test elsewhere would run them
    # in the ranks or single stream. By its own code or a helper of its module it calls.
    root = RUNNER.parents[1]
    unmarked = []
    for path in sorted([*root.glob("tests/**/test_*.py"), *root.glob("benchmarks/test_*.py")]):
        tree = ast.parse(path.read_text())
        module = set().union(*(
            _marks(n) for n in tree.body if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        ))  # fmt: skip
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, fn in defs.items():
            if not name.startswith("test_"):
                continue
            called = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Name) and n.func.id in defs}  # fmt: skip
            marks = module | set().union(*(_marks(d) for d in fn.decorator_list))
            launches = any(_launches(defs[f]) for f in {name, *called})
            if launches and not marks & {"launcher", "netns"}:
                unmarked.append(f"{path.relative_to(root)}::{name}")
    assert not unmarked, f"start fastddp.launch or torchrun without the launcher marker: {unmarked}"


_BUSY_AND_IDLE = """import subprocess, sys, time

def test_busy_child():
    burn = "import time\\nwhile time.process_time() < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)

def test_idle():
    time.sleep(0.5)
"""


@pytest.mark.timeout(60)
def test_the_cpu_report_counts_what_a_test_waited_for(pytester):
    # A test's CPU time takes in the processes it waited for; a test that sleeps costs none.
    pytester.makepyfile(test_cpu=_BUSY_AND_IDLE)
    plugin = ["-p", "fastddp.testing.cpu_report", "-p", "no:cacheprovider"]
    run = pytester.runpytest_inprocess(*plugin)
    run.assert_outcomes(passed=2)
    text = run.stdout.str()
    listed = text.split("costliest 2 tests by CPU time")[1].splitlines()[1:3]
    costs = [(float(line.split()[0]), line.split()[-1]) for line in listed]
    assert costs[0][1] == "test_cpu.py::test_busy_child" and costs[0][0] >= 0.5, text
    assert costs[1][1] == "test_cpu.py::test_idle" and costs[1][0] < 0.25, text
    quiet = pytester.runpytest_inprocess(*plugin, "--cpu-report", "0")
    quiet.assert_outcomes(passed=2)
    assert "costliest" not in quiet.stdout.str()
