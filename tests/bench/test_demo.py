"""python -m fastddp.demo: its options, its table, where it runs, and how it ends."""

import argparse
import os
import re
import signal
import sys

import pytest

import fastddp
from fastddp import demo
from fastddp.hooks import auto
from fastddp.testing import netns, slack

from .._dist import run_ranks

pytestmark = pytest.mark.multiproc


def test_demo_refuses_bad_options(capsys):
    # In this process: the check runs before any rank or link is made, and `python -m
    # fastddp.demo` itself is run by test_demo_on_loopback.
    for bad, said in (
        (["--steps", "0"], "--steps must be at least 1"),
        # (checked here, not by the namespace tool, whose usage names its own --rate)
        (["--link", "1gbps"], "--link 1gbps: give a rate in bits per second, from 8bit to"),
        (["--link", "1bit"], "--link 1bit: give a rate in bits per second, from 8bit to"),
        (["--link", "99999999999tbit"], "from 8bit to 10000000tbit (1gbit, 100mbit), or none"),
    ):
        with pytest.raises(SystemExit) as exit_:
            demo.main(bad)
        assert exit_.value.code == 2 and said in capsys.readouterr().err


def _demo(*args):
    small = ["--steps", "24", "--width", "64", "--batch", "16", "--probe-every", "25"]
    cmd = [sys.executable, "-m", "fastddp.demo", *small, *args]
    res = slack.run(cmd, capture_output=True, text=True, timeout=slack.guard(200))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # Every mode has its row, and auto names what it planned (24 steps: one plan).
    for mode in ("fp32", "fastddp-bf16", "fastddp-bf16-acc", "fastddp-int8-ef"):
        assert f" {mode} " in res.stdout, res.stdout
    chose = [f"fastddp-auto ({m})" for m in auto.DEFAULT_ALLOW] + ["fastddp-auto (mixed ("]
    assert any(c in res.stdout for c in chose), res.stdout
    # The payload column: auto's is fp32's only where it planned to send fp32.
    payload = {}
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line)]
        if len(cells) > 5 and cells[3].endswith("x"):
            payload[cells[1].split(" (")[0]] = float(cells[4])
    assert payload["fastddp-bf16"] < payload["fp32"], res.stdout
    if "fastddp-auto (none)" in res.stdout:
        assert payload["fastddp-auto"] == payload["fp32"], res.stdout
    else:
        assert payload["fastddp-auto"] < payload["fp32"], res.stdout
    return res.stdout


def test_demo_on_loopback():
    out = _demo("--link", "none")
    assert "on one machine (loopback)" in out
    assert "its trial's collectives got inside the node " in out, out


@pytest.mark.netns
def test_demo_over_a_link_between_two_namespace_nodes():
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    # Two ranks on each node, as a cluster's nodes have several GPUs.
    out = _demo("--link", "200mbit", "--nproc", "2")
    assert "4 ranks (Gloo, CPU) on 2 nodes joined by a 200mbit link" in out
    # auto's trial measured the node's own level and the link. (This model's steps send less
    # than the link's 512 KB burst, so the rate says little of the link's.)
    got = re.search(r"between nodes [0-9.]+ MB/s \(([0-9.]+) Gbit/s\)", out)
    assert got is not None and float(got.group(1)) > 0, out
    assert "inside the node " in out, out


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.mark.timeout(30)
def test_demo_with_a_stray_rank_says_to_unset_it(monkeypatch, capsys):
    # A RANK left in the shell makes the demo a rank of a launch that cannot start.
    for name in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    handlers = {s: signal.getsignal(s) for s in _STOPS}  # (a rank's own, set by main)
    try:
        code = demo.main(["--steps", "1"])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("fastddp.demo: the environment sets RANK=3, so the demo ran"), err
    assert "RANK is set but WORLD_SIZE is not" in err, err  # what is wrong, and the fix
    assert "unset RANK: `unset RANK`, or `env -u RANK python -m fastddp.demo`" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


# As `python -m fastddp.demo` runs as a launcher's rank, whose session is where torch's agent
# stops it: SIGINT, then SIGTERM, both pending while the rank was busy in C++ (a collective).
_STOPPED_RANK = """
import contextlib, os, runpy, signal
import fastddp

@contextlib.contextmanager
def session(**kwargs):
    both = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, both)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # (their handlers run here)
    raise AssertionError("the rank went on after its signals")
    yield

fastddp.distributed_session = session
runpy.run_module("fastddp.demo", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(60)
def test_demo_rank_stopped_by_its_launcher_ends_silently():
    # The launcher and the demo that started it each say it was stopped; a rank says nothing
    # (it said "stopped by SIGINT", then a traceback of the SIGTERM that came meanwhile).
    env = {**os.environ, "RANK": "0"}
    cmd = [sys.executable, "-c", _STOPPED_RANK, "--steps", "1"]
    res = slack.run(cmd, env=env, timeout=slack.guard(50))
    assert res.returncode == 128 + signal.SIGINT, res.stdout + res.stderr
    assert res.stdout == "" and res.stderr == "", res.stdout + res.stderr


def _as_user(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(demo.netns, "unavailable_reason", lambda: "network namespaces need root")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ran = []
    monkeypatch.setattr(demo, "run_job", lambda cmd, env: ran.append(cmd) or 0)
    return ran


@pytest.mark.timeout(30)
def test_demo_without_root_names_the_command_for_its_link(monkeypatch, capsys):
    ran = _as_user(monkeypatch)
    assert demo.main(["--link", "100mbit", "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fastddp.demo: on loopback, since network namespaces need root; "), out
    command = '`python -m fastddp.demo --link 100mbit --steps 50` (`make demo DEMO_ARGS="--link '
    command += '100mbit --steps 50"`) runs it on two nodes joined by a 100mbit link'
    assert f"as root, {command}" in out, out
    # (run_job is stubbed: the command the demo would run, on loopback, starts nothing here.)
    assert ran[-1][2:4] == ["fastddp.launch", "--standalone"], ran
    # The default link: what `make demo` runs as root.
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    said = "as root, `python -m fastddp.demo` (`make demo`) runs it on two nodes joined by a 1gbit"
    assert f"{said} link" in out, out
    # Loopback asked for: no note.
    assert demo.main(["--link", "none"]) == 0
    assert capsys.readouterr().out == ""
    assert len(ran) == 3


def _row(mode, payload, deviations):
    return {
        "mode": mode,
        "step_ms": 2.0,
        "payload": payload,
        "sent": payload,
        "final_loss": 0.1,
        "deviations": deviations,
        "params": payload // 4,
        "links": {},
        "retrial": (0, 31, None),
    }


@pytest.mark.timeout(30)
def test_demo_table_gives_a_small_models_sizes_in_a_unit_that_keeps_digits(monkeypatch, capsys):
    monkeypatch.delenv("FASTDDP_DEMO_LINK", raising=False)
    args = argparse.Namespace(steps=60, batch=16, probe_every=25)
    for fp32, int8, unit, shown in (
        (18176, 4736, "KB", ("18.18", "4.74")),  # printed "0.02" and "0.00" MB
        (16, 4, "B", ("16", "4")),
        (9_713_920, 2_500_000, "MB", ("9.71", "2.50")),  # the default model's, as before
    ):
        rows = [_row("fp32", fp32, None), _row("fastddp-int8-ef", int8, {29: 1e-2, 54: 3e-2})]
        demo._print_table(rows, args, 2, 29)
        out = capsys.readouterr().out
        assert f"payload {unit}/step" in out and f"sent {unit}/rank/step" in out, out
        cells = [[c.strip() for c in re.split(r"[│|]", line)] for line in out.splitlines()]
        payload = {c[1]: c[4] for c in cells if len(c) > 5 and c[3].endswith("x")}
        assert payload == {"fp32": shown[0], "fastddp-int8-ef": shown[1]}, out
    assert "2.43M parameters" in out, out
    demo._print_table([_row("fp32", 18176, None)], args, 2, 29)
    assert "4,544 parameters" in capsys.readouterr().out  # printed "0.00M"


def _rows(rank, world, args):
    return demo._run(rank, world, args), fastddp.CompressState(dtype="auto").trial_steps


@pytest.mark.timeout(120)
def test_demo_probes_every_row_on_the_same_steps_after_autos_trial():
    # auto's trial runs every candidate: int8-ef's deviation in a bf16 row, were it probed.
    args = argparse.Namespace(
        steps=40, batch=8, width=16, depth=1, inputs=8, outputs=4, lr=3e-4, probe_every=5,
        threads=1,
    )  # fmt: skip
    (rows, trial_steps), _ = run_ranks(_rows, 2, args)
    assert rows[-1]["mode"].startswith("fastddp-auto (") and "no plan" not in rows[-1]["mode"]
    assert rows[0]["deviations"] is None  # plain DDP: the exact average
    probed = [sorted(r["deviations"]) for r in rows[1:]]
    assert probed[0] and min(probed[0]) > trial_steps, (probed, trial_steps)
    assert all(p == probed[0] for p in probed), probed


def _replanning_auto(rank, world, steps):
    # Every check finds the step time moved, so auto plans again 6 steps after each plan (a
    # machine under load); and "none" wins every trial, whose gradient is the exact average.
    kept = auto.MARGIN, auto.CHECK_EVERY, auto.PLAIN_EDGE
    auto.MARGIN, auto.CHECK_EVERY, auto.PLAIN_EDGE = -1.0, 2, 100.0
    try:
        size = dict(batch=8, width=32, depth=2, inputs=16, outputs=8, lr=1e-3)
        args = argparse.Namespace(steps=steps, probe_every=1, **size)
        first = fastddp.CompressState(dtype="auto").trial_steps + 1
        return demo._train(demo.AUTO, args, rank, world, first), args, first
    finally:
        auto.MARGIN, auto.CHECK_EVERY, auto.PLAIN_EDGE = kept


@pytest.mark.timeout(120)
def test_demo_leaves_autos_re_trials_out_of_its_row(capsys):
    steps = 60
    row, args, first = run_ranks(_replanning_auto, 2, steps)[0]
    assert row["mode"] == "fastddp-auto (none)", row
    retried, after, dev = row["retrial"]
    # Re-trials ran the compressed candidates in turn: their probes deviate, and are left out.
    assert after == steps - first and 0 < retried < after, row
    assert dev is not None and dev > 1e-4, row
    devs = row["deviations"]
    assert len(devs) == after - retried and devs, row
    assert max(devs.values()) == 0.0, row  # steps under the plan of "none": exact
    demo._print_table([{**_row("fp32", row["payload"], None), "step_ms": 3.0}, row], args, 2, first)
    out = capsys.readouterr().out
    said = f"fastddp-auto (none): {retried} of its {after} steps after its plan ran in re-trials"
    assert said in out and f"deviated up to {dev:.2e}" in out, out
