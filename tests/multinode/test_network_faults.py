"""Faults of the network between nodes, and of whole nodes (real namespaces, as root).

Two nodes of two ranks train ``examples/resume.py`` across a 1 Gbit/s bridge: with 1 % of the
packets every node receives dropped, and with the link of node 1 taken down mid-run, briefly
(the job finishes, with the same parameters) and for good (the job stops with an error that
names the ranks of the unreachable node, within the peer timeout). Under torchrun's elastic
rendezvous, every process of node 1 is killed mid-run: started again, it rejoins and the job
resumes from the last checkpoint; not started again, with ``--nnodes 1:2``, node 0 goes on
alone from that checkpoint, with the hook state regrouped for 2 ranks. The math never depends
on timing, so every finished run must end with exactly the parameters of its reference run:
the same training without the fault, on pooled ranks (``tests/_references.py``).
Skipped where namespaces cannot be made (not root).
"""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fastddp.testing import netns, slack
from fastddp.testing.ports import free_port

from .._references import resume_example

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resume.py"
STEPS = ["--steps", "30", "--ckpt-every", "10"]
# Over a lossy link a few steps are enough: every step's collectives lose packets (counted).
LOSSY_STEPS = ["--steps", "8", "--ckpt-every", "10"]

pytestmark = [
    pytest.mark.netns,
    pytest.mark.faults,
    pytest.mark.multiproc,
    pytest.mark.skipif(
        bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "namespaces"
    ),
]


@pytest.fixture(scope="module")
def bed(two_nodes):
    """The module's two nodes (conftest.py), for every job that needs no other link."""
    return two_nodes


@contextlib.contextmanager
def _reset_after(made):
    """Yield ``made``; then leave it as the next job needs it: no process left in a node, every
    link up at its rate, no packet dropped."""
    try:
        yield made
    finally:
        for node in made:
            netns.kill(node)
            netns.set_link(node, up=True)
            netns.set_rate(node, "1gbit")
            subprocess.run(
                ["ip", "netns", "exec", node.ns, "nft", "delete", "table", "inet", "fastddp_loss"],
                capture_output=True, timeout=slack.guard(30),
            )  # fmt: skip


class _Launchers:
    """Launchers whose output is read on threads (a full pipe must never block a node)."""

    def __init__(self) -> None:
        self.procs: list = []
        self.outs: list[str] = []
        self._readers: list[threading.Thread] = []

    def add(self, proc) -> None:
        k = len(self.procs)
        self.procs.append(proc)
        self.outs.append("")
        reader = threading.Thread(target=self._read, args=(k,), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, k: int) -> None:
        self.outs[k] = self.procs[k].communicate()[0]

    def wait(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        return [proc.poll() for proc in self.procs]

    def wait_for_step(self, progress: Path, step: int, rank: int = 2) -> None:
        """:func:`_wait_for_step` on node 0's launcher; if the job ends first, every launcher
        is stopped and their exit codes and output say why."""
        try:
            _wait_for_step(progress, step, self.procs[0], rank=rank)
        except AssertionError as e:
            netns.stop(self.procs)
            self.wait(slack.guard(30))
            said = _said([proc.poll() for proc in self.procs], self.outs)
            raise AssertionError(f"{e}\n{said}") from None


def _run(tmp: Path, mode: str, bed, *, loss=0.0, wire=None, during=None, env=None, extra=(),
         timeout=240, steps=STEPS):  # fmt: skip
    """One run on 2 nodes x 2 ranks: (exit codes, outputs, drops, params), node 0's first.

    ``bed``: the module's nodes; ``loss``: % of packets dropped on the bridge (nftables);
    ``wire``: ``(delay_ms, loss %)`` of a wired pair instead of the bridge.
    """
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = [str(EXAMPLE), *steps, "--mode", mode, "--ckpt-dir", str(tmp / "ckpt")]
    argv += ["--out", str(tmp / "params.pt"), "--progress", str(tmp / "progress"), *extra]
    link = netns.wired_pair(*wire) if wire else _reset_after(bed)
    job = _Launchers()
    with link as made:
        made, line = made if wire else (made, None)
        if loss:
            for node in made:
                netns.drop(node, loss)
        try:
            for proc in netns.start(made, "2", argv, stdout=subprocess.PIPE, env=env)[::-1]:
                job.add(proc)
            if during is not None:
                try:
                    during(made, tmp / "progress", job.procs)
                except AssertionError as e:  # say why the job was not where the fault needed it
                    netns.stop(job.procs)
                    job.wait(slack.guard(30))
                    said = _said([proc.poll() for proc in job.procs], job.outs)
                    raise AssertionError(f"{e}\n{said}") from None
            codes = job.wait(slack.guard(timeout))
            drops = [netns.dropped(node) for node in made] if loss else []
            drops += [line.dropped] if line is not None else []
        finally:
            netns.stop(job.procs)
    params = torch.load(tmp / "params.pt") if (tmp / "params.pt").exists() else None
    return codes, job.outs, drops, params


def _wait_for_step(progress: Path, step: int, proc, timeout=180.0, rank=2) -> None:
    """Until ``rank`` (by default rank 2, on node 1) has finished ``step``."""
    path = progress.with_suffix(f".rank{rank}")
    deadline = time.monotonic() + slack.guard(timeout)
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the fault"
        try:
            if int(path.read_text().split()[1]) >= step:
                return
        except (FileNotFoundError, ValueError, IndexError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"rank {rank} did not reach step {step}")


_CLEAN: dict[tuple, tuple[list, Path]] = {}


def _clean(mode: str, tmp_path_factory, ckpt: bool = False, steps=STEPS):
    """The run's parameters without faults (and with ``ckpt`` its checkpoint directory), once
    per mode and length for the whole module: 2 pretend nodes of 2 pooled ranks."""
    key = (mode, *steps)
    if key not in _CLEAN:
        tmp = tmp_path_factory.mktemp(f"clean-{mode}")
        argv = [*steps, "--mode", mode, "--ckpt-dir", str(tmp / "ckpt")]
        resume_example([*argv, "--out", str(tmp / "params.pt")], 4, nodes=2)
        _CLEAN[key] = (torch.load(tmp / "params.pt"), tmp / "ckpt")
    return _CLEAN[key] if ckpt else _CLEAN[key][0]


def _said(codes, outs: list) -> str:
    """Exit codes and each launcher's output, whole enough to say why (pytest would cut a list)."""
    return f"exit codes {codes}\n" + "\n".join(
        f"node {k}:\n{o[-4000:]}" for k, o in enumerate(outs)
    )


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# Lost packets are TCP's to resend, whatever the payload: one codec shows the result is exact
# (int8, whose rows carry scales beside the codes); the outage tests below run bf16.
_LOSSY_MODES = ["int8"]


@pytest.mark.skipif(shutil.which("nft") is None, reason="packet loss needs nft (nftables)")
@pytest.mark.parametrize("mode", _LOSSY_MODES)
def test_lossy_link_gives_the_clean_runs_parameters(mode, bed, tmp_path, tmp_path_factory):
    codes, outs, drops, params = _run(tmp_path, mode, bed, loss=1.0, steps=LOSSY_STEPS)
    assert codes == [0, 0], _said(codes, outs)
    assert sum(drops) > 0, "no packet was dropped: the test did not test loss"
    clean = _clean(mode, tmp_path_factory, steps=LOSSY_STEPS)
    assert _same(params, clean), "a lossy link changed the result"


_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], 5000))
c = s.accept()[0]
while data := c.recv(1 << 16):
    c.sendall(data)
"""
_PING = """import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000), timeout=20)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(5):
    start = time.monotonic()
    c.sendall(b"x")
    c.recv(1)
    print(time.monotonic() - start)
"""


_needs_tun = pytest.mark.skipif(
    not os.path.exists("/dev/net/tun"), reason="a delayed link needs /dev/net/tun"
)


@_needs_tun
def test_the_wire_delays_every_packet_and_drops_its_share():
    with netns.wired_pair(delay_ms=20.0, loss=0.0) as ((a, b), wire):
        server = subprocess.Popen(
            ["ip", "netns", "exec", b.ns, sys.executable, "-c", _ECHO, b.addr]
        )
        try:
            for _ in range(100):  # until the server listens
                ping = subprocess.run(
                    ["ip", "netns", "exec", a.ns, sys.executable, "-c", _PING, b.addr],
                    capture_output=True, text=True, timeout=slack.guard(60),
                )  # fmt: skip
                if ping.returncode == 0:
                    break
                time.sleep(0.1)
        finally:
            server.kill()
            server.wait()
        assert ping.returncode == 0, ping.stderr
        rtts = [float(x) for x in ping.stdout.split()]
        # A round trip crosses the wire twice; a queue can only add to that.
        assert len(rtts) == 5 and min(rtts) >= 0.040, rtts
        assert wire.forwarded >= 10 and wire.dropped == 0
    with netns.wired_pair(delay_ms=0.0, loss=50.0) as ((a, b), wire):
        udp = "import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        udp += "for _ in range(400): s.sendto(b'x', (sys.argv[1], 9))"
        send = ["ip", "netns", "exec", a.ns, sys.executable, "-c", udp, b.addr]
        subprocess.run(send, timeout=slack.guard(60))
        # The wire's threads count what reached them; under load they may lag the sender.
        deadline = time.monotonic() + slack.guard(30)
        while wire.dropped + wire.forwarded < 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and the last few ICMP answers
        # Half of 400 datagrams (200, one standard deviation 10) and of the few ICMP "port
        # unreachable" answers the kernel lets through (rate-limited to about 50).
        assert 100 < wire.dropped < 350 and wire.dropped + wire.forwarded >= 400


@_needs_tun
@pytest.mark.parametrize("mode", _LOSSY_MODES)
def test_a_slow_lossy_link_gives_the_clean_runs_parameters(mode, bed, tmp_path, tmp_path_factory):
    # 20 ms each way and 1 % of the packets dropped, on a userspace wire (no tc netem here).
    codes, outs, drops, params = _run(tmp_path, mode, None, wire=(20.0, 1.0), steps=LOSSY_STEPS)
    assert codes == [0, 0], _said(codes, outs)
    assert drops[0] > 0, "no packet was dropped: the test did not test loss"
    clean = _clean(mode, tmp_path_factory, steps=LOSSY_STEPS)
    assert _same(params, clean), "a slow lossy link changed the result"


def test_a_five_second_outage_is_ridden_out(bed, tmp_path, tmp_path_factory):
    def outage(made, progress, procs):
        _wait_for_step(progress, 12, procs[0])
        netns.set_link(made[1], up=False)
        time.sleep(5)
        netns.set_link(made[1], up=True)

    extra = ["--step-seconds", "0.1"]
    codes, outs, _, params = _run(tmp_path, "bf16", bed, during=outage, extra=extra)
    assert codes == [0, 0], _said(codes, outs)
    assert "rank 0: done, 30 steps" in outs[0]
    assert _same(params, _clean("bf16", tmp_path_factory)), "the outage changed the result"


def test_a_lasting_outage_names_the_lost_node_within_the_peer_timeout(bed, tmp_path):
    took = {}

    def outage(made, progress, procs):
        _wait_for_step(progress, 5, procs[0])
        netns.set_link(made[1], up=False)  # for good
        start = time.monotonic()
        for k, proc in enumerate(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, slack.guard(120) - (time.monotonic() - start)))
            took[k] = time.monotonic() - start

    # 10 s: a heartbeat thread starved by a busy 2-core machine missed 6 s (a 5 s timeout named
    # live ranks before the fault).
    env = {**os.environ, "FASTDDP_PEER_TIMEOUT": "10"}
    extra = ["--step-seconds", "0.2", "--steps", "400"]
    codes, outs, _, params = _run(tmp_path, "bf16", bed, during=outage, env=env, extra=extra)
    assert params is None and None not in codes and 0 not in codes, _said(codes, outs)
    # Node 0's ranks name node 1's (ranks 2 and 3, with node 1's address)...
    named = [line for line in outs[0].splitlines() if "has not answered for" in line]
    assert any(f"rank {r} (node 1, 198.1" in line for r in (2, 3) for line in named), outs[0]
    # ...and node 1's ranks, cut off from the store on node 0, say so instead of waiting in a
    # collective until the process group's timeout (10 minutes).
    assert "the job's store at 198.1" in outs[1] and "has not answered rank" in outs[1], outs[1]
    # Peer timeout 10 s, checked every 2.5 s; launchers stop their other workers after that
    # (a process group's own timeout would take 10 minutes).
    assert took[0] < slack.guard(60) and took[1] < slack.guard(60), took


def test_a_node_silent_while_the_workers_start_is_named_by_the_launchers(bed):
    # Node 1's link goes down while its workers still load (SLOW_NODE), before any of them
    # watches its peers: node 0's workers wait in init_distributed for node 1's ranks (for its
    # 10 minutes), and node 1's launcher calls node 0's store in silence (no connection
    # closes). The launchers name the silent node within the peer timeout and a margin.
    worker = ROOT / "tests" / "launch" / "_failing_worker.py"
    env = {**os.environ, "FASTDDP_PEER_TIMEOUT": "5", "SLOW_NODE": "1", "HOLD_S": "120"}
    job = _Launchers()
    with _reset_after(bed) as made:
        try:
            started = netns.start(made, "2", [str(worker)], stdout=subprocess.PIPE, env=env)
            for proc in started[::-1]:  # node 0's first
                job.add(proc)
            deadline = time.monotonic() + slack.guard(60)
            while len(netns._ip("netns", "pids", made[1].ns).stdout.split()) < 3:  # + 2 workers
                assert time.monotonic() < deadline, "node 1's workers did not start"
                time.sleep(0.1)
            time.sleep(1.0)
            netns.set_link(made[1], up=False)
            start = time.monotonic()
            codes = job.wait(timeout=slack.guard(90))
            took = time.monotonic() - start
        finally:
            netns.stop(job.procs)
    assert codes == [1, 1], _said(codes, job.outs)
    limit = "(peer timeout 5 s + 10, FASTDDP_PEER_TIMEOUT): the network to it, or that node, is"
    assert f"error: node 1 at {made[1].addr}" in job.outs[0], _said(codes, job.outs)
    assert "has not answered node 0's launcher for" in job.outs[0] and limit in job.outs[0]
    assert f"error: node 0 at {made[0].addr}" in job.outs[1], _said(codes, job.outs)
    assert "has not answered this node's launcher for" in job.outs[1] and limit in job.outs[1]
    assert "worker ok" not in "".join(job.outs) and took < slack.guard(45), took


# -- a lost node, under torchrun's elastic rendezvous -------------------------------------------

# A launcher missing 6 heartbeats of 1 s is dropped: a lost node is noticed in seconds, and a
# live one starved of CPU for 3 s on a busy machine is not. With --nnodes 1:2 a round closes 5 s
# after its first node joined. All three are hang guards of a kind (a live launcher dropped, a
# node left out of a round for joining late), so they scale with the machine like the others.
_RDZV = (
    f"join_timeout={slack.guard(90):.0f},last_call_timeout={slack.guard(5):.0f},"
    f"keep_alive_interval=1,keep_alive_max_attempt={round(slack.guard(6))}"
)
# Residuals in both stages of the two-level path: the hook state a resume must restore.
_EF_MODE = "bf16-acc-ef"


def _elastic(rdzv_id: str, nnodes: str, env=None) -> tuple[dict, int]:
    """:func:`netns.spawn` options for torchrun's elastic rendezvous, and its port."""
    args = ["--nnodes", nnodes, "--max-restarts", "1", "--rdzv-conf", _RDZV]
    launch = {"rdzv_id": rdzv_id, "launch_args": args, "stdout": subprocess.PIPE, "env": env}
    # Below the ephemeral range: the earlier jobs' outgoing connections leave their local ports
    # there in TIME_WAIT, which node 0's store cannot bind for a minute; drawn at random, so no
    # earlier job of the module's nodes is likely to have listened on it either.
    return launch, free_port()


def _lose_node_1(tmp: Path, bed, mode: str, nnodes: str, rejoin: bool, power: bool = False):
    """2 nodes x 2 ranks, elastic; every process of node 1 SIGKILLed after step 12.

    With ``power``, node 1's link goes down first, as when a node loses power: no socket is
    closed, so node 0's ranks learn of it only from the watchdog (peer timeout 12 s). Returns
    exit codes and outputs (node 0, node 1, and node 1 started again with ``rejoin``), and the
    final parameters.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    argv = [str(EXAMPLE), *STEPS, "--mode", mode, "--ckpt-dir", str(tmp / "ckpt")]
    argv += ["--out", str(tmp / "params.pt"), "--progress", str(tmp / "progress")]
    argv += ["--step-seconds", "0.1"]
    env = {**os.environ, "FASTDDP_PEER_TIMEOUT": "12"}  # 5 s fired on live ranks of a busy machine
    launch, port = _elastic(f"lost-node-{nnodes}", nnodes, env=env)
    job = _Launchers()
    with _reset_after(bed) as made:
        try:
            # Node 1 first: it waits for node 0's store and joins at once, well within the
            # last call, so that the first round has both nodes also with --nnodes 1:2.
            second = netns.spawn(made, 1, "2", argv, port, **launch)
            job.add(netns.spawn(made, 0, "2", argv, port, **launch))
            job.add(second)
            # Step 10's checkpoint is whole once rank 2 has finished step 12 (its collectives
            # need every rank past the save); step 20's is 8 steps away.
            job.wait_for_step(tmp / "progress", 12)
            if power:
                netns.set_link(made[1], up=False)
            assert netns.kill(made[1]) >= 3, "node 1 had fewer than a launcher and 2 workers"
            job.procs[1].wait(timeout=slack.guard(30))
            if rejoin:
                job.add(netns.spawn(made, 1, "2", argv, port, **launch))
            codes = job.wait(timeout=slack.guard(240))
        finally:
            netns.stop(job.procs)
    params = torch.load(tmp / "params.pt") if (tmp / "params.pt").exists() else None
    return codes, job.outs, params


def test_a_lost_node_started_again_rejoins_and_the_job_resumes(bed, tmp_path, tmp_path_factory):
    codes, outs, params = _lose_node_1(tmp_path, bed, _EF_MODE, "2", rejoin=True)
    assert codes[0] == 0 and codes[2] == 0 and codes[1] == -9, _said(codes, outs)
    # Node 0's ranks start again from the checkpoint (their peers vanished); node 1's come back
    # as ranks 2, 3. torchrun counts it as attempt 1 when node 0's agent sees its workers fail
    # first, and as attempt 0 when it first sees node 1 waiting to rejoin (a membership change,
    # which it does not count): which comes first depends on the machine's load.
    assert re.search(r"rank 0: attempt [01], starting from step 10 ", outs[0]), outs[0]
    assert "rank 2: attempt 0, starting from step 10" in outs[2], outs[2]
    assert "restarts: a fresh workers' store for every rendezvous round" in outs[0], outs[0]
    assert _same(params, _clean(_EF_MODE, tmp_path_factory)), "resuming changed the result"


_REFERENCE: dict[str, list] = {}


def _clean_resumed_on_2_ranks(tmp_path_factory) -> list:
    """The clean 4-rank run's checkpoint at step 10, resumed on 2 ranks: its parameters."""
    if "shrunk" not in _REFERENCE:
        _, ckpt = _clean(_EF_MODE, tmp_path_factory, ckpt=True)
        ref = tmp_path_factory.mktemp("reference")
        shutil.copytree(ckpt / "step-10", ref / "ckpt" / "step-10")
        argv = [*STEPS, "--mode", _EF_MODE, "--ckpt-dir", str(ref / "ckpt")]
        said = resume_example([*argv, "--out", str(ref / "params.pt")], 2)
        assert "step-10 was saved by 4 ranks and this job has 2" in said, said
        _REFERENCE["shrunk"] = torch.load(ref / "params.pt")
    return _REFERENCE["shrunk"]


@pytest.mark.parametrize("power", [False, True], ids=["killed", "power-lost"])
def test_a_lost_node_not_coming_back_leaves_node_0_alone(power, bed, tmp_path, tmp_path_factory):
    codes, outs, params = _lose_node_1(tmp_path, bed, _EF_MODE, "1:2", rejoin=False, power=power)
    assert codes == [0, -9], _said(codes, outs)
    if power:  # nothing closed node 1's sockets: the watchdog named its ranks
        named = [line for line in outs[0].splitlines() if "has not answered for" in line]
        assert any(f"rank {r} (node 1, 198.1" in line for r in (2, 3) for line in named), outs[0]
    assert "rank 0: attempt 1, starting from step 10" in outs[0], outs[0]
    assert "step-10 was saved by 4 ranks and this job has 2: resharding" in outs[0], outs[0]
    # Equal to the clean 4-rank run's checkpoint at step 10 resumed on 2 ranks.
    shrunk = _clean_resumed_on_2_ranks(tmp_path_factory)
    assert _same(params, shrunk), "node 0 alone diverged"


def test_a_node_added_to_a_running_job_grows_it(bed, tmp_path, tmp_path_factory):
    # Node 0 starts alone (--nnodes 1:2) and holds at step 20 (its checkpoint saved) until the
    # job grows; node 1 joins then. Node 0's agent restarts its workers for the new member, and
    # 4 ranks go on from the 2-rank checkpoint: at step 20 however slowly node 1 starts.
    argv = [str(EXAMPLE), "--steps", "40", "--ckpt-every", "10", "--mode", _EF_MODE]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "params.pt")]
    argv += ["--progress", str(tmp_path / "progress"), "--grow-at", "20:4"]
    launch, port = _elastic("grow", "1:2")
    job = _Launchers()
    with _reset_after(bed) as made:
        try:
            job.add(netns.spawn(made, 0, "2", argv, port, **launch))
            job.wait_for_step(tmp_path / "progress", 20, rank=0)
            job.add(netns.spawn(made, 1, "2", argv, port, **launch))
            codes = job.wait(timeout=slack.guard(240))
        finally:
            netns.stop(job.procs)
    assert codes == [0, 0], _said(codes, job.outs)
    found = re.search(r"step-(\d+) was saved by 2 ranks and this job has 4", job.outs[0])
    assert found, job.outs[0]
    step = int(found.group(1))
    assert step == 20 and "rank 0: at step 20, waiting for 4 ranks" in job.outs[0], job.outs[0]
    assert f"rank 2: attempt 0, starting from step {step}" in job.outs[1], job.outs[1]
    # The reference: that 2-rank checkpoint resumed by 2 nodes of 2 ranks without faults.
    ref = tmp_path_factory.mktemp("grown")
    shutil.copytree(tmp_path / "ckpt" / f"step-{step}", ref / "ckpt" / f"step-{step}")
    argv = ["--steps", "40", "--mode", _EF_MODE, "--ckpt-dir", str(ref / "ckpt")]
    said = resume_example([*argv, "--out", str(ref / "params.pt")], 4, nodes=2)
    assert f"rank 0: attempt 0, starting from step {step}" in said, said
    want = torch.load(ref / "params.pt")
    assert _same(torch.load(tmp_path / "params.pt"), want), "the grown job diverged"
