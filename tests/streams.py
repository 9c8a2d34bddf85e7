"""Run the test suite as concurrent pytest streams, one per kind of test, and report them all.

    python tests/streams.py [--only NAME ...] [--also NAME COMMAND] [--first COMMAND]
                            [-- PYTEST_ARGS ...]

Much of the suite's time is spent waiting: on launchers starting and restarting jobs, on a
namespace link's rate, on peer timeouts. The emulator's tests (under AddressSanitizer, whose
runtime must be preloaded, so a pytest of their own) are the opposite: one busy core for
minutes. Run one after the other, each leaves a core idle. So seven streams run side by side:
the multi-node jobs on namespaces (``netns``) and the launcher's jobs on this machine
(``launcher``), each in two, the jobs that are broken on purpose and wait on their recovery
(``faults``) and the others; everything else (pooled ranks and single-process tests); and the
emulator's, in two: its checks, and the sweeps that plant defects in copies of the kernels
(``planted``). Niced below the others, the emulator's streams get little of the cores until
the rest ends, and then run side by side on all of them, where one stream would leave a core
idle for minutes.
Each stream is a pytest session with its own ``--basetemp`` and log, printed whole when the
stream ends; the command fails when any stream does. The markers split the tests, so every
test runs in exactly one stream (``tests/test_streams.py`` checks it).

The suite is CPU-bound on a small machine, so the streams are niced: the namespace and
launcher streams, which wait on links, timeouts and start-ups, and the pooled ranks, the
longest stream, first; the emulator's, which only compute and fill the cores the others leave
idle, after them. ``--also NAME COMMAND`` runs a shell command (``make test``: the CUDA
compile check) as one more stream, niced the most. ``--first COMMAND`` (``make test``: the
extension's build) runs before the pytest streams, which need what it makes; the ``--also``
commands start with it, on the core its serial parts leave idle.

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


def _slack():
    """``fastddp/testing/slack.py`` by its path: the package's import would load torch here."""
    spec = importlib.util.spec_from_file_location("slack", ROOT / "fastddp/testing/slack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slack = _slack()


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
    "ranks": ("not emu and not netns and not launcher", [], None),
    "emu": ("emu and not planted", ["-p", "no:cacheprovider"], _asan_env),
    "planted": ("emu and planted", ["-p", "no:cacheprovider"], _asan_env),
}
# The niceness each stream runs at, its autogroup's and its processes' (what it spawns inherits
# the latter); an --also command gets ALSO_NICE.
NICE = {"nodes": 0, "node-faults": 0, "launcher": 0, "faults": 0, "ranks": 0}
NICE.update(emu=8, planted=8)
ALSO_NICE = 12


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


def _start(name: str, pytest_args: list[str], logs: Path) -> tuple[subprocess.Popen, Path]:
    marks, extra, env_of = STREAMS[name]
    env = {**os.environ, **(env_of() if env_of else {})}
    base = logs / f"tmp-{name}"
    cmd = [sys.executable, "-m", "pytest", "-m", marks, *extra, f"--basetemp={base}"]
    log = logs / f"{name}.log"
    return _popen([*cmd, *pytest_args], log, NICE[name], env), log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(STREAMS), help="run these streams alone")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("NAME", "COMMAND"),
                   help="a shell command to run as one more stream; it must exit 0")  # fmt: skip
    p.add_argument("--first", metavar="COMMAND",
                   help="a shell command the pytest streams wait for; it must exit 0")  # fmt: skip
    p.add_argument("pytest_args", nargs="*", help="passed to every stream's pytest (after --)")
    args = p.parse_args(argv)
    names = args.only or list(STREAMS)
    also = dict(args.also)
    if len(also) < len(args.also) or set(also) & set(STREAMS):
        p.error(f"--also: give each command a name of its own, none of {', '.join(STREAMS)}")
    logs = Path(tempfile.mkdtemp(prefix="fastddp-tests-"))
    if slack.VAR not in os.environ:
        # Measured before the streams start, on an idle machine: the cores' speed, not the load.
        scale, took = slack.measure()
        os.environ[slack.VAR] = f"{scale:.2f}"
        ref = slack.REFERENCE_IMPORT_S
        print(f"hang guards x {scale:.2f}: import torch took {took:.2f} CPU s here, {ref:g} where"
              f" they were sized ({slack.VAR})", flush=True)  # fmt: skip
    else:
        print(f"hang guards x {slack.factor():.2f} ({slack.VAR} is yours)", flush=True)
    start = time.monotonic()
    running = {}
    for name, command in also.items():
        log = logs / f"{name}.log"
        running[name] = (_popen(command, log, ALSO_NICE, shell=True), log)
    what = {**{name: STREAMS[name][0] for name in names}, **also}
    results = {}
    try:
        if args.first:
            print(f"===== first: {args.first!r} =====", flush=True)
            first = subprocess.Popen(args.first, shell=True, cwd=ROOT)
            _, status, usage = os.wait4(first.pid, 0)
            first.returncode = os.waitstatus_to_exitcode(status)
            took = time.monotonic() - start
            results["first"] = (first.returncode, took, usage.ru_utime + usage.ru_stime)
            print(f"===== first: exit {first.returncode} after {took:.0f} s =====", flush=True)
            if first.returncode != 0:
                print(f"failed: {args.first!r}; no test was run")
                return 1
        running.update({name: _start(name, args.pytest_args, logs) for name in names})
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
