"""The two-level path on real nodes: 2 network namespaces x 2 ranks on a 1 Gbit/s link.

Every codec matches plain DDP there, and the bytes the nodes' links really sent (interface
counters) are what ``stats()`` reports: fastddp's own cross-node bytes, and the fp32 ring's
estimate against plain DDP's measured traffic (in the run that test_hsdp_netns.py's tests
share: ``two_by_two``, conftest.py). Needs root; skipped cleanly otherwise.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fastddp.netns import main as netns_main
from fastddp.testing import netns, slack

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]


def test_two_nodes_of_two_ranks_over_a_real_link(two_by_two):
    out, res = two_by_two  # tests/multinode/conftest.py
    assert (out / "topology.json").exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "topology.json").read_text())
    assert (report["world"], report["nodes"]) == (4, 2)
    # Every codec reported (an empty report would skip every check below).
    assert set(report["codecs"]) == {"bf16", "bf16-acc", "int8"}
    for name, row in report["codecs"].items():
        assert row["topology_used"] == "hierarchical", name
        assert row["counted_cross_node_bytes"] > 0 and row["link_bytes"] > 0, name
        assert row["nodes"] == [[0, 1], [2, 3]], name
        # What left the nodes is what stats() counted, plus TCP/IP headers.
        ratio = row["link_bytes"] / row["counted_cross_node_bytes"]
        assert ratio >= 1.0 and ratio <= 1.1, f"{name}: link sent {ratio:.3f}x the counted bytes"
        # The fp32 ring estimate is what plain DDP (Gloo's ring) really sent.
        ring = row["plain_ddp_link_bytes"] / row["counted_fp32_ring_cross_node_bytes"]
        assert ring >= 1.0 and ring <= 1.1, f"{name}: plain DDP sent {ring:.3f}x the ring estimate"
        # 16-bit on 1/L of each bucket: a third of the fp32 ring's cross-node bytes here.
        assert row["link_bytes"] < row["plain_ddp_link_bytes"] / 2.5, name


_ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    conn, _ = srv.accept()
    conn.sendall(conn.recv(64))
    conn.close()
"""
_CALL = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.sendall(sys.argv[3].encode())
    assert s.recv(64).decode() == sys.argv[3]
"""


def test_nodes_on_one_bridge_reach_each_other_and_are_removed():
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    with netns.nodes(3, "100mbit") as made:
        names = [n.ns for n in made]
        first = made[0]
        server = subprocess.Popen(
            ["ip", "netns", "exec", first.ns, sys.executable, "-c", _ECHO, first.addr, "2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = server.stdout.readline().strip()
            for node in made[1:]:
                call = ["ip", "netns", "exec", node.ns, sys.executable, "-c", _CALL]
                res = subprocess.run(
                    [*call, first.addr, port, node.addr],
                    capture_output=True,
                    timeout=slack.guard(30),
                )
                assert res.returncode == 0, res.stderr
            assert server.wait(timeout=slack.guard(30)) == 0
        finally:
            if server.poll() is None:
                server.kill()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in names)


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line}


def _bridge_of(pids: list) -> set:
    """The namespaces of the bridge whose nodes run ``pids``: the hub and each node.

    Found from the processes, not from what appeared meanwhile: other tests running beside
    this one make namespaces too.
    """
    tags = set()
    for pid in pids:
        out = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True)
        match = re.fullmatch(r"fd\d+n(\w+)", out.stdout.strip())
        if match:  # the netns command itself runs outside, its nodes' processes inside
            tags.add(match.group(1))
    assert len(tags) == 1, f"the sleepers run in the namespaces of {len(tags)} bridges: {tags}"
    tag = tags.pop()
    return {f"fdh{tag}", f"fd0n{tag}", f"fd1n{tag}"}


# A terminal's Ctrl-C reaches every process of its group: the tool run by another program
# (fastddp.bench --link, fastddp.demo) through fastddp.netns.run_job, which lets it clean up.
# A tool that runs its job on namespace nodes, as fastddp.demo and fastddp.bench --link do.
_BY_RUN_JOB = (
    "import sys; from fastddp.netns import quietly, run_job; "
    "sys.exit(quietly(lambda: run_job(sys.argv[1:]), 'tool'))"
)


# terminated: SIGTERM to the namespace tool; ctrl-c: SIGINT to a tool's whole process group, as
# a terminal sends it, to a tool started with SIGINT ignored (as a script's background job is,
# which Python then leaves ignored); tool-terminated: SIGTERM to a tool that runs the namespace
# tool.
@pytest.mark.parametrize("how", ["terminated", "ctrl-c", "tool-terminated"])
def test_a_stopped_run_removes_its_namespaces_and_workers_and_ranks_share_cores(tmp_path, how):
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    marker = f"fastddp-sleeper-{uuid.uuid4().hex[:12]}"  # no earlier run's sleeper matches
    script = tmp_path / f"{marker}.py"
    threads = tmp_path / "threads"
    script.write_text(
        "import os, sys, time\n"
        f"path = {str(threads)!r} + os.environ['RANK']\n"
        "with open(path + '.part', 'w') as f:\n"
        "    f.write(os.environ.get('OMP_NUM_THREADS', 'unset'))\n"
        "os.replace(path + '.part', path)  # seen whole or not at all\n"
        "time.sleep(300)\n"
    )

    def sleepers():
        out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        return out.split()

    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", str(script)]
    if how != "terminated":
        cmd = [sys.executable, "-c", _BY_RUN_JOB, *cmd]
    if how == "ctrl-c":
        cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
    err = tmp_path / "stderr"
    run = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=err.open("w"),
        start_new_session=True,  # a group of its own, as a terminal's job is
    )
    try:
        # Both workers have started: every process of the run but the command itself is in
        # its namespaces now (before, an `ip netns exec` may not have entered one yet).
        deadline = time.monotonic() + slack.guard(60)
        while len(list(tmp_path.glob("threads[0-9]"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ours = _bridge_of(sleepers())
        assert ours <= _namespaces()
        # The two one-rank nodes share this machine's cores.
        share = str(netns.cores_per_rank(2, "1"))
        assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == [share] * 2
        if how == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.terminate()
        run.wait(timeout=slack.guard(60))
        assert ours & _namespaces() == set()
        assert sleepers() == []
        # A line each from the tool and node 0's launcher, no traceback, the shell's exit code.
        told = err.read_text()
        signum = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
        assert run.returncode == 128 + signum, told[-3000:]
        passed_on = signal.SIGTERM if how == "terminated" else signal.SIGINT  # by run_job
        assert f"fastddp.netns: stopped by {passed_on.name}; the nodes were stopped" in told
        if how != "terminated":
            assert told.rstrip().endswith(f"tool: stopped by {signum.name}"), told[-3000:]
        assert "fastddp.launch: stopped by SIGTERM; the workers were stopped" in told, told
        assert "Traceback" not in told, told[-3000:]
    finally:
        if run.poll() is None:  # a failed check: still remove the namespaces (SIGTERM does)
            run.terminate()
            try:
                run.wait(timeout=slack.guard(60))
            except subprocess.TimeoutExpired:
                run.kill()


def test_three_nodes_of_two_ranks_find_their_nodes_and_reduce():
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "3", "--nproc-per-node", "2"]
    cmd += ["--rate", "1gbit", "--timeout", f"{slack.guard(150):.0f}"]
    cmd += ["tests/multinode/_three_nodes_worker.py"]
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(200))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("bf16", "bf16-acc", "int8"):
        assert f"{name}: hierarchical-" in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0", "script.py"], "--nodes must be at least 1"),
        (["--nodes", "300", "script.py"], "--nodes must be at most 200"),
        (["--timeout", "0", "script.py"], "--timeout must be positive (seconds)"),
        (["--nodes", "3"], "give the script (or -m module) to run on every node"),
        (["--delay", "-1", "script.py"], "--delay must be between 0 and 10000 (ms)"),
        (["--nodes", "3", "--delay", "20", "script.py"], "--delay joins exactly 2 nodes"),
        (["--delay", "20", "--loss", "100", "script.py"], "--loss must be below 100 with --delay"),
    ],
)
def test_netns_refuses_bad_options(args, message, capsys):
    # Refused before any namespace is made, so this needs no root. In this process: the jobs
    # above run the command itself, and each case on its own would start torch again.
    with pytest.raises(SystemExit) as exit_:
        netns_main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


def test_a_wired_pair_refuses_a_negative_delay_or_full_loss():
    # Refused before any namespace is made, so this needs no root.
    for delay, loss in ((-1.0, 0.0), (20.0, 100.0)):
        refused = pytest.raises(ValueError, match=r"delay >= 0 ms and loss in \[0, 100\) %")
        with refused, netns.wired_pair(delay, loss):
            pass


def test_a_full_loss_drops_every_packet():
    # nft refuses a draw bound of 10000: 100 % (or a share that rounds to it) drops without one.
    if shutil.which("nft") is None:
        pytest.skip("packet loss needs nft (nftables)")
    connect = (
        "import socket, sys\n"
        "try:\n    socket.create_connection((sys.argv[1], 9), timeout=2)\n"
        "except ConnectionRefusedError:\n    print('refused')\n"
        "except TimeoutError:\n    print('no answer')\n"
    )
    with netns.nodes(2) as made:
        netns.drop(made[1], 99.999)
        said = subprocess.run(
            ["ip", "netns", "exec", made[0].ns, sys.executable, "-c", connect, made[1].addr],
            capture_output=True, text=True, timeout=slack.guard(30),
        )  # fmt: skip
        assert said.stdout.strip() == "no answer", said
        assert netns.dropped(made[1]) >= 1


def test_nodes_refuses_a_count_out_of_range():
    with pytest.raises(ValueError, match="between 1 and 200 nodes, got 0"), netns.nodes(0):
        pass


def test_a_bad_rate_and_a_job_past_its_timeout_are_named_and_leave_nothing(tmp_path):
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "1"]
    res = slack.run([*cmd, "--rate", "fast", "script.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=slack.guard(60))  # fmt: skip
    assert res.returncode == 2 and "--rate fast: give a positive rate" in res.stderr, res.stderr
    marker = f"fastddp-sleeper-{uuid.uuid4().hex[:12]}"
    script = tmp_path / f"{marker}.py"
    script.write_text("import time\ntime.sleep(300)\n")
    res = slack.run([*cmd, "--timeout", "3", str(script)], cwd=ROOT, capture_output=True,
                         text=True, timeout=slack.guard(90))  # fmt: skip
    assert res.returncode == 124, res.stdout[-2000:] + res.stderr[-2000:]
    assert "the job ran past --timeout 3 s; its nodes were stopped" in res.stderr
    # Stopped indeed. (Its namespaces go as a terminated run's do, tested above; other
    # streams make namespaces meanwhile, so a count here would not say whose.)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left.split() == []


def test_a_node_that_fails_stops_the_others_at_once(tmp_path):
    # Node 1's worker fails while node 0's trains on: the tool stops node 0 and says which
    # node failed, rather than waiting for node 0 (up to --timeout, its output alone shown).
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    script = tmp_path / "one_fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['GROUP_RANK'] == '1':\n"
        "    sys.exit('node 1 cannot go on: a reason only it knows')\n"
        "time.sleep(300)\n"
    )
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", str(script)]
    start = time.monotonic()
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(120))
    took = time.monotonic() - start
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "node 1's launcher exited with 1; the other nodes were stopped" in res.stderr
    # and what node 1 said, which goes nowhere else (node 0's output is the tool's own)
    assert "node 1's last lines:" in res.stderr, res.stderr[-3000:]
    assert "node 1 cannot go on: a reason only it knows" in res.stderr, res.stderr[-3000:]
    assert took < 300, took  # not node 0's sleep
