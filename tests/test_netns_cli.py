"""``python -m fastddp.netns``'s command line: its own options end where the script begins."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastddp import netns
from fastddp.launch.cli import build_parser
from fastddp.testing import netns as bed
from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[1]


def test_the_flags_are_the_launcher_s():
    parser = build_parser()
    flags = {o for action in parser._actions if action.nargs == 0 for o in action.option_strings}
    assert flags == netns.LAUNCH_FLAGS


def test_the_script_s_own_options_stay_its_own():
    argv = ["--nodes", "2", "--max-restarts", "1", "--standalone", "train.py", "--nodes", "1"]
    assert netns.script_at(argv) == 5
    assert netns.script_at(["--rate=1gbit", "-m", "pkg.train", "--rate", "5"]) == 2
    assert netns.script_at(["--nodes", "2", "--", "--odd-name.py"]) == 3
    assert netns.script_at(["--nodes", "2"]) == 2  # no script: refused by main


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate=-5mbit"], "--rate -5mbit: give a positive rate in bits per second"),
        (["--rate", "1gbps"], "(tc's 'bps' means bytes)"),
        (["--rate", "0mbit"], "--rate 0mbit: give a positive rate"),
        (["--rate", "1bit"], "--rate 1bit: give a positive rate in bits per second, at least 8bit"),
        (["--rate", "0.001kbit"], "--rate 0.001kbit: give a positive rate"),
        (["--rate", "1gbit "], "--rate 1gbit : give a positive rate"),
        (["--rate", "99999999999tbit"], "--rate 99999999999tbit: above 10000000tbit (10 Ebit/s)"),
        (["--rate=10000001tbit"], "above 10000000tbit (10 Ebit/s), the most tc keeps; give a"),
        (["--delay", "nan"], "--delay must be between 0 and 10000 (ms)"),
        (["--delay", "inf"], "--delay must be between 0 and 10000 (ms)"),
        (["--nnodes", "3"], "--nnodes is set by this tool for its nodes; use --nodes"),
        (["--rdzv-backend", "c10d"], "--rdzv-backend is set by this tool"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0: give at least 1 rank per node"),
        (["--nproc_per_node=-1"], "--nproc-per-node -1: give at least 1 rank per node"),
        # The launcher's parser would take these prefixes for its options: --nproc as
        # ambiguous once the namespaces stand, --nproc-per 2 silently over this tool's 1.
        (
            ["--nproc", "2"],
            "--nproc is not an option of this tool or of python -m fastddp.launch"
            "; abbreviations are refused: write it out (--nproc-per-node or "
            "--nproc_per_node)",
        ),  # fmt: skip
        (["--nproc-per", "2"], "write it out (--nproc-per-node)"),
        (["--nnode", "3"], "--nnode is not an option of this tool"),
        (["--rat", "1gbit"], "write it out (--rate)"),
        (["--bogus"], "--bogus is not an option of this tool or of python -m fastddp.launch (see"),
    ],
)
def test_bad_settings_are_refused_before_any_namespace(args, message, capsys, monkeypatch):
    def built(*_, **__):
        raise AssertionError("a namespace was made before the settings were checked")

    monkeypatch.setattr(netns, "nodes", built)
    monkeypatch.setattr(netns, "wired_pair", built)
    with pytest.raises(SystemExit) as refused:
        netns.main([*args, "train.py"])
    assert refused.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "spelled",
    [["--nproc-per-node", "2"], ["--nproc_per_node", "2"], ["--nproc_per_node=2"]],
)
def test_either_spelling_of_nproc_per_node_is_the_tool_s(spelled):
    # torchrun's alias too: left to the launcher, it would override the tool's own 1 there,
    # and each rank's share of the cores (OMP_NUM_THREADS) would be counted for 1 rank a node.
    args, rest = netns.parse([*spelled, "--max-restarts", "1", "t.py", "--nproc_per_node", "5"])
    assert args.nproc_per_node == "2"
    assert rest == ["--max-restarts", "1", "t.py", "--nproc_per_node", "5"]


def test_the_fastest_rate_is_tc_s_and_every_front_refuses_past_it():
    # (fastddp.demo --link and fastddp.bench --link check their rates with valid_rate too)
    assert netns.valid_rate(netns.MAX_RATE_TEXT) and netns.valid_rate("400gbit")
    assert not netns.valid_rate("10000001tbit") and not netns.valid_rate("99999999999tbit")


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_tc_keeps_the_fastest_rate_as_given():
    with bed.nodes(1, netns.MAX_RATE_TEXT) as (node,):
        shown = subprocess.run(
            ["ip", "netns", "exec", node.ns, "tc", "qdisc", "show", "dev", node.dev],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    assert "rate 10000000Tbit " in shown, shown


def test_quietly_stops_on_sighup_and_leaves_nohup_s_alone(capsys):
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def hung_up():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(30)  # (the handler's interrupt ends it at once)
        return 0

    def not_caught(signum, frame):  # (rather than SIGHUP's default: this process ends)
        raise AssertionError("quietly left SIGHUP to the handler it found")

    try:
        signal.signal(signal.SIGHUP, not_caught)
        assert netns.quietly(hung_up, "tool") == 128 + signal.SIGHUP
        assert capsys.readouterr().err == "tool: stopped by SIGHUP\n"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a command
        assert netns.quietly(lambda: signal.getsignal(signal.SIGHUP), "tool") == signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.netns
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_underscore_spelling_sets_the_ranks_and_their_share_of_cores(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, 'threads' + os.environ['RANK']).write_text(\n"
        "    os.environ.get('OMP_NUM_THREADS', 'unset'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "1", "--nproc_per_node", "2"]
    res = slack.run([*cmd, str(script)], cwd=ROOT, env=env, timeout=slack.guard(90))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    share = str(bed.cores_per_rank(1, "2"))
    assert sorted(p.name for p in tmp_path.glob("threads[0-9]")) == ["threads0", "threads1"]
    assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == [share] * 2


def test_the_failed_node_is_the_one_that_failed_not_the_first_to_exit(tmp_path):
    # Node 1's workers fail; node 0's launcher, stopped by its note, may exit first. Indices
    # run last node to first (0: node 2 of 3), times are exit times.
    def log(node, text):
        (tmp_path / f"node{node}.log").write_text(text)

    log(1, "[default0]: node 1 cannot go on\nChildFailedError: ...\n")
    log(2, f"error: node 1 at 10.0.0.2 (n1) failed: its rank 2 exited with 1; "
           f"{netns.STOPPED_BY_PEER} (static rendezvous)\n")  # fmt: skip
    failed = [(5.0, 2), (7.0, 1), (6.0, 0)]  # node 0 (index 2) exited first
    assert netns._first_failure(failed, 3, str(tmp_path)) == [(7.0, 1)]
    # Node 0 failed first: every other node's output says another node stopped it.
    log(1, f"error: node 0 at 10.0.0.1 (n0) failed: ...; {netns.STOPPED_BY_PEER}\n")
    assert netns._first_failure(failed, 3, str(tmp_path)) == [(5.0, 2)]
    assert netns._first_failure([], 3, str(tmp_path)) == []
    # The launcher's own words, which the tool looks for.
    failures = (ROOT / "fastddp" / "launch" / "failures.py").read_text()
    assert f'"{netns.STOPPED_BY_PEER} (static rendezvous)"' in failures
