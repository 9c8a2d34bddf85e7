"""Run the test suite as concurrent pytest streams, one per kind of test, and report them all.

    python tests/streams.py [--only NAME ...] [--python PATH] [--setup COMMAND]
                            [--early NAME COMMAND] [--first COMMAND] [--also NAME COMMAND]
                            [-- PYTEST_ARGS ...]

Much of the suite's time is spent waiting: on launchers starting and restarting jobs, on a
namespace link's rate, on peer timeouts. The emulator's tests (under AddressSanitizer, whose
runtime must be preloaded, so a pytest of their own) are the opposite: one busy core for
minutes. Run one after the other, each leaves a core idle. So eight streams run side by side:
the multi-node jobs on namespaces (``netns``) and the launcher's jobs on this machine
(``launcher``), each in two, the jobs that are broken on purpose and wait on their recovery
(``faults``) and the others; everything else, in two: the tests on pooled ranks
(``multiproc``), and the single-process tests; and the emulator's, in two: its checks, and
the sweeps that plant defects in copies of the kernels (``planted``). Niced below the others,
the emulator's streams get little of the cores until the rest ends, and then run side by side
on all of them, where one stream would leave a core idle for minutes.
Each stream is a pytest session with its own ``--basetemp`` and log, printed whole when the
stream ends; the command fails when any stream does. The markers split the tests, so every
test runs in exactly one stream (``tests/test_streams.py`` checks it).

The suite is CPU-bound on a small machine, so the streams are niced: the namespace and launcher
streams, which wait on links, timeouts and start-ups, the pooled ranks, the longest stream, and
the single-process tests first; the emulator's, which only compute and fill the cores the others
leave idle, after them. ``--also NAME COMMAND`` runs a shell command (``make test``: the CUDA
compile check) as one more stream, niced the most. ``--first COMMAND`` (``make test``: the
extension's build) runs before the pytest streams, which need what it makes; the ``--also``
commands start with it, on the core its serial parts leave idle. Before them, ``--setup
COMMAND`` (``make test``: the install of the test environment, one core busy for half a minute)
runs with the ``--early`` commands beside it (the emulator's objects, ``tests/emu_objects.py``),
which need only this checkout; they count as streams too. So this runner needs no more than the
standard library (and ``fastddp.testing``'s torch-free modules, by :func:`torchless`): any
Python 3.9 or newer runs it, and ``--python`` names the one with torch that runs the tests.

Linux's scheduler shares the cores between autogroups, one per session, before it shares a
group's among its processes by their niceness. Launchers and workers start sessions of their
own, so each stream is a session too, with its niceness on its autogroup: in one shared
session, the pooled ranks, the emulator and the compile check together weighed as much as one
launched job, and the ranks stream, starved while the launched jobs ran, ended alone, minutes
after the others. Under a full run launched jobs can still wait minutes for a core,
so the restart cells raise their own groups (``fastddp.testing.restarts``), and every wait on
a launched job is a hang guard scaled to the machine's cores (``fastddp.testing.slack``;
measured here before the streams start).
"""

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchless(name: str):
    """``fastddp.testing.<name>``, one of its modules that import neither torch nor the rest of
    fastddp (``slack``, ``emu_build``), for a Python that may not have torch yet: the folder
    is loaded as a package of its own, ``fastddp_testing``, as fastddp's ``__init__`` would
    import torch."""
    if "fastddp_testing" not in sys.modules:
        init = ROOT / "fastddp/testing/__init__.py"
        spec = importlib.util.spec_from_file_location(
            "fastddp_testing", init, submodule_search_locations=[str(init.parent)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"fastddp_testing.{name}")


slack = torchless("slack")


def _asan_env() -> dict:
    cxx = os.environ.get("CXX", "g++")
    runtime = subprocess.run(
        [cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {"LD_PRELOAD": runtime, "ASAN_OPTIONS": "detect_leaks=0"}


# name -> (marker expression, extra pytest options, environment)
STREAMS = {
    "nodes": ("not emu and netns and not faults", [], None),
    "node-faults": ("not emu and netns and faults", [], None),
    "launcher": ("not emu and not netns and launcher and not faults", [], None),
    "faults": ("not emu and not netns and launcher and faults", [], None),
    # Pooled ranks, and the single-process tests apart: in one stream, the longest, they ended
    # the run alone, a core idle for its last 40 s.
    "ranks": ("not emu and not netns and not launcher and multiproc", [], None),
    "single": ("not emu and not netns and not launcher and not multiproc", [], None),
    "emu": ("emu and not planted", ["-p", "no:cacheprovider"], _asan_env),
    "planted": ("emu and planted", ["-p", "no:cacheprovider"], _asan_env),
}
# The niceness each stream runs at, its autogroup's and its processes' (what it spawns inherits
# the latter); an --also command gets ALSO_NICE.
NICE = {"nodes": 0, "node-faults": 0, "launcher": 0, "faults": 0, "ranks": 0, "single": 0}
NICE.update(emu=8, planted=8)
ALSO_NICE = 12
# An --early command (the emulator's objects, work the emu streams would do) runs as they do.
EARLY_NICE = 8


def _own_autogroup(nice: int) -> None:
    """In a stream's process, just after ``setsid``: its session is an autogroup of Linux's
    scheduler, which weighs against the other groups by this niceness."""
    # Where the kernel has no autogroups, the process's own niceness still orders the streams.
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(nice))
    if nice:
        os.nice(nice)


def _popen(cmd, log: Path, nice: int, env=None, shell=False) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, shell=shell, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda: _own_autogroup(nice),
        )  # fmt: skip


def _start(
    name: str, python: str, pytest_args: list[str], logs: Path
) -> tuple[subprocess.Popen, Path]:
    marks, extra, env_of = STREAMS[name]
    env = {**os.environ, **(env_of() if env_of else {})}
    base = logs / f"tmp-{name}"
    cmd = [python, "-m", "pytest", "-m", marks, *extra, f"--basetemp={base}"]
    log = logs / f"{name}.log"
    return _popen([*cmd, *pytest_args], log, NICE[name], env), log


def _serial(step: str, command: str, start: float, results: dict) -> bool:
    """Run ``--setup`` or ``--first``'s ``command`` to its end; whether it exited 0."""
    print(f"===== {step}: {command!r} =====", flush=True)
    proc = subprocess.Popen(command, shell=True, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    took = time.monotonic() - start
    results[step] = (code, took, usage.ru_utime + usage.ru_stime)
    print(f"===== {step}: exit {code} after {took:.0f} s =====", flush=True)
    if code != 0:
        print(f"failed: {command!r}; no test was run")
    return code == 0


def _measure_slack(python: str) -> None:
    """Set the hang guards' factor (``fastddp.testing.slack``) unless the caller has."""
    if slack.VAR not in os.environ:
        # Measured before the tests and the build start: the cores' speed, not the load. (An
        # --early command may be running; on 2 or more cores it has a core of its own.)
        scale, took = slack.measure(python)
        os.environ[slack.VAR] = f"{scale:.2f}"
        ref = slack.REFERENCE_IMPORT_S
        print(f"hang guards x {scale:.2f}: import torch took {took:.2f} CPU s here, {ref:g} where"
              f" they were sized ({slack.VAR})", flush=True)  # fmt: skip
    else:
        print(f"hang guards x {slack.factor():.2f} ({slack.VAR} is yours)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # fmt: off
    p.add_argument("--only", nargs="+", choices=list(STREAMS), help="run these streams alone")
    p.add_argument("--python", default=sys.executable,
                   help="the Python (with torch and pytest) of the tests (default: this one)")
    p.add_argument("--setup", metavar="COMMAND",
                   help="a shell command run before everything else; it must exit 0")
    p.add_argument("--early", nargs=2, action="append", default=[], metavar=("NAME", "COMMAND"),
                   help="as --also, but started with --setup, before it ends")
    p.add_argument("--first", metavar="COMMAND",
                   help="a shell command the pytest streams wait for; it must exit 0")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("NAME", "COMMAND"),
                   help="a shell command to run as one more stream; it must exit 0")
    p.add_argument("pytest_args", nargs="*", help="passed to every stream's pytest (after --)")
    # fmt: on
    args = p.parse_args(argv)
    names = args.only or list(STREAMS)
    early, also = dict(args.early), dict(args.also)
    given, taken = [name for name, _ in (*args.early, *args.also)], [*STREAMS, "setup", "first"]
    if len(set(given)) < len(given) or set(given) & set(taken):
        p.error(f"--early, --also: give each command a name of its own, none of {', '.join(taken)}")
    logs = Path(tempfile.mkdtemp(prefix="fastddp-tests-"))
    start = time.monotonic()
    running = {}
    for name, command in early.items():
        log = logs / f"{name}.log"
        running[name] = (_popen(command, log, EARLY_NICE, shell=True), log)
    what = {**{name: STREAMS[name][0] for name in names}, **early, **also}
    results = {}
    try:
        if args.setup and not _serial("setup", args.setup, start, results):
            return 1
        _measure_slack(args.python)
        for name, command in also.items():
            log = logs / f"{name}.log"
            running[name] = (_popen(command, log, ALSO_NICE, shell=True), log)
        if args.first and not _serial("first", args.first, start, results):
            return 1
        running.update({name: _start(name, args.python, args.pytest_args, logs) for name in names})
        while running:
            for name, (proc, log) in list(running.items()):
                # wait4: the exit status and the CPU time of the stream and all it spawned
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == 0:
                    continue
                proc.returncode = os.waitstatus_to_exitcode(status)
                took, cpu = time.monotonic() - start, usage.ru_utime + usage.ru_stime
                results[name] = (proc.returncode, took, cpu)
                del running[name]
                print(f"\n===== stream {name}: {what[name]!r} =====", flush=True)
                sys.stdout.write(log.read_text(errors="replace"))
                print(f"===== stream {name}: exit {proc.returncode} after {took:.0f} s =====")
                sys.stdout.flush()
            time.sleep(0.5)
    finally:
        # A stream is a session of its own, out of reach of the terminal's Ctrl-C: its process
        # group goes with it (its pooled ranks; launched jobs are sessions of their own too).
        for proc, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - start
    print("\nstreams:", "; ".join(
        f"{n} exit {rc} in {t:.0f} s, {cpu:.0f} CPU s" for n, (rc, t, cpu) in results.items()
    ))  # fmt: skip
    cpu = sum(r[2] for r in results.values())
    cores = os.cpu_count() or 1
    busy = f"{cpu / wall:.2f} of {cores} cores busy on average"
    floor = f"with every core busy the same work would take {cpu / cores:.0f} s"
    print(f"all streams: {wall:.0f} s, {cpu:.0f} CPU s ({busy}; {floor})")
    # pytest's 5, no test collected (as when PYTEST_ARGS name another stream's tests only),
    # passes a stream; an --also command must exit 0.
    failed = [
        n for n, (rc, _, _) in results.items() if rc not in ((0, 5) if n in STREAMS else (0,))
    ]
    if failed:
        print(f"failed streams: {', '.join(failed)} (their output is above)")
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
