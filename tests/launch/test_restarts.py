"""Restarts under ``fastddp.launch --max-restarts``: every attempt starts clean.

Each case of :data:`fastddp.testing.restarts.CASES` runs once: a tiny job that checkpoints every
step, on one node (standalone, static and c10d rendezvous; plain ``init_process_group`` and
``fastddp.init_distributed``; a worker killed twice, in the first attempt and in the restarted
one) and on two network namespaces of 2 ranks each (a worker kill and a lost node started
again). A case passes when the job finishes, resumed from its checkpoint after every fault, with
exactly the parameters of an uninterrupted run (on pooled ranks, ``tests/_references.py``).
A one-node case of one kill is the first attempt of its kill-twice case, and is left to that
one; but for the standalone plain case, which plain torchrun fails about two runs in three: it
runs 3 times in a row, under ``--max-restarts 1`` as every one-kill case (the static and the
c10d rendezvous are held to one restart by the two-node cases). ``make stress-restart`` runs
every case 50 times.
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest

from fastddp.testing import netns, slack
from fastddp.testing.ports import free_port
from fastddp.testing.restarts import CASES, Case, run_case, worker_args

from .._references import restart_job

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.launcher,
    pytest.mark.faults,
    pytest.mark.timeout(540),  # scaled to the machine by conftest.py
]

_REFERENCES: dict[int, list] = {}
# The lines with times: torch's log (``W1127 08:25:55.455000 5944 ...``) and the workers'.
_TIMED = re.compile(r"^([DIWEF]\d{4} |restart_worker )\d\d:\d\d:\d\d|^fastddp\.launch: ")
_BANNER = re.compile(r"\] *\**$")  # the frame of torchrun's notice (its text, timed, stays)


@pytest.fixture
def bed(request):
    """The case's nodes: ``None`` on one node, else the module's two."""
    case: Case = request.node.callspec.params["case"]
    return request.getfixturevalue("two_nodes") if case.nodes > 1 else None


@pytest.fixture
def want(request, tmp_path_factory):
    """The uninterrupted job's parameters for the case's number of nodes, once per session, on
    pooled ranks (``tests/_references.py``; ``make stress-restart`` launches it instead)."""
    case: Case = request.node.callspec.params["case"]
    if case.nodes not in _REFERENCES:
        run = tmp_path_factory.mktemp("reference")
        args = worker_args(dataclasses.replace(case, fault="kill"), run, kills=False)
        _REFERENCES[case.nodes] = restart_job(args, 2 * case.nodes, nodes=case.nodes)
    return _REFERENCES[case.nodes]


def _params(cases):
    marks = {
        1: [],
        2: [
            pytest.mark.netns,
            pytest.mark.skipif(
                bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "namespaces"
            ),
        ],
    }
    return [pytest.param(c, id=c.name, marks=marks[c.nodes]) for c in cases]


# run_case's limit on a cell, and half of it: a cell that passes slower than that is reported.
# A hang guard, scaled to the machine (fastddp.testing.slack): a cell takes about 20 s alone,
# but under a full test run (load 25) its workers get a sliver of a core each (every worker is
# a session, so an autogroup, of its own), and a kill-twice cell starts its workers three
# times, one after the other. On a 2-core machine whose `import torch` took 1.8 CPU s, one such
# cell took 419 s, two of its attempts 2.5 minutes each to import torch and build DDP, and
# another ran past 420 s the same way.
_LIMIT = slack.guard(400.0)
_SLOW = _LIMIT / 2


def _judge(outcome, case: Case) -> None:
    assert outcome.status == "finished", f"{outcome.detail}\n{outcome.output[-4000:]}"
    if outcome.seconds > _SLOW:
        # A passing cell keeps no output. The timed lines tell a starved machine (evenly slow)
        # from a wait that ran out (one long gap); the launcher's own lines say what it chose
        # (the rendezvous port served here or joined, the stores).
        lines = outcome.output.splitlines()
        timed = [line[:200] for line in lines if _TIMED.match(line) and not _BANNER.search(line)]
        began = time.strftime("%H:%M:%S", time.localtime(time.time() - outcome.seconds))
        warnings.warn(
            f"{case.name} passed in {outcome.seconds:.0f} s of {_LIMIT:.0f}, from {began}; its"
            " launcher's lines and timed lines (torchrun's notice is its start):\n"
            + "\n".join(timed[-60:]),
            stacklevel=2,
        )


# A one-node kill case's run is its kill-twice case's first attempt: each would cost 11 CPU s.
_SUITE = [c for c in CASES if c.nodes > 1 or c.fault != "kill"]


@pytest.mark.parametrize("case", _params(_SUITE))
def test_a_restarted_job_resumes_to_the_uninterrupted_result(case, want, bed, tmp_path):
    _judge(run_case(case, "fastddp", want, tmp_path, timeout=_LIMIT, bed=bed), case)


@pytest.mark.parametrize("case", _params([Case("standalone", "plain", "kill")]))
@pytest.mark.parametrize("repeat", range(3))
def test_standalone_plain_restart_every_time(case, repeat, want, bed, tmp_path):
    _judge(run_case(case, "fastddp", want, tmp_path, timeout=_LIMIT, bed=bed), case)


def test_a_round_that_cannot_form_ends_with_the_cause(tmp_path):
    # Two static nodes on loopback; node 0 may not restart, node 1 may. A worker of node 0 is
    # killed: node 0 fails for good, node 1's workers lose their peers and it restarts them,
    # into a round node 0 never joins. Node 1 ends on node 0's note, or when node 0's store
    # of the new round never comes. (A worker of node 1 killed would bring node 0 along, as on
    # a membership change, when node 0's agent sees it before its own workers fail.)
    port = free_port()
    worker = ["-m", "fastddp.testing.restart_worker", "--dir", str(tmp_path), "--kill", "5:1"]
    procs = []
    for node, restarts in ((1, "1"), (0, "0")):
        cmd = [sys.executable, "-m", "fastddp.launch", "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--nproc-per-node", "2", "--max-restarts", restarts, "--master-addr"]
        cmd += ["127.0.0.1", "--master-port", str(port), "--rdzv-conf", "timeout=20", *worker]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))  # fmt: skip
    try:
        outs = [p.communicate(timeout=slack.guard(120))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode != 0 and procs[1].returncode != 0, outs
    errors = [line for line in outs[0].splitlines() if line.startswith("fastddp.launch: error:")]
    assert errors and "node 0" in errors[0], outs[0]
