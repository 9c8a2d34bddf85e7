"""The one table of named modes: each preset's state, overrides, unknown names, and the names
the benchmarks and examples offer (taken from the table, so they cannot drift apart)."""

import argparse
import importlib.util
import os
from pathlib import Path

import pytest
import torch

import fastddp
from fastddp.bench import cli
from fastddp.codecs import CODECS
from fastddp.hooks.presets import PRESETS, preset

from .._dist import run_ranks
from .._references import _resume_rank

ROOT = Path(__file__).resolve().parents[2]
# What a state holds for a setting a preset leaves out.
DEFAULTS = {"accumulate_dtype": None, "error_feedback": False, "stochastic_rounding": False}


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_builds_the_state_its_table_row_says(name):
    state = fastddp.CompressState.from_preset(name)
    want = {**DEFAULTS, **PRESETS[name]}
    if CODECS[want["dtype"]].blocks is not None:
        want["accumulate_dtype"] = torch.float32  # block-scaled codes are summed in fp32
    for key, value in want.items():
        assert getattr(state, key) == value, (name, key)
    assert state.process_group is None and state.topology == "auto"
    # The name says it: -acc sums in fp32, -ef keeps residuals, the rest is the wire dtype.
    assert (state.accumulate_dtype == torch.float32) == ("-acc" in name or name.startswith("int"))
    assert state.error_feedback == name.endswith("-ef")
    wire = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
    wire.update({"int4": torch.int4, "int2": torch.int2})
    assert state.dtype == wire[name[:4]]


def test_overrides_go_on_top_of_the_preset():
    state = fastddp.CompressState.from_preset("int8-ef", block_size=64, topology="flat")
    assert (state.dtype, state.error_feedback) == (torch.int8, True)
    assert (state.block_size, state.topology) == (64, "flat")
    # An override may also change what the preset sets.
    state = fastddp.CompressState.from_preset("bf16-acc-ef", None, error_feedback=False)
    assert (state.accumulate_dtype, state.error_feedback) == (torch.float32, False)
    # Overrides are checked like any setting.
    with pytest.raises(ValueError, match="block_size applies to dtype=torch.int8, torch.int4 or"):
        fastddp.CompressState.from_preset("bf16", block_size=64)


def test_preset_returns_a_copy():
    settings = preset("bf16-acc-ef")
    settings["error_feedback"] = False
    assert PRESETS["bf16-acc-ef"]["error_feedback"] is True
    assert fastddp.PRESETS is PRESETS


@pytest.mark.parametrize("make", [preset, fastddp.CompressState.from_preset])
def test_an_unknown_name_lists_the_names(make):
    with pytest.raises(ValueError, match=r"'auto' is not a preset .*CompressState\(dtype='auto'\)"):
        fastddp.CompressState.from_preset("auto")
    with pytest.raises(ValueError, match="unknown fastddp preset 'bf16-fp32acc'") as info:
        make("bf16-fp32acc")
    for name in PRESETS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"unknown fastddp preset \['bf16'\]"):
        make(["bf16"])  # not a name at all


def _mode_choices(what):
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    modes = next(a for a in sub.choices[what]._actions if a.dest == "modes")
    return [m for m in modes.choices if m.startswith("fastddp-")]


@pytest.mark.parametrize("what", ["ddp", "allreduce", "convergence"])
def test_the_bench_offers_every_preset_and_nothing_else(what):
    presets = [f"fastddp-{name}" for name in PRESETS]
    if what == "allreduce":
        assert _mode_choices(what) == presets
    else:  # DDP's own: each preset delayed (delay=1), and auto
        delayed = [f"{mode}-delay" for mode in presets]
        assert _mode_choices(what) == [*presets, *delayed, "fastddp-auto"]


def test_fsdp_bench_offers_the_presets_that_set_only_the_wire_dtype():
    # FSDP2's compressed reduce-scatter always sums in fp32 and keeps no residuals.
    only_dtype = [name for name, settings in PRESETS.items() if settings.keys() == {"dtype"}]
    assert _mode_choices("fsdp") == [f"fastddp-{name}" for name in only_dtype]
    assert {"fastddp-bf16", "fastddp-fp16", "fastddp-int8"} <= set(_mode_choices("fsdp"))


def _load(relative):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_resume_example_takes_every_preset(capsys):
    resume = _load("examples/resume.py")
    for name in PRESETS:
        assert resume._args(["--ckpt-dir", "x", "--mode", name]).mode == name
    assert resume._args(["--ckpt-dir", "x"]).mode == "bf16-acc-ef"
    assert resume._args(["--ckpt-dir", "x", "--grow-at", "20:4"]).grow_at == (20, 4)
    with pytest.raises(SystemExit):
        resume._args(["--ckpt-dir", "x", "--grow-at", "20"])
    assert "--grow-at: '20': expected STEP:RANKS, e.g. 20:4" in capsys.readouterr().err


def _saving(rank, world, ckpt_dir):
    # examples/resume.py's training, its fsyncs and renames recorded in order.
    events, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def renamed(src, dst):
        replace(src, dst)
        events.append(("replace", str(src), str(dst)))

    os.fsync, os.replace = synced, renamed
    try:
        _resume_rank(rank, world, ["--ckpt-dir", ckpt_dir, "--steps", "6", "--ckpt-every", "3"])
    finally:
        os.fsync, os.replace = fsync, replace
    return events


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_resume_example_publishes_a_checkpoint_only_once_it_is_on_the_disk(tmp_path):
    ckpt = tmp_path / "ckpt"
    ranks = run_ranks(_saving, 2, str(ckpt))
    for rank, events in enumerate(ranks):
        synced = [e[1] for e in events if e[0] == "fsync"]
        for step in (3, 6):
            assert f"{ckpt}/step-{step}.partial/hook-rank{rank}.pt" in synced, events
    # Rank 0 publishes: each part and the folder's entries before the rename, the rename after.
    events, published = ranks[0], 0
    for i, event in enumerate(events):
        if event[0] != "replace":
            continue
        tmp, before, after = event[1], {e[1] for e in events[:i]}, events[i + 1 : i + 2]
        assert {tmp, f"{tmp}/train.pt", f"{tmp}/hook-rank0.pt"} <= before, events
        assert after == [("fsync", str(ckpt))], events
        published += 1
    assert published == 2, events
