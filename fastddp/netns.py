"""Run a training script on 'nodes' made of network namespaces on this machine.

``python -m fastddp.netns --nodes N --rate 1gbit [--loss PCT] [--delay MS] [launch options]
script.py [args]`` runs ``python -m fastddp.launch --nnodes N`` in each of N namespaces, node
0's output on stdout (a failed node's last lines on stderr, the others stopped), and removes
the namespaces afterwards, also on failure. With ``--delay``,
two nodes are joined by a userspace wire instead of a bridge. The nodes share this machine's
cores: each rank gets its share as ``OMP_NUM_THREADS`` unless it is set. The test bed itself is
:mod:`fastddp.testing.netns`, whose names this module also gives (``fastddp.netns.kill``, ...).
"""

import argparse
import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from fastddp.testing.netns import *  # noqa: F403 - the documented fastddp.netns.* names
from fastddp.testing.netns import NetnsError, drop, kill, nodes, start, stop, wired_pair

# A rate in bits per second, as tc writes it (its "bps" is bytes per second).
_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
# The launcher options this tool sets for every node.
_SET_HERE = {"--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
             "--master-port", "--master_port", "--standalone"}  # fmt: skip


_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# The fastest rate taken. tc keeps a rate as a 64-bit count of bytes a second: from 2**64 B/s
# (147573952tbit) up it refuses the rate as "mandatory", and from 2**64 bit/s (18446744tbit) up
# `tc qdisc show` wraps it (147000000tbit shows as 17872791Tbit; iproute2 6.1, measured). tbf
# works below both (its burst goes to the kernel in bytes), and 10 Ebit/s is beyond any link.
MAX_RATE, MAX_RATE_TEXT = 1e19, "10000000tbit"


def _bits(text: str) -> Optional[float]:
    rate = _RATE.fullmatch(text)
    return None if rate is None else float(rate[1]) * _BITS[rate[2].lower()]


def valid_rate(text: str) -> bool:
    """Whether ``text`` is a rate in bits per second as tc reads it (``1gbit``, no spaces), of
    at least 8 bit/s (tc keeps bytes a second, and a rate under one byte it refuses) and at
    most :data:`MAX_RATE`."""
    bits = _bits(text)
    return bits is not None and 8 <= bits <= MAX_RATE


# What stops the tool and its job: Ctrl-C, kill, and the terminal closing (SIGHUP).
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _catch_stops() -> None:
    # SIGHUP stays ignored where it was (nohup): that job is meant to outlive its terminal.
    for sig in _STOPS:
        if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, _interrupt)


def _ignore_stops() -> None:
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)


def _interrupt(signum, frame):
    # From the first signal on, the clean-up runs to its end: a second one (a caller passing
    # Ctrl-C on, see run_job, a second Ctrl-C, or the shell's SIGHUP after a closed terminal's)
    # would leave namespaces and nodes behind.
    _ignore_stops()
    raise KeyboardInterrupt(signum)


def run_job(cmd: list[str], env=None) -> int:
    """Run ``cmd`` (``python -m fastddp.netns ...``) to its end and return its exit code.

    On Ctrl-C it gets the interrupt too and removes its namespaces before it exits, which can
    take seconds; ``subprocess.run`` would kill it a quarter of a second later, leaving the
    namespaces and the nodes' launchers (each a session of its own) behind. The
    ``KeyboardInterrupt`` is raised again once it has exited (:func:`quietly` ends a tool).
    """
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # where only this process was interrupted
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def quietly(main, name: str) -> int:
    """``main()``'s exit code; on Ctrl-C, SIGTERM or SIGHUP (a closed terminal), 128 + the
    signal and one line saying so, without a traceback. Each becomes the interrupt
    :func:`run_job` passes on, so that a job on namespace nodes is stopped and its namespaces
    removed before this returns. SIGHUP ignored (``nohup``) stays ignored."""
    # SIGINT too: Python leaves it ignored where it started ignored (a script's background
    # job), and the tool would then wait out its job's clean-up without a word.
    _catch_stops()
    try:
        return main()
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        with contextlib.suppress(OSError):  # (a closed terminal's EIO)
            print(f"{name}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


# The options of ``python -m fastddp.launch`` that take no value (tests/test_netns_cli.py holds
# this list to the launcher's parser): every other option before the script takes one.
LAUNCH_FLAGS = frozenset({
    "--dry-run", "--help", "--module", "--no-preflight", "--no-python", "--no_python",
    "--run-path", "--run_path", "--standalone", "--virtual-local-rank", "--virtual_local_rank",
    "-h", "-m",
})  # fmt: skip


def script_at(argv: list[str]) -> int:
    """Where the script (or module) starts in ``argv``: what follows it is the script's own,
    never an option of this tool or of the launcher."""
    i = 0
    while i < len(argv):
        item = argv[i]
        if item == "--":
            return i + 1
        if not item.startswith("-"):
            return i
        i += 1 if item in LAUNCH_FLAGS or "=" in item else 2
    return len(argv)


def _launch_options() -> set[str]:
    from fastddp.launch.cli import build_parser  # (torch is loaded already, by the test bed)

    return {o for action in build_parser()._actions for o in action.option_strings}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's options and the launcher's command line (its options, then the script);
    every setting that cannot work is refused here, before any namespace is made."""
    p = argparse.ArgumentParser(
        prog="python -m fastddp.netns",
        allow_abbrev=False,  # a launch option (--nproc) is not one of these (--nproc-per-node)
        description=__doc__.splitlines()[0],
        usage="%(prog)s [--rate RATE] [--nodes N] [--loss PCT] [--delay MS] "
        "[--timeout S] [--nproc-per-node N] [launch options] script [args]",
    )
    rate = "link rate each way, in bits per second (1gbit, 100mbit); a burst of 512 KB passes "
    rate += "at once, so transfers smaller than that are not slowed (default 1gbit)"
    p.add_argument("--rate", default="1gbit", help=rate)
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    p.add_argument(  # both of torchrun's spellings: the launcher's own would override this
        "--nproc-per-node", "--nproc_per_node", default="1", help="ranks on each node (default 1)"
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before all are killed (default 1800)"
    )
    p.add_argument(
        "--loss", type=float, default=0.0, help="drop this %% of every node's received packets"
    )
    p.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="delay every packet this many ms each way (2 nodes, on a userspace wire of about "
        "80 MB/s: for faults, not for speed)",
    )
    at = script_at(argv)
    args, launch = p.parse_known_args(argv[:at])
    rest = launch + argv[at:]
    if not rest:
        p.error("give the script (or -m module) to run on every node")
    if args.nodes < 1:
        p.error("--nodes must be at least 1")
    if args.nodes > 200:
        p.error("--nodes must be at most 200 (the nodes share one /24)")
    if not args.timeout > 0:
        p.error("--timeout must be positive (seconds)")
    if not 0 <= args.loss <= 100:
        p.error("--loss must be between 0 and 100 (percent)")
    if not 0 <= args.delay <= 10_000:  # (nan fails both)
        p.error("--delay must be between 0 and 10000 (ms)")
    if (_bits(args.rate) or 0) > MAX_RATE:
        p.error(f"--rate {args.rate}: above {MAX_RATE_TEXT} (10 Ebit/s), the most tc keeps; "
                "give a rate up to that: 100mbit, 1gbit")  # fmt: skip
    if not valid_rate(args.rate):
        p.error(f"--rate {args.rate}: give a positive rate in bits per second, at least 8bit: "
                "100mbit, 1gbit (tc's 'bps' means bytes)")  # fmt: skip
    with contextlib.suppress(ValueError):  # (auto, cpu, gpu: the launcher counts them)
        if int(args.nproc_per_node) < 1:
            p.error(f"--nproc-per-node {args.nproc_per_node}: give at least 1 rank per node")
    given = [a.split("=", 1)[0] for a in launch if a.startswith("--") and a != "--"]
    # Written out in full: the launcher's parser takes a prefix of one option for it, so that
    # --nproc-per 2 would override --nproc-per-node, and --nnode 3 pass the check below.
    known = _launch_options() if given else set()
    for name in (a for a in given if a not in known):
        full = [o for o in sorted(known | set(p._option_string_actions)) if o.startswith(name)]
        fix = f"; abbreviations are refused: write it out ({' or '.join(full)})" if full else ""
        p.error(f"{name} is not an option of this tool or of python -m fastddp.launch"
                f"{fix or ' (see their --help)'}")  # fmt: skip
    taken = sorted(set(given) & _SET_HERE) + [a for a in given if a.startswith("--rdzv")]
    if taken:
        p.error(f"{taken[0]} is set by this tool for its nodes; use --nodes (and --rate)")
    if args.delay and args.nodes != 2:
        p.error("--delay joins exactly 2 nodes (--nodes 2)")
    if args.delay and args.loss >= 100:
        p.error("--loss must be below 100 with --delay")
    return args, rest


def main(argv=None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else list(argv))
    # A terminated run, or one whose terminal closed, still removes its namespaces: SIGTERM
    # and SIGHUP unwind like Ctrl-C.
    _catch_stops()
    stack = contextlib.ExitStack()  # the nodes' logs, kept to the end
    try:
        if args.delay:
            link = wired_pair(args.delay, args.loss, args.rate)
        else:
            link = nodes(args.nodes, args.rate)
        with link as made:
            if args.delay:
                made = made[0]
            elif args.loss:
                for node in made:
                    drop(node, args.loss)
            procs: list = []  # (filled as they start: an interrupt there stops them too)
            deadline = time.monotonic() + args.timeout  # for the job, not for each node
            logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastddp-netns-"))
            try:
                start(made, args.nproc_per_node, rest, started=procs, logs=logs)
                codes, ended = _wait(procs, deadline)
            except subprocess.TimeoutExpired:
                say = f"the job ran past --timeout {args.timeout:g} s; its nodes were stopped"
                print(f"fastddp.netns: {say}", file=sys.stderr)
                return 124  # as timeout(1)
            finally:
                # The clean-up runs to its end, also after the job's own end.
                _ignore_stops()
                stop(procs)
                for node in made:  # workers that outlived their launcher (sessions of their own)
                    kill(node, timeout=10.0)
            failed = [(ended[i], i) for i, c in enumerate(codes) if c not in (None, 0)]
            for _, i in _first_failure(failed, len(codes), logs):
                others = [j for j in range(len(codes)) if j != i]
                after = any(codes[j] != 0 for j in others)  # running, or stopped by it
                stopped = "; the other nodes were stopped" if after else ""
                node = len(codes) - 1 - i  # (started last to first)
                print(f"fastddp.netns: node {node}'s launcher exited with {codes[i]}{stopped}",
                      file=sys.stderr)  # fmt: skip
                _show_tail(logs, node)
    except NetnsError as e:
        print(f"fastddp.netns: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        name = signal.Signals(signum).name
        with contextlib.suppress(OSError):  # (a closed terminal's EIO)
            print(f"fastddp.netns: stopped by {name}; the nodes were stopped and their "
                  "namespaces removed", file=sys.stderr)  # fmt: skip
        return 128 + signum
    finally:
        stack.close()
    return max(c for c in codes if c is not None)


# What a launcher says when another node's failure stops it (fastddp/launch/failures.py).
STOPPED_BY_PEER = "stopping this node's workers, which cannot go on without that node"


def _first_failure(failed: list, count: int, logs: str) -> list:
    """The (exit time, index) of the node that failed first, of ``failed`` (indices of
    ``count`` launchers started last to first); none if none failed.

    Not the first to exit: a node whose workers fail tells the others, whose launchers stop
    theirs and may exit before it does. So a node whose output says another node stopped it
    comes after those that failed on their own; node 0's output is this process's own, not
    kept, and is taken as its own failure after theirs (where it failed first, the others'
    outputs say so)."""

    def stopped(i: int) -> float:
        node = count - 1 - i
        if node == 0:
            return 0.5
        with contextlib.suppress(OSError), open(os.path.join(logs, f"node{node}.log")) as f:
            return 1.0 if STOPPED_BY_PEER in f.read() else 0.0
        return 0.0

    return sorted(failed, key=lambda f: (stopped(f[1]), f))[:1]


def _show_tail(logs: str, node: int, lines: int = 20) -> None:
    """The last lines of a node's output (node 0's went to this process's own)."""
    if node == 0:
        return
    with contextlib.suppress(OSError):
        with open(os.path.join(logs, f"node{node}.log")) as f:
            tail = f.read().splitlines()[-lines:]
        print(f"fastddp.netns: node {node}'s last lines:", file=sys.stderr)
        for line in tail:
            print(f"  {line}", file=sys.stderr)


def _wait(procs: list, deadline: float) -> tuple[list, list]:
    """Each launcher's exit code (128 + the signal for one killed) and when it exited, once
    all have exited or one has failed (None then for those still running, which the caller
    stops). A thread waits on each, so that exits are timed to the moment, not to a poll."""
    ended: list = [None] * len(procs)

    def watch(i: int, proc) -> None:
        proc.wait()
        ended[i] = time.monotonic()

    for i, proc in enumerate(procs):
        threading.Thread(target=watch, args=(i, proc), daemon=True).start()
    while True:
        now = list(ended)  # (the threads write it meanwhile)
        codes = [None if t is None else p.returncode for p, t in zip(procs, now)]
        codes = [c if c is None or c >= 0 else 128 - c for c in codes]
        if all(c is not None for c in codes) or any(c for c in codes if c is not None):
            return codes, now
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("fastddp.netns", 0)
        time.sleep(0.05)


if __name__ == "__main__":
    code = main()
    gc.freeze()  # out of the last cycle collection at exit (see fastddp/launch/__main__.py)
    sys.exit(code)
