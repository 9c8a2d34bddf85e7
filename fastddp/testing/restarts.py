"""The restart matrix: a job killed on cue under a launcher, held against an uninterrupted run.

A :class:`Case` names the rendezvous (``standalone``, ``static``, ``c10d``), how the script
initialises (``plain`` ``init_process_group`` or ``fastddp.init_distributed``), the faults (a
worker killed once; killed again in the restarted attempt with ``--max-restarts 2``; a whole
node lost and started again) and the nodes (one, or two network namespaces of 2 ranks each).
:func:`run_case` runs :mod:`fastddp.testing.restart_worker` under ``fastddp.launch`` or plain
``torchrun`` and says whether it finished (exit 0, resumed from its checkpoint after every
fault, the parameters of an uninterrupted run), failed, gave a wrong result, or hung.
"""

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

from fastddp.testing import netns, slack
from fastddp.testing.ports import free_port

__all__ = ["CASES", "Case", "Outcome", "reference", "run_case", "worker_args"]

LAUNCHERS = {
    "fastddp": [sys.executable, "-m", "fastddp.launch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
# Dead members of a c10d rendezvous are dropped after 6 missed 1 s heartbeats (default 5 x 30 s):
# a lost node is noticed in seconds, and a live launcher starved of CPU for 3 s is not dropped.
# Scaled with the machine, like every hang guard: on slower cores a starved launcher beats later.
_RDZV_CONF = (
    f"join_timeout={slack.guard(60):.0f},keep_alive_interval=1,"
    f"keep_alive_max_attempt={round(slack.guard(6))}"
)
STEPS = 12


@dataclasses.dataclass(frozen=True)
class Case:
    """One cell of the matrix.

    Args:
        rdzv: ``standalone``, ``static`` or ``c10d``.
        init: ``plain`` or ``fastddp``.
        fault: ``kill`` (rank 1 at step 5), ``kill-twice`` (then rank 0 at step 8, in the
            restarted attempt) or ``node-loss`` (every process of node 1 after step 4, then
            node 1 started again).
        nodes: 1, or 2 namespaces (needs root).
    """

    rdzv: str
    init: str
    fault: str
    nodes: int = 1

    @property
    def name(self) -> str:
        where = "1-node" if self.nodes == 1 else f"{self.nodes}-nodes"
        return f"{where}/{self.rdzv}/{self.init}/{self.fault}"

    @property
    def max_restarts(self) -> int:
        return 2 if self.fault == "kill-twice" else 1

    @property
    def kills(self) -> list[str]:
        last = 2 * self.nodes - 1  # a rank of the last node
        return {"kill": [f"5:{last}"], "kill-twice": [f"5:{last}", "8:0"]}.get(self.fault, [])

    @property
    def resumes(self) -> int:
        """How many attempts must resume from a checkpoint."""
        return {"kill": 1, "kill-twice": 2, "node-loss": 1}[self.fault]


CASES = [
    Case(rdzv, init, fault)
    for rdzv in ("standalone", "static", "c10d")
    for init in ("plain", "fastddp")
    for fault in ("kill", "kill-twice")
] + [
    # Two nodes: each rendezvous loses a worker (the c10d one twice, with init_distributed) and
    # a whole node; kept to four cases, as each takes half a minute.
    Case("static", "plain", "kill", nodes=2),
    Case("c10d", "fastddp", "kill-twice", nodes=2),
    Case("static", "plain", "node-loss", nodes=2),
    Case("c10d", "plain", "node-loss", nodes=2),
]


@dataclasses.dataclass
class Outcome:
    """``status``: ``finished``, ``failed``, ``wrong`` or ``hung``; ``detail`` says why."""

    status: str
    detail: str
    seconds: float
    output: str = ""


def _launch_args(case: Case, node: int, addr: str, port: int, run_id: str) -> list[str]:
    args = ["--nproc-per-node", "2", "--max-restarts", str(case.max_restarts)]
    if case.rdzv == "standalone":
        return [*args, "--standalone"]
    args += ["--nnodes", str(case.nodes)]
    if case.rdzv == "static":
        return [*args, "--node-rank", str(node), "--master-addr", addr, "--master-port", str(port)]
    return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", _RDZV_CONF]  # fmt: skip


def worker_args(case: Case, run: Path, kills: bool = True) -> list[str]:
    """``-m fastddp.testing.restart_worker`` and its arguments for ``case``, run in ``run``."""
    argv = ["-m", "fastddp.testing.restart_worker", "--dir", str(run), "--init", case.init]
    argv += ["--steps", str(STEPS)]
    if case.fault == "node-loss":
        argv += ["--step-seconds", "0.3"]  # time to lose the node mid-run
    for spec in case.kills if kills else []:
        argv += ["--kill", spec]
    return argv


def _spawn(cmd: list[str], ns: Optional[str], log: Path, env: dict) -> subprocess.Popen:
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _wait_for_step(run: Path, step: int, procs, deadline: float) -> bool:
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int((run / "step").read_text()) >= step:
                return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _nodes(case: Case, bed: Optional[list[netns.Node]]):
    """The case's nodes: none for one node, else ``bed`` (emptied of processes after the run)
    or namespaces of the run's own."""
    if case.nodes == 1:
        yield None
    elif bed is None:
        with netns.nodes(case.nodes, "1gbit") as made:
            yield made
    else:
        try:
            yield bed[: case.nodes]
        finally:
            for node in bed:
                netns.kill(node)


# The autogroup niceness of a cell's processes (root only). Each launcher and each worker is a
# session of its own, so an autogroup of its own, and a test run's other processes share one
# autogroup whose niceness does not count against other groups: on a 2-core machine under a
# full test run, a cell's workers waited 100 s for a core with 1 CPU s between them, and were
# done in seconds once the test run's group was niced. Ahead of the test run's group, a cell
# keeps its pace; alone on a machine, nothing changes.
_FAVOUR = "-5"


def _descendants(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@contextlib.contextmanager
def _favoured(procs: list[subprocess.Popen]):
    """While in the block, every 0.5 s, put the autogroups of ``procs`` (a list that may grow)
    and of all they start at niceness :data:`_FAVOUR`, where this process may."""
    stop = threading.Event()

    def favour() -> None:
        done: set[int] = set()
        while not stop.wait(0.5):
            for pid in _descendants([p.pid for p in procs]):
                if pid not in done:
                    done.add(pid)
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
                        f.write(_FAVOUR)

    thread = threading.Thread(target=favour, name="favour-cell", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _execute(case: Case, launcher: str, run: Path, timeout: float, kills: bool = True, bed=None):
    """Launch every node of ``case`` (node 0 last), apply the faults; exit codes or None."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # each launcher decides for itself
    log = run / "launch.log"
    deadline = time.monotonic() + timeout
    with _nodes(case, bed) as made:
        addr = made[0].addr if made else "127.0.0.1"
        port = free_port() if not made else 29400 + int(uuid.uuid4().int % 20000)
        run_id = f"restart-{uuid.uuid4().hex[:8]}"

        def start(node: int) -> subprocess.Popen:
            cmd = LAUNCHERS[launcher] + _launch_args(case, node, addr, port, run_id)
            ns = made[node].ns if made else None
            return _spawn(cmd + worker_args(case, run, kills), ns, log, env)

        procs = [start(node) for node in reversed(range(case.nodes))][::-1]
        with _favoured(procs):
            try:
                if case.fault == "node-loss" and kills:
                    if not _wait_for_step(run, 4, procs, deadline):
                        codes = [p.poll() for p in procs]
                        # Every launcher still running at the deadline: hung before the fault.
                        return None if all(c is None for c in codes) else codes
                    netns.kill(made[-1])
                    procs[-1].wait(timeout=slack.guard(30))
                    procs.append(start(case.nodes - 1))
                    procs_to_wait = [procs[0], procs[-1]]
                else:
                    procs_to_wait = procs
                for proc in procs_to_wait:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                return [p.returncode for p in procs_to_wait]
            except subprocess.TimeoutExpired:
                return None
            finally:
                netns.stop(procs)  # launchers and their workers, on any node


def reference(
    case: Case, workdir: Path, bed: Optional[list[netns.Node]] = None
) -> list[torch.Tensor]:
    """The parameters of ``case``'s job run without faults (on the same nodes).

    ``bed``: namespaces to run a multi-node case in (as :func:`run_case`).
    """
    run = Path(tempfile.mkdtemp(prefix="reference-", dir=workdir))
    clean = dataclasses.replace(case, fault="kill")
    codes = _execute(clean, "fastddp", run, timeout=slack.guard(120), kills=False, bed=bed)
    if codes is None or any(codes) or not (run / "params.pt").exists():
        raise RuntimeError(f"the reference run failed: {(run / 'launch.log').read_text()}")
    return torch.load(run / "params.pt")


def run_case(
    case: Case,
    launcher: str,
    want: list[torch.Tensor],
    workdir: Path,
    timeout: float = 240.0,
    bed: Optional[list[netns.Node]] = None,
) -> Outcome:
    """Run ``case`` once under ``launcher`` (``fastddp`` or ``torchrun``) and judge it.

    A multi-node case runs in ``bed`` (from :func:`fastddp.testing.netns.nodes`, at least
    ``case.nodes`` of them, left without a process afterwards) where given, else in
    namespaces made for this run.
    """
    run = Path(tempfile.mkdtemp(prefix="restart-", dir=workdir))
    start = time.monotonic()
    codes = _execute(case, launcher, run, timeout, bed=bed)
    took = time.monotonic() - start
    output = (run / "launch.log").read_text(errors="replace")
    attempts = (run / "attempts").read_text().split("\n") if (run / "attempts").exists() else []
    resumed = [line for line in attempts if line and not line.endswith("resumed-from 0")]
    if codes is None:
        outcome = Outcome("hung", f"still running after {timeout:.0f} s", took, output)
    elif any(codes):
        outcome = Outcome("failed", f"exit codes {codes}", took, output)
    elif len(resumed) != case.resumes:
        detail = f"attempts {attempts}: expected {case.resumes} resumes"
        outcome = Outcome("wrong", detail, took, output)
    else:
        got = torch.load(run / "params.pt")
        same = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        detail = "resumed and matched the uninterrupted run" if same else "parameters differ"
        outcome = Outcome("finished" if same else "wrong", detail, took, output)
    if outcome.status == "finished":
        shutil.rmtree(run, ignore_errors=True)
    return outcome
