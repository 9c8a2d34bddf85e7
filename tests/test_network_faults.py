"""Faults of the network between nodes (real namespaces, as root; skipped otherwise).

Two nodes of two ranks train ``examples/resume.py`` across a 1 Gbit/s bridge: with 1 % of the
packets every node receives dropped, and with the link of node 1 taken down mid-run, briefly
(the job finishes, with the same parameters) and for good (the job stops with an error that
names the ranks of the unreachable node, within the peer timeout). The math never depends on
timing, so every finished run must end with exactly the parameters of the clean run.
"""

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from fastddp import netns

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resume.py"
STEPS = ["--steps", "30", "--ckpt-every", "10"]

pytestmark = pytest.mark.skipif(
    bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "namespaces"
)


def _run(tmp: Path, mode: str, *, loss=0.0, during=None, env=None, extra=(), timeout=240):
    """One run on 2 nodes x 2 ranks: (exit codes, outputs, drops, params), node 0's first."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = [str(EXAMPLE), *STEPS, "--mode", mode, "--ckpt-dir", str(tmp / "ckpt")]
    argv += ["--out", str(tmp / "params.pt"), "--progress", str(tmp / "progress"), *extra]
    with netns.nodes(2, "1gbit") as made:
        if loss:
            for node in made:
                netns.drop(node, loss)
        procs = netns.start(made, "2", argv, stdout=subprocess.PIPE, env=env)[::-1]
        outs = ["", ""]

        def read(k):  # each node's pipe on a thread: a full pipe must never block a node
            outs[k] = procs[k].communicate()[0]

        readers = [threading.Thread(target=read, args=(k,), daemon=True) for k in (0, 1)]
        for t in readers:
            t.start()
        try:
            if during is not None:
                during(made, tmp / "progress", procs)
            for t in readers:
                t.join(timeout=timeout)
            codes = [proc.poll() for proc in procs]
            drops = [netns.dropped(node) for node in made] if loss else []
        finally:
            netns.stop(procs)
    params = torch.load(tmp / "params.pt") if (tmp / "params.pt").exists() else None
    return codes, outs, drops, params


def _wait_for_step(progress: Path, step: int, proc, timeout=120.0) -> None:
    # Rank 2 is on node 1.
    path = progress.with_suffix(".rank2")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the fault"
        try:
            if int(path.read_text().split()[1]) >= step:
                return
        except (FileNotFoundError, ValueError, IndexError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"rank 2 did not reach step {step}")


_CLEAN: dict[str, list] = {}


def _clean(mode: str, tmp_path_factory) -> list:
    """The clean-link run's parameters, once per mode for the whole module."""
    if mode not in _CLEAN:
        codes, outs, _, params = _run(tmp_path_factory.mktemp(f"clean-{mode}"), mode)
        assert codes == [0, 0] and params is not None, outs
        _CLEAN[mode] = params
    return _CLEAN[mode]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(shutil.which("nft") is None, reason="packet loss needs nft (nftables)")
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_lossy_link_gives_the_clean_runs_parameters(mode, tmp_path, tmp_path_factory):
    codes, outs, drops, params = _run(tmp_path, mode, loss=1.0)
    assert codes == [0, 0], outs
    assert sum(drops) > 0, "no packet was dropped: the test did not test loss"
    assert _same(params, _clean(mode, tmp_path_factory)), "a lossy link changed the result"


def test_a_five_second_outage_is_ridden_out(tmp_path, tmp_path_factory):
    def outage(made, progress, procs):
        _wait_for_step(progress, 12, procs[0])
        netns.set_link(made[1], up=False)
        time.sleep(5)
        netns.set_link(made[1], up=True)

    extra = ["--step-seconds", "0.1"]
    codes, outs, _, params = _run(tmp_path, "bf16", during=outage, extra=extra)
    assert codes == [0, 0], outs
    assert "rank 0: done, 30 steps" in outs[0]
    assert _same(params, _clean("bf16", tmp_path_factory)), "the outage changed the result"


def test_a_lasting_outage_names_the_lost_node_within_the_peer_timeout(tmp_path):
    took = {}

    def outage(made, progress, procs):
        _wait_for_step(progress, 5, procs[0])
        netns.set_link(made[1], up=False)  # for good
        start = time.monotonic()
        for k, proc in enumerate(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, 120 - (time.monotonic() - start)))
            took[k] = time.monotonic() - start

    env = {**os.environ, "FASTDDP_PEER_TIMEOUT": "4"}
    extra = ["--step-seconds", "0.2", "--steps", "400"]
    codes, outs, _, params = _run(tmp_path, "bf16", during=outage, env=env, extra=extra)
    assert params is None and None not in codes and 0 not in codes, (codes, outs)
    # Node 0's ranks name node 1's (ranks 2 and 3, with node 1's address)...
    named = [line for line in outs[0].splitlines() if "has not answered for" in line]
    assert any(f"rank {r} (node 1, 198.1" in line for r in (2, 3) for line in named), outs[0]
    # ...and node 1's ranks, cut off from the store on node 0, say so instead of waiting in a
    # collective until the process group's timeout (10 minutes).
    assert "the job's store at 198.1" in outs[1] and "has not answered rank" in outs[1], outs[1]
    # Peer timeout 4 s, checked every second; launchers stop their other workers after that.
    assert took[0] < 45 and took[1] < 45, took
