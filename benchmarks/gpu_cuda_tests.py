"""Every ``cuda``-marked test at once: one pytest process per test file, long files split.

The tests are collected once, in this process; then each file's tests run in a pytest process
of their own, all started together (at most ``--jobs`` at a time), each with its own time
limit. A file of ``multiproc`` tests (ranks spawned on the one GPU, about 10 s a test for their
CUDA start-up) is split into processes of ``--multiproc-per-process`` tests, any other file into
processes of ``--tests-per-process`` tests, so that no process runs much longer than the others.
``pytest -n`` (xdist) is not used: on the GPU machine it collected nothing.

Each process writes ``NN-<file>.log`` and a JUnit ``NN-<file>.xml`` into ``--logs``. This
prints one line per process and a last line ``cuda-tests: ...`` with the counts, and exits 1
if a test failed or a process did not finish, 0 otherwise (a test skipped is no failure). A
process that dies before pytest reports (a segfault in an extension) is named in that line,
with Python's fatal error, the test it was in and its innermost native frames (the processes
preload ``native_trace.c``, built here with ``cc``; without a compiler this says so and runs
without), and its tests are counted as not reported.

    python benchmarks/gpu_cuda_tests.py --logs LOGS [--limit 180] [tests]
    python benchmarks/gpu_cuda_tests.py --dry-run     # collect and print the processes
"""

import argparse
import contextlib
import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import native_trace

ROOT = Path(__file__).resolve().parents[1]
# Rough seconds a test takes on the 16-core GPU machine with 12 processes at once (an H100,
# 2026-11-27: a two-rank test 28-34 s, an op test about 0.9 s), to start the longest first.
SECONDS_MULTIPROC, SECONDS_OTHER = 30.0, 0.9
_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


@dataclass
class Shard:
    """Some tests of one file, run in one pytest process."""

    index: int
    file: str
    tests: list  # node ids with absolute paths
    multiproc: bool
    expected: float
    name: str = ""
    proc: "subprocess.Popen | None" = None
    started: float = 0.0
    seconds: float = 0.0
    rc: "int | None" = None
    outcome: str = "not run"
    counts: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    crash: str = ""  # how the process died before pytest reported, if it did


class _Collector:
    """A pytest plugin that keeps the collected items: (absolute node id, file, multiproc)."""

    def __init__(self) -> None:
        self.items = []

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            node = item.nodeid
            rest = node[node.index("::") :] if "::" in node else ""
            multiproc = item.get_closest_marker("multiproc") is not None
            self.items.append((f"{item.path}{rest}", str(item.path), multiproc))


def collect(paths, marker: str) -> list:
    """``(node id, file, multiproc)`` of every test under ``paths`` that ``-m marker`` selects."""
    import pytest  # here, so that importing this module for its helpers stays light

    collector = _Collector()
    args = ["--collect-only", "-qq", "-m", marker, "-p", "no:cacheprovider", *map(str, paths)]
    rc = pytest.main(args, plugins=[collector])
    if rc not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"gpu_cuda_tests: collection failed (pytest exit {rc})")
    return collector.items


def split(items, tests_per_process: int, multiproc_per_process: int) -> list:
    """Shards: each file's tests in order, cut into as few processes as the given counts allow,
    of sizes within one of each other (34 tests by 3: 10 of 3, then 2 of 2; not 11 of 3 and a
    lone one that starts last and finishes late); the longest expected first (they start first)."""
    by_file: dict = {}
    for node, file, multiproc in items:
        by_file.setdefault((file, multiproc), []).append(node)
    shards = []
    for (file, multiproc), nodes in by_file.items():
        size = multiproc_per_process if multiproc else tests_per_process
        each = SECONDS_MULTIPROC if multiproc else SECONDS_OTHER
        count = -(-len(nodes) // size)
        base, extra = divmod(len(nodes), count)
        start = 0
        for k in range(count):
            chunk = nodes[start : start + base + (k < extra)]
            start += len(chunk)
            shards.append(Shard(0, file, chunk, multiproc, each * len(chunk)))
    shards.sort(key=lambda s: -s.expected)
    for i, s in enumerate(shards, 1):
        s.index, s.name = i, f"{i:02d}-{Path(s.file).stem}"
    return shards


def _die_with_parent() -> None:
    """In the child, before exec: a SIGKILL when this driver dies (Linux), so that no pytest
    process outlives a driver that was killed outright."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start(shard: Shard, python: str, logs: Path, marker: str, per_test: int, env=None) -> None:
    cmd = [python, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider"]
    cmd += ["-o", f"timeout={per_test}", "--junitxml", str(logs / f"{shard.name}.xml")]
    cmd += shard.tests
    log = (logs / f"{shard.name}.log").open("w")
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    # A session of its own: a timed-out process is killed with its rank processes.
    shard.proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    log.close()
    shard.started = time.monotonic()


def _kill(shard: Shard) -> None:
    if shard.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shard.proc.pid, signal.SIGKILL)
        shard.proc.wait()


def finish(shard: Shard, logs: Path, timed_out: "float | None" = None) -> None:
    """Record a shard's end from its exit status and its log."""
    shard.seconds = time.monotonic() - shard.started
    text = (logs / f"{shard.name}.log").read_text(errors="replace")
    summary = [line for line in text.splitlines() if _COUNTS.search(line) and " in " in line]
    if summary:
        for count, what in _COUNTS.findall(summary[-1]):
            what = "errors" if what.startswith("error") else what
            shard.counts[what] = shard.counts.get(what, 0) + int(count)
    shard.failures = [
        line.split(" - ")[0] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    if timed_out is not None:
        shard.outcome = f"timed out after {timed_out:.0f} s"
    elif shard.rc == 0:
        shard.outcome = "pass"
    elif not summary and (shard.rc < 0 or "Fatal Python error:" in text):
        # The process died before pytest could report: say how, and in what.
        shard.crash = _crash(text, shard.rc)
        shard.outcome = f"FAIL (exit {shard.rc}: {shard.crash})"
        shard.failures.append(f"CRASHED {shard.name}: {shard.crash}")
    elif not summary:  # pytest ended without counts (a test not found, an internal error)
        last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "an empty log")
        shard.outcome = f"FAIL (exit {shard.rc}: {last.strip()[:120]})"
        shard.failures.append(f"ERROR {shard.name}: {shard.outcome[5:-1]}")
    else:
        shard.outcome = f"FAIL (exit {shard.rc})"


def _crash(log: str, rc: int) -> str:
    """How a pytest process died, from its log and exit status: Python's fatal error (or the
    signal that killed it), the test it was in, and its innermost native frames if traced."""
    fatal = next((ln for ln in log.splitlines() if "Fatal Python error:" in ln), "")
    if fatal:
        what = fatal.split("Fatal Python error:", 1)[1].strip()
    else:
        try:
            what = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            what = f"killed by signal {-rc}"
    test = re.findall(r'File "[^"]*", line \d+ in (test_\w+)', log)  # innermost first
    what = f"{what} in {test[0]}" if test else what
    native = native_trace.describe(log)
    return f"{what}; {native}" if native else what


def run(
    shards, python, logs: Path, marker, limit, process_limit, per_test, jobs, say=print, env=None
):
    """Run the shards, at most ``jobs`` at once, each within ``process_limit`` seconds and all
    within ``limit`` (in environment ``env``); shards that could not start in time stay
    ``not run``."""
    deadline = time.monotonic() + limit
    waiting, running = list(shards), []
    try:
        while waiting or running:
            while waiting and len(running) < jobs and time.monotonic() < deadline:
                shard = waiting.pop(0)
                start(shard, python, logs, marker, per_test, env)
                running.append(shard)
            if not running:
                break  # out of time with shards still waiting
            time.sleep(0.2)
            now = time.monotonic()
            for shard in list(running):
                shard.rc = shard.proc.poll()
                allowed = min(shard.started + process_limit, deadline)
                if shard.rc is None and now < allowed:
                    continue
                timed_out = None
                if shard.rc is None:
                    _kill(shard)
                    timed_out = allowed - shard.started
                else:
                    _kill(shard)  # whatever the process left behind (rank processes)
                finish(shard, logs, timed_out)
                running.remove(shard)
                say(line(shard))
    finally:
        for shard in running:
            _kill(shard)


def line(shard: Shard) -> str:
    counts = ", ".join(f"{n} {what}" for what, n in shard.counts.items()) or "no counts"
    return (
        f"{shard.name}: {len(shard.tests)} tests, {shard.outcome}, {counts}, {shard.seconds:.1f} s"
    )


def report(shards, seconds: float) -> "tuple[bool, str]":
    """Whether every test passed (or skipped), and the ``cuda-tests: ...`` line."""
    totals: dict = {}
    for s in shards:
        for what, n in s.counts.items():
            totals[what] = totals.get(what, 0) + n
    unfinished = [s for s in shards if s.outcome != "pass" and not s.outcome.startswith("FAIL")]
    failed = [s for s in shards if s.outcome != "pass"]
    tests = sum(len(s.tests) for s in shards)
    counts = ", ".join(f"{n} {what}" for what, n in totals.items()) or "nothing ran"
    text = f"cuda-tests: {tests} tests in {len(shards)} processes: {counts}"
    reported = sum(totals.values())
    if reported < tests:
        text += f"; {tests - reported} not reported"
    crashed = [s for s in shards if s.crash]
    if crashed:
        text += "; crashed: " + ", ".join(f"{s.name} ({s.crash})" for s in crashed)
    if unfinished:
        text += f"; did not finish: {', '.join(s.name for s in unfinished)}"
    return not failed, f"{text}; {seconds:.1f} s"


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run(), which kills every shard


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", default=["tests"])
    p.add_argument("--logs", default="cuda-tests-logs", help="folder for each process's log")
    p.add_argument("--marker", default="cuda", help="the tests that -m selects")
    p.add_argument("--limit", type=float, default=180.0, help="seconds for all processes")
    p.add_argument("--process-limit", type=float, default=150.0, help="seconds a process")
    p.add_argument("--per-test", type=int, default=120, help="pytest-timeout per test")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="processes at once")
    p.add_argument("--tests-per-process", type=int, default=60)
    p.add_argument("--multiproc-per-process", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help="collect and print the processes")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)
    items = collect(args.paths, args.marker)
    shards = split(items, args.tests_per_process, args.multiproc_per_process)
    print(
        f"cuda-tests: {len(items)} tests collected in {time.monotonic() - started:.1f} s, "
        f"{len(shards)} processes, at most {args.jobs} at once",
        flush=True,
    )
    if args.dry_run:
        for s in shards:
            print(f"{s.name}: {len(s.tests)} tests, about {s.expected:.0f} s beside the others")
        return 0
    if not shards:
        print(f"cuda-tests: no test selected by -m {args.marker}")
        return 0
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fastddp-trace-") as folder:
        library, why_not = native_trace.build(Path(folder))
        print(f"cuda-tests: native frames of a crash: {'on' if library else 'off, ' + why_not}")
        env = native_trace.environ(library) if library else None
        limit = args.limit - (time.monotonic() - started)
        run(
            shards, sys.executable, logs, args.marker, limit, args.process_limit, args.per_test,
            args.jobs, say=lambda text: print(text, flush=True), env=env,
        )  # fmt: skip
    for s in shards:
        if s.outcome == "not run":
            print(line(s))
    failures = [f for s in shards for f in s.failures]
    for f in failures:
        print(f)
    ok, text = report(shards, time.monotonic() - started)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
