"""python -m fastddp.bench: the sweep's columns, JSON and plot, the DDP benchmark, --link."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import fastddp
from fastddp.bench import allreduce, cells, cli, common, ddp, report
from fastddp.bench import fsdp as fsdp_bench
from fastddp.bench import options as bench_options
from fastddp.hooks import auto
from fastddp.testing import slack, spawn

from .._dist import pool

pytestmark = pytest.mark.multiproc

BENCH = [sys.executable, "-m", "fastddp.bench"]


def _run(args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [*BENCH, *args]
    return slack.run(cmd, env=env, capture_output=True, text=True, timeout=slack.guard(timeout))


def _here(args, capsys, main=cli.main) -> subprocess.CompletedProcess:
    """``python -m fastddp.bench args`` (or another command's ``main``), run in this process
    with its ranks on the session's pooled ranks (test_allreduce_sweep_columns_json_and_plot
    runs the command itself)."""
    with spawn.pooled(pool):
        code = main(args)
    out = capsys.readouterr()
    sys.stdout.write(out.out)  # shown when the test fails
    sys.stderr.write(out.err)
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _refused(args, capsys) -> int:
    """The exit status of ``python -m fastddp.bench args``, run here, which must exit early."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    return exit_.value.code


def test_allreduce_sweep_columns_json_and_plot(tmp_path):
    out = tmp_path / "ar.json"
    png = tmp_path / "ar.png"
    args = [
        "allreduce",
        "--min-size",
        "64K",
        "--max-size",
        "1M",
        "--min-seconds",
        "0.05",
        "--max-iters",
        "5",
        "--json",
        str(out),
    ]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        png = None
    res = _run(args)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["world_size"] == 2
    # What the file needs to be read later: the command, every option, when and on what.
    assert data["command"] == "python -m fastddp.bench " + " ".join(args)
    assert data["options"]["max_iters"] == 5 and data["options"]["nproc"] == 2
    assert data["date"].startswith("20") and data["torch"] == torch.__version__
    # By default every mode but the presets with error feedback, which one message cannot show.
    modes = allreduce.MODES
    assert {"fastddp-bf16", "fastddp-bf16-acc", "fastddp-int8"} < set(modes)
    assert not [m for m in modes if m.endswith("-ef")]
    assert [r["size"] for r in rows[:: len(modes)]] == [65536, 262144, 1048576]
    assert [r["mode"] for r in rows[: len(modes)]] == modes
    for r in rows:
        t = r["time_us"] * 1e-6
        assert r["count"] * 4 == r["size"]
        assert r["algbw_gbs"] == pytest.approx(r["size"] / t / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["sent_bytes"] / t / 1e9)
        assert r["sent_bytes"] == r["payload_bytes"]  # 2(n-1)/n of the payload, n = 2
        assert r["cross_node_bytes"] == 0
        if r["mode"] == "noop":
            assert r["rel_err"] is None and r["payload_bytes"] == 0
            continue
        assert r["wrong"] == 0
        bound = {"float32": 0.0, "float16": 2**-11, "bfloat16": 2**-8, "int8": 2**-5}[r["type"]]
        assert r["rel_err"] <= bound, r
        if r["type"] == "int8":  # one byte per element plus a 4-byte scale per 128
            assert r["payload_bytes"] == r["count"] + r["count"] // 128 * 4
        else:
            assert r["payload_bytes"] == r["count"] * (4 if r["type"] == "float32" else 2)
        # The table shows the same figures.
        assert f"{r['time_us']:.1f}" in res.stdout
    if png is not None:
        assert png.stat().st_size > 10_000


def test_ddp_step_benchmark(tmp_path, capsys):
    out = tmp_path / "ddp.json"
    res = _here(
        ["ddp", "--params", "200000", "--steps", "3", "--warmup", "1", "--json", str(out)], capsys
    )
    assert res.returncode == 0, res.stderr
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp32", "torch-fp16", "fastddp-bf16", "fastddp-fp16", "noop"}
    assert rows["noop"]["exposed_comm"] == 0 and rows["fp32"]["vs_fp32"] == 1
    assert rows["fastddp-bf16"]["payload_bytes"] * 2 == rows["fp32"]["payload_bytes"]
    for r in rows.values():
        assert 0 < r["p50_ms"] <= r["p90_ms"]
    assert "exposed comm" in res.stdout
    assert f"{rows['fp32']['params'] / 1e6:.1f}M parameters" in res.stdout
    assert "1 node x 2 ranks" in res.stdout
    # The options recorded are the ones the mlp read; the transformer's are null.
    options = json.loads(out.read_text())["options"]
    assert options["params"] == 200_000 and options["layers"] is options["seq"] is None
    assert options["width"] == 316  # the width it fitted (sqrt of half the parameters)


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_ddp_times_powersgd_only_once_it_compresses(warmup):
    # PyTorch's PowerSGD all-reduces plainly for its first start_powerSGD_iter steps.
    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    assert ddp.untimed_steps("powersgd-r1", state, warmup) == max(warmup, 2)
    assert ddp.untimed_steps("fp32", None, warmup) == warmup


def test_ddp_peers_on_the_transformer(tmp_path, capsys):
    out = tmp_path / "ddp.json"
    small = ["--model", "transformer", "--width", "32", "--layers", "2", "--heads", "4"]
    modes = ["fp32", "powersgd-r1", "powersgd-r4", "fastddp-int8-ef", "fastddp-int8-ef-delay"]
    args = ["ddp", *small, "--seq", "16", "--steps", "2", "--warmup", "2", "--modes", *modes]
    res = _here([*args, "--json", str(out)], capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == set(modes) and data["model"] == "transformer"
    fp32 = rows["fp32"]["payload_bytes"]
    # PowerSGD sends P and Q of each large matrix, the rest as it is: more at rank 4.
    assert 0 < rows["powersgd-r1"]["payload_bytes"] < rows["powersgd-r4"]["payload_bytes"] < fp32
    assert 0 < rows["fastddp-int8-ef"]["payload_bytes"] < 0.3 * fp32
    # Delayed, the same bytes go a step later.
    assert (
        rows["fastddp-int8-ef-delay"]["payload_bytes"] == rows["fastddp-int8-ef"]["payload_bytes"]
    )
    assert f"transformer of {cells.millions([rows['fp32']])}" in res.stdout
    assert data["options"]["layers"] == 2 and data["options"]["params"] is None


def test_time_to_target(tmp_path, capsys):
    out = tmp_path / "conv.json"
    small = ["--width", "32", "--layers", "1", "--heads", "4", "--seq", "16", "--batch", "4"]
    modes = ["fp32", "fastddp-bf16", "powersgd-r1", "fastddp-auto"]
    args = ["convergence", *small, "--steps", "20", "--eval-every", "5", "--modes", *modes]
    res = _here([*args, "--json", str(out)], capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(modes)
    fp32 = rows["fp32"]
    assert fp32["reached"] and fp32["steps"] == 20 and fp32["vs_fp32"] == 1
    first = next(c for c in fp32["curve"] if c[2] <= fp32["target"])
    assert fp32["steps_to_target"] == first[0] <= 20
    assert fp32["target"] == pytest.approx(fp32["final_val_loss"] * 1.01)
    for r in rows.values():
        # Every run stops at the target or at the limit (2 x 20 steps), and says which.
        assert r["reached"] == (r["final_val_loss"] <= fp32["target"])
        assert r["steps"] <= 40 and r["curve"][-1][0] == r["steps"]
        # Times are the slowest rank's, the curve's too: a run stops at the target.
        assert r["curve"][-1][1] == r["seconds"]
        assert r["seconds_to_target"] in (None, r["seconds"]) or r["mode"] == "fp32"
        assert [c[0] for c in r["curve"]][:2] == [5, 10]
    per_step = {m: r["wire_mb"] / r["steps"] for m, r in rows.items()}
    assert per_step["powersgd-r1"] < per_step["fastddp-bf16"] < per_step["fp32"]
    assert "time to target" in res.stdout
    # auto's row names its plan, in the JSON and the table (or that it stopped at the target
    # inside its trial, with none yet); no other row has one.
    chose = rows["fastddp-auto"]["chose"]
    assert chose is None or chose in auto.DEFAULT_ALLOW or chose.startswith("mixed ("), chose
    assert f"fastddp-auto ({chose or 'in its trial'})" in res.stdout
    assert all(r["chose"] is None for m, r in rows.items() if m != "fastddp-auto")


def test_fsdp_step_benchmark(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    small = ["--width", "32", "--layers", "2", "--heads", "4", "--seq", "16"]
    modes = ["fp32", "torch-bf16", "a2a-fp32", "fastddp-bf16", "fastddp-fp16", "fastddp-int8"]
    modes += ["hsdp", "hybrid-bf16-acc", "hybrid-int8-ef", "fp32+qag", "hybrid-int8-ef+qag"]
    args = ["fsdp", *small, "--steps", "2", "--warmup", "1", "--json", str(out)]
    res = _here([*args, "--modes", *modes], capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(modes)
    # The default runs every mode: each family has one here.
    assert set(fsdp_bench.MODES) >= set(modes) and len(fsdp_bench.MODES) == 15
    # On one node HSDP is plain sharding (its all-reduce spans one node), and hybrid adds
    # nothing: the same gradients as fp32, bit for bit or in another summing order.
    for mode in ("hsdp", *(m for m in rows if m.startswith("hybrid-") and "+" not in m)):
        assert rows[mode]["grad_rel_err"] < 1e-6, mode
        assert rows[mode]["link_bytes_per_step"] is None, mode
    # int8 parameters move the gradients a little, alike whatever reduces them.
    for mode in (m for m in rows if m.endswith("+qag")):
        assert 1e-6 < rows[mode]["grad_rel_err"] < 0.1, mode
    assert rows["hsdp"]["vs_hsdp"] == 1
    assert rows["fp32"]["vs_fp32"] == 1 and rows["fp32"]["grad_rel_err"] is None
    assert rows["a2a-fp32"]["grad_rel_err"] < 1e-6  # an exact fp32 sum, another order
    # fastddp counts its own bytes: half of the fp32 all-to-all's (a bit more for the padding
    # FSDP2 adds to each parameter), a quarter and a bit for int8 with its scales.
    a2a = rows["a2a-fp32"]["rs_sent_bytes"]
    assert 0.45 * a2a < rows["fastddp-bf16"]["rs_sent_bytes"] < 0.55 * a2a
    assert 0.2 * a2a < rows["fastddp-int8"]["rs_sent_bytes"] < 0.3 * a2a
    for mode in ("fastddp-bf16", "fastddp-fp16", "torch-bf16"):
        assert 0 < rows[mode]["grad_rel_err"] < 1e-2, mode
    for r in rows.values():
        assert 0 < r["p50_ms"] <= r["p90_ms"]
    assert "sent/step" in res.stdout and "vs hsdp" in res.stdout


def test_allreduce_counts_what_a_two_level_reduction_sends(tmp_path):
    # 2 pretend nodes of 2 ranks: a ring in rank order crosses nodes twice; the two-level
    # reduction's bytes are fastddp's own count per call, not a ring's.
    out = tmp_path / "ar.json"
    args = ["allreduce", "--nproc", "4", "--pretend-nodes", "2", "--min-size", "64K"]
    args += ["--max-size", "64K", "--min-seconds", "0", "--max-iters", "1", "--json", str(out)]
    res = _run([*args, "--modes", "fp32", "fastddp-bf16", "--topologies", "flat", "hierarchical"])
    assert res.returncode == 0, res.stderr
    assert "all-reduce, 4 ranks, gloo on cpu, 2 nodes" in res.stdout
    data = json.loads(out.read_text())
    assert data["nodes"] == 2
    rows = {r["mode"]: r for r in data["rows"]}
    ring = 2 * 3 * 65536 // 4  # 2(n-1)/n of the payload, n = 4
    assert rows["fp32"]["sent_bytes"] == ring and rows["fp32"]["cross_node_bytes"] == 2 * ring
    flat, hier = rows["fastddp-bf16/flat"], rows["fastddp-bf16/hier"]
    assert flat["cross_node_bytes"] == rows["fp32"]["cross_node_bytes"] // 2
    assert hier["topology"] == "hierarchical" and flat["topology"] == "flat"
    # Each rank all-reduces its node's shard (16384 / 2 elements in bf16) with its peer on
    # the other node: a ring of 2 sends the whole shard once.
    assert hier["cross_node_bytes"] == 4 * (16384 // 2) * 2
    assert hier["sent_bytes"] != flat["sent_bytes"]


def test_allreduce_of_the_packed_codes(tmp_path):
    # One call with error feedback: a step of int4's and int2's blocks is the bound.
    out = tmp_path / "ar.json"
    args = ["allreduce", "--min-size", "4K", "--max-size", "4K", "--min-seconds", "0"]
    args += [
        "--max-iters",
        "2",
        "--modes",
        "fastddp-int4-ef",
        "fastddp-int2-ef",
        "--json",
        str(out),
    ]
    res = _run(args)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["payload_bytes"], r["wrong"]) for r in rows] == [(512 + 8 * 4, 0), (256 + 8 * 4, 0)]


def test_sizes_and_counts_read_as_their_help_writes_them():
    assert [common.parse_size(s) for s in ("64K", "1.5M", "100")] == [65536, 1572864, 100]
    assert [common.count(s) for s in ("25M", "100K", "7")] == [25_000_000, 100_000, 7]
    assert cli._parser().parse_args(["ddp", "--params", "2M"]).params == 2_000_000
    # A model too small for millions is counted, not printed as "0.0M".
    assert cells.millions([{"params": 1_090}]) == "1,090 parameters"
    assert [cells.size(n) for n in (366_000, 1_500, 0)] == ["0.4 MB", "1.5 kB", "0.0 kB"]


def test_the_help_lists_what_each_benchmark_takes(capsys):
    # Without a benchmark, the error names them all; --plot and --topologies are listed only
    # where they apply (and still refused by name elsewhere).
    parser = cli._parser()
    with pytest.raises(SystemExit):
        parser.parse_args([])
    listed = capsys.readouterr().err.rsplit("required: ", 1)[1].strip()
    assert listed == "{" + ",".join(parser.commands) + "}", listed
    for name, command in parser.commands.items():
        shown = command.format_help()
        assert ("--plot" in shown) == (name == "allreduce"), name
        assert ("--topologies" in shown) == (name in ("allreduce", "ddp")), name


@pytest.mark.parametrize(
    "args,message",
    [
        (["allreduce", "--factor", "1"], "--factor must be at least 2"),
        (["allreduce", "--modes", "noop", "--plot", "x.png"], "keep fp32 in --modes"),
        (["ddp", "--nproc", "0"], "--nproc must be at least 1"),
        (["ddp", "--nodes", "2"], "--nodes needs --link"),
        (["ddp", "--link", "1gbit", "--nodes", "0"], "--nodes must be at least 1"),
        (["ddp", "--topologies", "ring"], "invalid choice: 'ring'"),
        (["fsdp", "--width", "30", "--heads", "4"], "--width 30 must be a multiple of --heads 4"),
        (["fsdp", "--seq", "2000"], "--seq must be at most 1024"),
        (["fsdp", "--layers", "0"], "--layers must be at least 1"),
        (["ddp", "--model", "transformer", "--width", "30"], "must be a multiple of --heads 8"),
        (["ddp", "--params", "25x"], "argument --params: invalid count value: '25x'"),
        (["convergence", "--fp32-from", "/nonexistent/x.json"], "x.json: No such file"),
        (["convergence", "--fp32-from", __file__], "not the --json of a convergence run"),
        (["allreduce", "--json", "/tmp"], "--json /tmp is a folder; name a file in it"),
        # A folder that looks writable (to root, all do) holding a file that cannot be made.
        (["allreduce", "--json", "/proc/x.json"], "x.json: cannot be written (its folder takes no"),
        (
            ["allreduce", "--plot", "/tmp/x.pdfx"],
            "matplotlib cannot write .pdfx files; end the name",
        ),
        (
            ["allreduce", "--json", "/tmp/o.png", "--plot", "/tmp/o.png"],
            "--plot and --json name the same",
        ),
        (["ddp", "--params", "-5"], "--params must be at least 1"),
        (["ddp", "--warmup", "-1"], "--warmup must be at least 0"),
        (["ddp", "--bucket-cap-mb", "-1"], "--bucket-cap-mb must be a positive, finite number"),
        (["allreduce", "--max-iters", "0"], "--max-iters must be at least 1"),
        (["convergence", "--max-factor", "0"], "--max-factor must be at least 1"),
        (["convergence", "--slack", "-1"], "--slack must be at least 0"),
        (["ddp", "--plot", "x.png"], "--plot draws the allreduce sweep; ddp writes --json"),
        # (not first told to add a suffix, then refused for the plot itself)
        (["hook-cost", "--plot", "x"], "--plot draws the allreduce sweep; hook-cost writes"),
        (["ddp", "--nproc-per-node", "3"], "--nproc-per-node needs --link"),
        (["ddp", "--link="], "--link needs a rate"),
        (["ddp", "--link", "foo"], "--link foo: give a positive rate in bits per second"),
        (["ddp", "--link", "20000000tbit"], "from 8bit to 10000000tbit (1gbit, 100mbit)"),
        (["fsdp", "--topologies", "flat"], "--topologies applies to allreduce and ddp"),
        (["hook-cost", "--modes", "fp32", "fp32"], "--modes names one twice"),
        (["allreduce", "--topologies", "flat", "flat"], "--topologies names one twice"),
        (["ddp", "--params", "infM"], "argument --params: invalid count value: 'infM'"),
        (["allreduce", "--min-size", "infK"], "--min-size infK: give bytes"),
        (["ddp", "--params", "1M", "--width", "1"], "is 500000 layers (at most 1024)"),
        (["ddp", "--params", "100K", "--width", "1024"], "is less than half of one layer"),
        (["ddp", "--layers", "3"], "--layers sizes the transformer (--model transformer)"),
        (["ddp", "--model", "transformer", "--params", "5M"], "--params sizes the mlp"),
        (["convergence", "--lr", "nan"], "--lr must be a finite number"),
        (["fsdp", "--lr", "-1"], "--lr must be positive"),
        (["convergence", "--max-factor", "inf"], "--max-factor must be a finite number"),
        (["convergence", "--fp32-probe", "5"], "--fp32-probe times fp32 in place of an earlier"),
        (["ddp", "--json", ""], "--json needs a file name"),
        (["ddp", "--pretend-nodes", "3"], "--pretend-nodes splits the spawned --nproc ranks"),
        (["hook-cost", "--modes", "torch-fp16"], "hook-cost measures each hook against plain"),
        (["ddp", "--pretend-nodes", "-1"], "--pretend-nodes must be at least 1"),
        # Another benchmark's option: the subcommand's usage, not the top level's.
        (["hook-cost", "--pretend-nodes", "2"], "hook-cost: error: unrecognized arguments: --p"),
        (["ddp", "--link", "1gbit", "--nproc", "4"], "--nproc sets the spawned ranks; with --l"),
        (["allreduce", "--link", "1gbit", "--threads", "2"], "--threads sets the spawned ranks"),
        (["ddp", "--modes", "fp32", "--topologies", "flat"], "--modes names none"),
        (
            [
                "convergence",
                "--pretend-nodes",
                "2",
                "--modes",
                "diloco-bf16-H2",
                "--outer-momentum",
                "1.5",
            ],
            "--outer-momentum must be in [0, 1), got 1.5",
        ),  # fmt: skip
        (
            ["convergence", "--pretend-nodes", "2", "--modes", "diloco-fp32-H2", "--outer-lr", "0"],
            "--outer-lr must be a positive, finite number",
        ),
        # Read by DiLoCo alone: without a diloco mode it would be accepted and left unread.
        (
            ["convergence", "--pretend-nodes", "2", "--modes", "postlocal-H2", "--outer-lr", "1"],
            "--outer-lr sets DiLoCo's outer step, and --modes names no diloco mode",
        ),
        (["convergence", "--outer-momentum", "0.5"], "--outer-momentum sets DiLoCo's outer step"),
        (["convergence", "--modes", "postlocal-H2"], "one node, where it is plain DDP"),
        # matplotlib would write c.png, which no check had looked at (the --json, say).
        (["allreduce", "--plot", "c"], "--plot c: end the name with the image's suffix"),
        # More than any rank could hold (64G for 64M): refused, not a traceback per rank or
        # the kernel's OOM killer.
        (["allreduce", "--max-size", "64G"], "--max-size 64G: the 2 rank(s) on this machine"),
        (
            ["ddp", "--params", "20G", "--width", "8192"],
            "--params 20000000000: the 2 rank(s) on this machine",
        ),
        (
            ["fsdp", "--width", "65536", "--layers", "64"],
            "would hold at least 26389.4 GB, and it has 24.0 GB",
        ),
        (["hook-cost", "--width", "200000", "--layers", "1"], "--width 200000 --layers 1: the"),
        # (seed * 100_003 overflowed int64 in every rank)
        (["convergence", "--seed", "200000000000000"], "give a seed from 0 to 2^31 - 1"),
    ],
)
def test_bad_options(args, message, capsys, monkeypatch):
    # Refused by the command line's checks, before any rank starts: run in this process (on a
    # machine of 24 GB available, whatever this one has).
    monkeypatch.setattr(bench_options, "_available_bytes", lambda: 24 * 10**9)
    assert _refused(args, capsys) == 2 and message in capsys.readouterr().err


def _checked(argv):
    """The options of ``python -m fastddp.bench argv`` as its checks leave them."""
    p = cli._parser()
    args, unknown = p.parse_known_args(argv)
    assert not unknown
    bench_options.check(p.commands[args.what], args)
    return args


@pytest.mark.parametrize(
    "argv",
    [
        ["ddp", "--nproc", "4"],
        ["hook-cost", "--threads", "3"],
        ["allreduce", "--nodes", "3"],
        ["ddp", "--nproc-per-node", "5"],
        ["allreduce", "--link", "1gbit"],
    ],
    ids=lambda argv: argv[1],
)
def test_options_that_start_ranks_are_refused_under_a_launcher(argv, monkeypatch, capsys):
    # They were left unread and recorded in --json as if the run had used them.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv(report.OPTIONS_ENV, raising=False)
    assert _refused(argv, capsys) == 2
    err = capsys.readouterr().err
    assert f"{argv[1]} says which ranks this command starts, and a launcher started it" in err
    # A --link run's node is started by its launcher with the caller's --nproc-per-node.
    monkeypatch.setenv(report.OPTIONS_ENV, "{}")
    assert _checked(["ddp", "--nproc-per-node", "2"]).nproc_per_node == 2


def test_the_options_json_records_are_those_the_run_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_options, "_available_bytes", lambda: 10**13)
    assert _checked(["ddp", "--model", "transformer"]).width == 512  # was None
    assert _checked(["ddp"]).nproc_per_node == 1
    # The mlp's layers are capped at the width it fits too, not only at a width given.
    assert _refused(["ddp", "--params", "4.4G"], capsys) == 2
    err = capsys.readouterr().err
    assert "--params 4400000000 at --width 2048 is 1049 layers (at most 1024): give a " in err
    assert "larger --width\n" in err, err  # (not "or leave it out": it was)
    # An input of the run named as its output: the earlier run's JSON would be overwritten.
    earlier = tmp_path / "c.json"
    earlier.write_text("{}")
    assert _refused(["convergence", "--fp32-from", str(earlier), "--json", str(earlier)], capsys)
    assert "--json and --fp32-from name the same file" in capsys.readouterr().err


def test_pretend_nodes_that_do_not_divide_a_launchers_ranks_are_refused(monkeypatch, capsys):
    # Under a launcher (its variables): the split is of WORLD_SIZE, checked as the spawned one.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _refused(["allreduce", "--pretend-nodes", "3"], capsys) == 2
    err = capsys.readouterr().err
    assert "--pretend-nodes 3 splits the launcher's 2 ranks unevenly; give a divisor" in err


def test_a_figure_that_is_not_finite_is_written_as_null(tmp_path, capsys):
    # Strict JSON has no NaN: a diverged run's loss is null, and a warning names it.
    out = tmp_path / "r.json"
    report.write_json(out, {"rows": [{"mode": "fp32", "loss": 1.5}, {"loss": float("nan")}]})
    assert json.loads(out.read_text())["rows"][1] == {"loss": None}
    assert "not finite (a run diverged?), written as null: rows[1].loss = nan" in (
        capsys.readouterr().err
    )


def test_an_fp32_curve_of_another_run_is_refused(tmp_path, capsys):
    # The earlier run's JSON records its options: a curve of another model or other steps
    # would be timed here as if it were this run's.
    earlier = tmp_path / "earlier.json"
    row = {"mode": "fp32", "curve": [[5, 0.1, 3.0]], "steps": 20, "params": 51776}
    options = {"width": 32, "layers": 1, "heads": 4, "steps": 20}
    earlier.write_text(json.dumps({"world_size": 2, "options": options, "rows": [row]}))
    args = ["convergence", "--fp32-from", str(earlier), "--heads", "4", "--steps", "20"]
    assert _refused([*args, "--width", "64", "--layers", "2"], capsys) == 2
    err = capsys.readouterr().err
    assert "ran with --width 32 (here 64), --layers 1 (here 2)," in err, err
    assert "a model of 51776 parameters (here 178016)" in err, err
    assert _refused([*args, "--width", "32", "--layers", "1", "--nproc", "4"], capsys) == 2
    assert "2 ranks (here 4)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert _refused(["allreduce", "--device", "cuda"], capsys) == 2
    assert "--device cuda, but no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.netns
def test_allreduce_over_a_two_node_link(tmp_path):
    out = tmp_path / "link.json"
    res = _run(
        [
            "allreduce",
            "--link",
            "1gbit",
            "--min-size",
            "256K",
            "--max-size",
            "256K",
            "--modes",
            "fp32",
            "fastddp-bf16",
            "--min-seconds",
            "0.2",
            "--json",
            str(out),
        ]
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["nodes"] == 2 and data["world_size"] == 2
    assert "2 nodes" in res.stdout
    # The options it was given, not its nodes' (which run without --link and --nodes).
    assert data["options"]["link"] == "1gbit" and data["options"]["min_size"] == "256K"
    assert data["options"]["nodes"] == 2  # --link's default, not null


@pytest.mark.netns
def test_ddp_over_two_nodes_of_two_ranks_flat_and_hierarchical(tmp_path):
    out = tmp_path / "ddp.json"
    args = ["ddp", "--link", "1gbit", "--nodes", "2", "--nproc-per-node", "2"]
    args += ["--params", "300000", "--steps", "2", "--warmup", "1", "--json", str(out)]
    args += ["--bucket-cap-mb", "0.5"]  # several buckets, so stages of different ones overlap
    args += ["--modes", "fp32", "fastddp-bf16-acc", "--topologies", "flat", "hierarchical"]
    res = _run(args)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["world_size"], data["nodes"]) == (4, 2)
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"fp32", "fastddp-bf16-acc/flat", "fastddp-bf16-acc/hier"}
    assert rows["fastddp-bf16-acc/flat"]["topology"] == "flat"
    assert rows["fastddp-bf16-acc/hier"]["topology"] == "hierarchical"
    # Cross-node bytes per step, all ranks: fp32 ring > flat all-to-all > two-level.
    cross = [rows[m]["cross_node_bytes"] for m in rows]
    assert cross[0] > cross[1] > cross[2] > 0
    assert "2 nodes x 2 ranks" in res.stdout


@pytest.mark.netns
def test_fsdp_over_two_nodes_of_two_ranks_native_and_hybrid(tmp_path):
    out = tmp_path / "fsdp.json"
    args = ["fsdp", "--link", "1gbit", "--nodes", "2", "--nproc-per-node", "2"]
    args += ["--width", "64", "--layers", "2", "--heads", "4", "--seq", "16"]
    args += ["--steps", "2", "--warmup", "1", "--json", str(out)]
    res = _run([*args, "--modes", "fp32", "hsdp", "hybrid-bf16-acc", "hybrid-int8-ef"])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    # What the link carried per step: sharding over both nodes all-gathers across the link;
    # HSDP sends only its fp32 all-reduce, hybrid the same compressed.
    link = {m: r["link_bytes_per_step"] for m, r in rows.items()}
    assert link["fp32"] > link["hsdp"] > link["hybrid-bf16-acc"] > link["hybrid-int8-ef"] > 0
    assert rows["hsdp"]["grad_rel_err"] < 1e-6
    assert 0 < rows["hybrid-bf16-acc"]["grad_rel_err"] < 1e-2
    assert "2 nodes x 2 ranks" in res.stdout


def _script(name, args, tmp_path, capsys):
    """``python benchmarks/<name>.py args --json F``, run here with the ranks it spawns on the
    session's pooled ranks (as :func:`_here`): F's data and what it printed."""
    out = tmp_path / f"{name}.json"
    # By its package name, which the pooled ranks import too (the repository is on sys.path).
    module = importlib.import_module(f"benchmarks.{name}")
    res = _here([*args, "--json", str(out)], capsys, main=module.main)
    code = res.returncode
    assert code in (None, 0) or not isinstance(code, int), f"exit {code}: {res.stderr[-3000:]}"
    return json.loads(out.read_text()), res.stdout


def test_accuracy_study_runs_and_shows_fp32_accumulation(tmp_path, capsys):
    data, stdout = _script("accuracy", ["--worlds", "4", "--trials", "1"], tmp_path, capsys)
    errs = data["rel_err"]["4"]
    assert errs["bf16-acc"] < errs["bf16"]
    assert errs["fp16-acc"] < errs["fp16"]
    assert errs["int8-ef, mean of 32 steps"] < errs["int8"] / 5
    assert errs["int8 wire bytes / fp32"] <= 0.27
    fsdp = "FSDP2 reduce-scatter, "
    assert errs[fsdp + "fastddp-bf16"] < errs[fsdp + "torch bf16 reduce_dtype"]
    assert errs[fsdp + "fastddp-fp16"] < errs[fsdp + "fastddp-bf16"]
    assert "4 ranks" in stdout


def test_link_sweep_on_loopback(tmp_path, capsys):
    args = ["--rates", "loopback", "--modes", "fp32", "fastddp-bf16", "powersgd-r1", "fastddp-auto"]
    args += ["--width", "32", "--layers", "1", "--steps", "2", "--warmup", "2"]
    data, stdout = _script("link_sweep", [*args, "--bucket-cap-mb", "0.01"], tmp_path, capsys)
    rows = data["rows"]["loopback"]
    assert set(rows) == {"fp32", "fastddp-bf16", "powersgd-r1", "fastddp-auto"}
    # Enough to run it again: its own options, and each rate's job's record.
    assert data["options"]["width"] == 32 and data["command"][0] == "benchmarks/link_sweep.py"
    job = data["jobs"]["loopback"]
    assert job["options"]["width"] == 32 and job["date"] and job["torch"]
    assert all(r["world_size"] == 2 and r["nodes"] == 1 for r in rows.values())
    assert rows["fp32"]["vs_fp32"] == 1
    # auto is timed after its plan, and says what it chose.
    chose = rows["fastddp-auto"]["chose"]
    assert chose in auto.DEFAULT_ALLOW or chose.startswith("mixed ("), chose
    # A topology, the chosen candidate's (none for "none" or a mixed plan), not a mode.
    want = "flat" if chose in auto.DEFAULT_ALLOW and chose != "none" else None
    assert rows["fastddp-auto"]["topology"] == want, rows["fastddp-auto"]
    assert "(chose)" in stdout
    assert "fastddp-bf16" in stdout and "loopback" in stdout
    cross = data["crossover"]["loopback"]
    ours = min(["fastddp-bf16", "fastddp-auto"], key=lambda m: rows[m]["p50_ms"])
    assert cross["fastddp"] == ours and cross["powersgd"] == "powersgd-r1"
    assert cross["ratio"] == rows[ours]["p50_ms"] / rows["powersgd-r1"]["p50_ms"]
    assert f"fastddp's fastest {ours}" in stdout
    # auto against the best of fp32 and fastddp's fixed modes (PowerSGD is not one)
    best = min(["fp32", "fastddp-bf16"], key=lambda m: rows[m]["p50_ms"])
    ratio = rows["fastddp-auto"]["p50_ms"] / rows[best]["p50_ms"]
    assert data["auto_vs_best_fixed"]["loopback"] == {"best": best, "ratio": ratio}
    assert f"{ratio:.2f}x" in stdout.split("auto / best fixed")[1].splitlines()[0]


def test_link_sweep_in_rounds_keeps_each_modes_median_job(tmp_path, capsys):
    args = ["--rates", "loopback", "--modes", "fp32", "--rounds", "2"]
    args += ["--nproc-per-node", "2"]  # on loopback, 4 ranks
    args += ["--width", "32", "--layers", "1", "--steps", "2", "--warmup", "2"]
    data, stdout = _script("link_sweep", [*args, "--bucket-cap-mb", "0.01"], tmp_path, capsys)
    row = data["rows"]["loopback"]["fp32"]
    # Two jobs; of two, the faster one speaks for the mode.
    assert len(row["jobs_p50_ms"]) == 2 and row["p50_ms"] == min(row["jobs_p50_ms"])
    assert row["world_size"] == 4 and row["vs_fp32"] == 1
    assert "parameters, 4 ranks\n" in stdout


@pytest.mark.parametrize("bad", [["--rounds", "-1"], ["--nproc-per-node", "0"]])
def test_link_sweep_refuses_bad_rounds_and_ranks(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        _module("link_sweep").main(["--modes", "fp32", *bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "give --rounds 0 (every mode in one job) or more" in err


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--rates", "loopback", "1gbitt"], "--rates 1gbitt: give tc rates"),
        (["--json", "/nonexistent/x.json"], "the folder /nonexistent does not exist"),
        (["--plot", "/tmp"], "--plot /tmp is a folder"),
        (["--plot", "/tmp/sweep.pdfx"], "matplotlib cannot write .pdfx files"),
        (["--modes", "fp32", "bogus"], "argument --modes: invalid choice: 'bogus'"),
    ],
)
def test_link_sweep_refuses_what_would_fail_after_its_runs(bad, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _module("link_sweep").main(["--modes", "fp32", *bad])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_link_sweep_stops_the_whole_job_past_its_timeout(tmp_path):
    # A job's ranks are its children: stopping the first process alone left them running.
    pid = tmp_path / "pid"
    # The job sleeps far past the hang guard below, so that only the stop ends it in time.
    child = f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); time.sleep(900)"
    job = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(900)"
    )
    started = time.monotonic()
    with pytest.raises(SystemExit, match="the job at 1gbit ran past --timeout 5 s and was stopped"):
        _module("link_sweep")._run([sys.executable, "-c", job], 5, "1gbit")
    assert time.monotonic() - started < slack.guard(30)
    assert pid.exists()
    gone = Path(f"/proc/{pid.read_text()}")
    for _ in range(50):  # (reaped by init a moment later)
        if not gone.exists() or "Z" in (gone / "stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the job's child still runs")


def test_convergence_run_runs(tmp_path, capsys):
    data, stdout = _script("convergence", ["--steps", "30"], tmp_path, capsys)
    base = data["fp32"]
    assert len(base["losses"]) == 30 and base["losses"][-1] < base["first"]
    for name in ("bf16", "int8", "int8-ef"):
        assert abs(data[name]["eval"] / base["eval"] - 1) < 0.05, name
    assert "vs fp32" in stdout


def test_soak_sees_no_growth_and_would_see_it(tmp_path, capsys):
    args = ["--steps", "200", "--every", "100", "--width", "128"]
    data, stdout = _script("soak", args, tmp_path, capsys)
    assert "no growth after step 100 on any rank" in stdout
    for results in data["ranks"]:
        assert set(results) == {*fastddp.PRESETS, "int8-ef+sr"}
        for result in results.values():
            assert [r["step"] for r in result["records"]] == [100, 200]
            assert result["records"][0]["allocations"] > 0 and not result["problems"]
    # The check itself: growth of each kind is reported.
    soak = _module("soak")

    base = {"step": 100, "rss_mb": 300.0, "allocations": 2, "fds": 13, "threads": 5}
    grown = [base, {**base, "step": 200, "rss_mb": 320.0, "allocations": 3, "fds": 14}]
    problems = soak._growth(grown, slack_mb=8)
    assert len(problems) == 3 and any("resident memory" in p for p in problems), problems
    # Up and down within the slack is not growth; a rise from the lowest record is.
    wobble = [base, {**base, "step": 200, "rss_mb": 306.0}, {**base, "step": 300}]
    assert soak._growth(wobble, slack_mb=8) == []
    rise = [*wobble, {**base, "step": 400, "rss_mb": 309.0}]
    assert len(soak._growth(rise, slack_mb=8)) == 1


def _module(name):
    """The module of ``benchmarks/<name>.py``."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rotation_benchmark_rotates_and_measures(tmp_path):
    rotation = _module("rotation")
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(0))
    y = rotation.hadamard(x, 128)
    assert torch.allclose(rotation.hadamard(y, 128), x, atol=1e-5)  # its own inverse
    assert torch.allclose(y.norm(), x.norm()) and not torch.allclose(y, x)
    spike = torch.zeros(128)
    spike[5] = 1.0  # an outlier spreads evenly over its block
    assert torch.allclose(rotation.hadamard(spike, 128).abs(), torch.full((128,), 128**-0.5))
    assert rotation.main(["--steps", "0", "--json", str(tmp_path / "r.json")]) == 0
    errors = json.loads((tmp_path / "r.json").read_text())["rows"][0]["errors"]
    assert 0 < errors["int8/128/plain"] < errors["int4/128/plain"] < errors["int2/128/plain"] < 1


@pytest.mark.launcher
def test_hook_overhead_times_each_hook_after_autos_plan(tmp_path):
    out = tmp_path / "hook_overhead.json"
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["benchmarks/hook_overhead.py", "--rounds", "2", "--steps", "2", "--width", "64"]
    cmd += ["--depth", "2", "--bucket-cap-mb", "0.01", "--json", str(out)]
    root = Path(__file__).resolve().parents[2]
    res = slack.run(cmd, capture_output=True, text=True, timeout=slack.guard(240), cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2
    kinds = {"builtin", "allreduce_hook", "auto-none", "auto-4-none", "auto-4-cpp"}
    assert set(data["ms"]) == kinds
    assert all(ms > 0 for ms in data["ms"].values())
    assert "auto-4-none" in res.stdout and "x" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-size", "64X"], "--min-size 64X: give bytes, or a number with K, M or G"),
        (["--max-size", "2"], "--max-size 2: give bytes, or a number with K, M or G"),
        (["--min-size", "1M", "--max-size", "64K"], "--min-size 1M is above --max-size 64K"),
        (["--json", "no/such/folder/x.json"], "--json no/such/folder/x.json: the folder"),
        (["--plot", "no/such/folder/x.png"], "--plot no/such/folder/x.png: the folder"),
    ],
)
def test_bad_sizes_and_unwritable_outputs_are_refused_before_the_sweep(args, message, capsys):
    assert _refused(["allreduce", *args], capsys) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    ["accuracy", "convergence", "exit_check", "gpt_auto", "gpu_bandwidth", "gpu_step_cost",
     "gpu_step_profile", "hook_overhead", "link_sweep", "process_cpu", "restart_stress",
     "rotation", "soak", "trial_noise"],
)  # fmt: skip
def test_every_script_refuses_an_output_it_could_not_write_before_it_runs(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--json", "/nonexistent/folder/x.json"])
    assert e.value.code == 2
    assert "--json /nonexistent/folder/x.json: the folder" in capsys.readouterr().err


def test_allreduce_sizes_are_whole_float32_elements():
    # What is reduced and timed: a row's size (and its algbw) must not count a part element.
    args = argparse.Namespace(min_size="7", max_size="30", factor=2)
    assert allreduce.message_sizes(args) == [4, 12, 28]


def test_native_modes_are_refused_where_the_native_runner_is_off(capsys, monkeypatch):
    # Their hooks would run in Python, in rows that say the native runner.
    monkeypatch.setenv("FASTDDP_NATIVE", "0")
    args = ["hook-cost", "--modes", "fp32", "fastddp-bf16-native"]
    assert _refused(args, capsys) == 2
    assert "FASTDDP_NATIVE=0 turns the native runner off" in capsys.readouterr().err
