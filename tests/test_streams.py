"""``tests/streams.py``, the runner of ``make test``: its streams split the suite, and a stream
that fails fails the command."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests import streams

RUNNER = Path(streams.__file__)


def test_the_streams_run_every_test_exactly_once():
    # Whatever markers a test has, exactly one stream's expression selects it.
    names = ["emu", "netns", "launcher", "multiproc", "cuda", "nccl_sim"]
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
    run = [sys.executable, str(RUNNER), "--only", "ranks", "emu", "--", str(tests), "-q"]
    res = subprocess.run(run, capture_output=True, text=True, timeout=100)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "test_bad" in res.stdout and "the planted failure" in res.stdout, res.stdout
    assert "failed streams: ranks" in res.stdout, res.stdout
    # The emu stream found nothing to run in this file: not a failure.
    tests.write_text("def test_good():\n    pass\n")
    res = subprocess.run(run, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ranks exit 0" in res.stdout and "emu exit 5" in res.stdout, res.stdout
