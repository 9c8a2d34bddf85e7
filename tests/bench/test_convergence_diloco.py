"""python -m fastddp.bench convergence: DiLoCo's and post-local SGD's modes run on four ranks
split into two nodes (``--pretend-nodes 2``), every row's bytes count what a rank sends on the
wire, and a bad mode name is refused. The command runs in this process, its ranks on the
session's pooled ranks."""

import json
import math

import pytest

from fastddp.bench import cli, convergence, peers
from fastddp.hooks.topology import Topology
from fastddp.testing import spawn

from .._dist import pool

pytestmark = pytest.mark.multiproc

SMALL = ["--width", "16", "--layers", "1", "--heads", "2", "--seq", "8", "--batch", "2"]


def _rows(tmp_path, nproc: int, modes: list[str], *more: str) -> dict:
    """Each mode's row of a convergence run of 8 steps on ``nproc`` pooled ranks in 2 nodes."""
    out = tmp_path / "conv.json"
    args = ["--nproc", str(nproc), "--pretend-nodes", "2", *SMALL, "--steps", "8", *more]
    with spawn.pooled(pool):
        code = cli.main(["convergence", *args, "--eval-every", "4", "--max-factor", "1",
                         "--modes", *modes, "--json", str(out)])  # fmt: skip
    assert code == 0
    return {r["mode"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.timeout(240)
def test_diloco_and_post_local_sgd_rows(tmp_path):
    modes = ["fp32", "diloco-int8-ef-H4", "diloco-int8-ef-H4-overlap", "postlocal-H4"]
    rows = _rows(tmp_path, 4, modes)
    assert set(rows) == set(modes)
    for mode, r in rows.items():
        for key in ("seconds", "final_val_loss", "wire_mb", "cross_node_mb", "loss_vs_fp32"):
            assert math.isfinite(r[key]) and r[key] >= (0 if key != "loss_vs_fp32" else -1), mode
        # Checks land after the rounds (steps 4 and 8), where the nodes share their parameters.
        assert [c[0] for c in r["curve"]] == [4, 8][: len(r["curve"])], mode
        assert r["cross_node_mb"] > 0 and r["target"] == rows["fp32"]["target"], mode
        assert r["reached"] == (r["final_val_loss"] <= r["target"]), mode
    for mode in ("diloco-int8-ef-H4", "diloco-int8-ef-H4-overlap", "postlocal-H4"):
        assert rows[mode]["rounds_seconds"] is not None
    # One int8 round sends about a quarter of what one fp32 all-reduce of the model does.
    steps = rows["diloco-int8-ef-H4"]["steps"]
    fp32_step = rows["fp32"]["cross_node_mb"] / rows["fp32"]["steps"]
    assert rows["diloco-int8-ef-H4"]["cross_node_mb"] < fp32_step * steps / 4 * 0.5


@pytest.mark.timeout(240)
def test_a_node_of_one_rank_sends_nothing_inside_it(tmp_path, capsys):
    # Two ranks, each a node alone: their DDP inside the node reduces over one rank and sends
    # nothing, so every byte sent crosses nodes (one fp32 all-reduce of two ranks sends its
    # payload once). The table shows both columns.
    modes = ["fp32", "diloco-bf16-H4", "postlocal-H4"]
    rows = _rows(tmp_path, 2, modes)
    for mode in modes:
        assert rows[mode]["wire_mb"] == pytest.approx(rows[mode]["cross_node_mb"]), mode
    assert rows["diloco-bf16-H4"]["wire_mb"] < rows["fp32"]["wire_mb"] / 2
    out = capsys.readouterr().out
    assert "wire/rank" in out and "across nodes/rank" in out


def _ring(elements: int, ranks: int, itemsize: int = 4) -> float:
    # What each rank sends in a ring all-reduce: 2(n-1)/n of the message.
    return 2 * (ranks - 1) / ranks * elements * itemsize


@pytest.mark.timeout(240)
def test_every_row_counts_the_bytes_a_rank_sends_on_the_wire(tmp_path):
    # Four ranks in two nodes of two: an all-reduce over every rank sends 1.5 times its message
    # and one inside a node once, so a row that counted messages would stand apart.
    modes = ["fp32", "torch-fp16", "diloco-fp32-H4", "postlocal-H4"]
    rows = _rows(tmp_path, 4, modes)
    p, mb = rows["fp32"]["params"], 1e-6
    fp32 = rows["fp32"]
    assert fp32["wire_mb"] == pytest.approx(fp32["steps"] * _ring(p, 4) * mb)
    fp16 = rows["torch-fp16"]
    assert fp16["wire_mb"] == pytest.approx(fp16["steps"] * _ring(p, 4, 2) * mb)
    # DiLoCo: DDP inside the node every step; each round, its slice (half the model) averaged
    # across the two nodes, then the node's all-gather of the slices.
    diloco = rows["diloco-fp32-H4"]
    steps, rounds, half = diloco["steps"], diloco["steps"] // 4, p / 2
    assert diloco["cross_node_mb"] == pytest.approx(rounds * _ring(half, 2) * mb)
    expected = steps * _ring(p, 2) + rounds * (_ring(half, 2) + half * 4)
    assert diloco["wire_mb"] == pytest.approx(expected * mb)
    # Post-local SGD: over every rank in its warm-up, inside the node after, and each average
    # (at the multiples of H) over every rank.
    local = rows["postlocal-H4"]
    steps = local["steps"]
    warm = min(steps, peers.postlocal_warmup(2, 4))
    expected = (warm + steps // 4) * _ring(p, 4) + (steps - warm) * _ring(p, 2)
    assert local["wire_mb"] == pytest.approx(expected * mb)
    # An earlier run's JSON counted messages as "sent_mb": --fp32-from's row takes its bytes
    # from this run's probe instead.
    earlier = tmp_path / "earlier.json"
    data = json.loads((tmp_path / "conv.json").read_text())
    data["rows"] = [{**fp32, "sent_mb": fp32["steps"] * p * 4 * mb}]
    del data["rows"][0]["wire_mb"]
    earlier.write_text(json.dumps(data))
    again = _rows(tmp_path, 4, ["fp32"], "--fp32-from", str(earlier), "--fp32-probe", "3")
    assert "sent_mb" not in again["fp32"]
    assert again["fp32"]["wire_mb"] == pytest.approx(fp32["wire_mb"])
    assert again["fp32"]["cross_node_mb"] == pytest.approx(fp32["cross_node_mb"])


def test_per_step_rows_count_a_ring_over_every_rank():
    # Without processes: rank 1 of 2 nodes x 2 ranks, its ring neighbour (rank 2) on the other
    # node. fp32 and PyTorch's fp16 hook send 2(n-1)/n of their message a step.
    topo = Topology([11, 11, 22, 22], 1)
    p, steps = 1000, 3
    for mode, itemsize in (("fp32", 4), ("torch-fp16", 2)):
        wire, cross = convergence._bytes(mode, None, None, None, topo, p, steps)
        assert wire == cross == steps * _ring(p, 4, itemsize), mode


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mode, says",
    [
        ("diloco-int9-H20", "no preset 'int9'"),
        ("diloco-int8-ef", "is not of the form diloco-<preset>-H<n>"),
        ("postlocal-H1", "H must be at least 2"),
        ("localsgd-H20", "unknown mode 'localsgd-H20'"),
    ],
)
def test_bad_mode_is_refused(mode, says, capsys):
    # Refused by the command line's parser, before any rank starts.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convergence", "--modes", "fp32", mode])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --modes:" in err and says in err


def test_postlocal_averages_on_multiples_of_h():
    # PeriodicModelAverager averages when (step - warmup) % H == 0, counting from 0.
    for warmup, every in ((15, 20), (2, 4), (19, 20), (20, 20)):
        w = peers.postlocal_warmup(warmup, every)
        assert w >= warmup and (w + 1) % every == 0 and w - every < warmup


def test_periodic_mode_names():
    assert peers.parse("diloco-int8-ef-H20") == ("diloco", "int8-ef", 20, False)
    assert peers.parse("diloco-int4-ef-H40-overlap") == ("diloco", "int4-ef", 40, True)
    assert peers.parse("diloco-fp32-H10-overlap") == ("diloco", None, 10, True)
    assert peers.parse("postlocal-H20") == ("postlocal", None, 20, False)
    assert peers.parse("fastddp-int8") is None
