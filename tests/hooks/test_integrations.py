"""fastddp's hook inside Lightning and Accelerate, on 2 CPU processes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "hooks" / "_frameworks.py"


def _job(cmd, out):
    """``cmd``'s completed run in ``out``, whatever its exit status; past its time, a failure
    with what it wrote. (Its guard is below the first test's limit, which counts the fixture.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return slack.run(cmd, cwd=out, env=env, timeout=slack.guard(240))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd[2:4]} ran past {e.timeout:.0f} s:\n{_tail(e.output, e.stderr)}")


def _tail(stdout, stderr) -> str:
    return (stdout or "")[-3000:] + (stderr or "")[-5000:]


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    """The folder of :func:`_frameworks.lightning_job`'s run and what it wrote: every 2-process
    Lightning run of these tests in one job, which ends failing, as its last run must."""
    if importlib.util.find_spec("lightning") is None:  # (not imported here: 6 CPU s)
        pytest.skip("lightning is not installed")
    out = tmp_path_factory.mktemp("lightning")
    return out, _job([sys.executable, str(SCRIPT), "lightning-job", str(out)], out)


def _lightning_ranks(job, kind):
    """What each rank wrote after the ``kind`` fit, which ended on both ranks."""
    out, res = job
    said = res.stdout.count(f"lightning job: {kind} fit done")
    assert said == 2, f"the {kind} fit ended on {said} of 2 ranks:\n{_tail(res.stdout, res.stderr)}"
    return [json.loads((out / kind / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiproc
def test_lightning_fit_runs_the_hook_on_cpu(lightning_job):
    ranks = _lightning_ranks(lightning_job, "fastddp")
    for r in ranks:
        stats = r["stats"]
        assert stats["dtype"] == "float16"
        # 6 optimizer steps, every bucket reduced by the hook in each.
        assert stats["calls"] >= 6 and stats["calls"] % 6 == 0, stats
        assert sum(b["calls"] for b in stats["buckets"].values()) == stats["calls"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # the ranks stayed in step


@pytest.mark.multiproc
def test_lightning_own_argument_skips_the_hook_on_cpu(lightning_job):
    # Why FastDDPStrategy exists: DDPStrategy(ddp_comm_hook=...) is silently ignored on CPU.
    ranks = _lightning_ranks(lightning_job, "lightning-ddp")
    assert all(r["stats"]["calls"] == 0 for r in ranks)


@pytest.mark.multiproc
def test_a_lightning_resume_keeps_each_ranks_residuals(lightning_job):
    # Lightning writes its checkpoint from rank 0; the residuals of error feedback are each
    # rank's own. Saved beside it and loaded into the same rank, a resume ends bit for bit
    # where the uninterrupted fit does (started from zero residuals: 4e-5 away), resumed here
    # from save_last="link"'s last.ckpt, a link to the checkpoint beside which they are. The
    # job runs "whole", "first", "resumed", "tested", "switched", then "lonely", which fails.
    import torch

    out, res = lightning_job
    told = _tail(res.stdout, res.stderr)
    assert "lightning job: lonely" in res.stdout, told  # every run before it passed
    beside = sorted(p.name for p in (out / "fastddp-hook-state").glob("first.ckpt.rank*"))
    assert beside == ["first.ckpt.rank0", "first.ckpt.rank1"], beside
    for r in range(2):
        whole = torch.load(out / f"whole-rank{r}.pt")
        first = torch.load(out / f"first-rank{r}.pt")
        resumed = torch.load(out / f"resumed-rank{r}.pt")
        assert not torch.equal(first, whole)  # (the second epoch moved them)
        assert torch.equal(resumed, whole), (resumed - whole).abs().max()
    # A checkpoint copied without the hook's files is refused, naming them.
    assert res.returncode != 0, told
    assert "lonely.ckpt was saved by 2 ranks, each with its hook state beside it, but 2 of" in (
        res.stderr
    ), told
    # Testing from it runs no hook: the checkpoint alone will do. And a fit resumed under
    # other settings, with resume_hook_state=False, starts the hook afresh.
    switched, first = (torch.load(out / f"{p}-rank0.pt") for p in ("switched", "first"))
    assert torch.isfinite(switched).all() and not torch.equal(switched, first)
    # On 1 rank, both ranks' residuals regrouped (CompressState.reshard): it runs, and learns.
    cmd = [sys.executable, str(SCRIPT), "resume-alone", str(out)]
    # (Its guard and the job's stay below the limit of this test, which may have made the job.)
    alone = slack.run(
        cmd, cwd=out, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=slack.guard(50)
    )
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-5000:]
    assert torch.isfinite(torch.load(out / "alone-rank0.pt")).all()


def test_a_checkpoint_saved_where_no_rank_trained_holds_no_hook_state(tmp_path):
    # ddp_spawn's main process after fit: its copy of the state never ran, and the spawned
    # processes, which had theirs, are gone. It wrote its one file and a marker of 2 ranks,
    # and the resume then asked for a file that no one could copy.
    pytest.importorskip("lightning")
    import torch

    import fastddp
    from fastddp.integrations.lightning import FastDDPStrategy

    strategy = FastDDPStrategy(fastddp.CompressState.from_preset("int8-ef"))
    with pytest.warns(UserWarning, match="the checkpoint holds no hook state, and a fit resumed"):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "after.ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["after.ckpt"]
    assert "fastddp" not in torch.load(tmp_path / "after.ckpt")


def test_the_hook_state_files_leave_lightnings_hpc_numbering_alone(tmp_path):
    # Lightning numbers a SLURM requeue's checkpoints by the digits of every name in the folder
    # that holds "ckpt_": files named hpc_ckpt_1.ckpt.fastddp-rank0 beside the checkpoint read
    # as version 10, the next save became hpc_ckpt_12.ckpt and the resume looked for 121.
    pytest.importorskip("lightning")
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from fastddp.integrations.lightning import FastDDPStrategy

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")
    for rank in range(2):
        state = Path(FastDDPStrategy._beside(tmp_path / "hpc_ckpt_1.ckpt", rank))
        state.parent.mkdir(exist_ok=True)
        state.write_bytes(b"")
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")


def test_hook_state_files_of_the_earlier_layout_still_load(tmp_path):
    # Checkpoints written before the files moved to fastddp-hook-state/ hold them beside the
    # checkpoint, as <checkpoint>.fastddp-rank<R>: a resume still finds them there.
    pytest.importorskip("lightning")
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    import fastddp
    from fastddp.integrations.lightning import FastDDPStrategy

    torch.save(fastddp.CompressState.from_preset("int8-ef").state_dict(),
               tmp_path / "old.ckpt.fastddp-rank0")  # fmt: skip
    torch.save({"state_dict": {}, "fastddp": {"world_size": 1}}, tmp_path / "old.ckpt")
    strategy = FastDDPStrategy(
        fastddp.CompressState.from_preset("int8-ef"), cluster_environment=LightningEnvironment()
    )
    assert "fastddp" in strategy.load_checkpoint(tmp_path / "old.ckpt")
    (tmp_path / "old.ckpt.fastddp-rank0").unlink()
    with pytest.raises(FileNotFoundError, match="fastddp-hook-state/old.ckpt.rank0"):
        strategy.load_checkpoint(tmp_path / "old.ckpt")


def test_fastddp_strategy_refuses_hook_arguments():
    pytest.importorskip("lightning")
    from fastddp.integrations.lightning import FastDDPStrategy

    with pytest.raises(ValueError, match="drop ddp_comm_hook"):
        FastDDPStrategy(ddp_comm_hook=print)
    with pytest.raises(TypeError, match="state must be a fastddp.CompressState"):
        FastDDPStrategy(state={"dtype": "fp16"})
    with pytest.raises(TypeError, match=r"fastddp.CompressState.from_preset\('int8-ef'\)"):
        FastDDPStrategy("int8-ef")
    # The hook's settings, which DDPStrategy would hand DDP, to fail in every process.
    with pytest.raises(TypeError, match="dtype, error_feedback are the hook's settings; give"):
        FastDDPStrategy(dtype="int8", error_feedback=True)
    with pytest.raises(TypeError, match="resume_hook_state must be True or False, got 'yes'"):
        FastDDPStrategy(resume_hook_state="yes")
    # Trainer(strategy="fastddp") once the module is imported.
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry.get("fastddp"), FastDDPStrategy)


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    """The folder of :func:`_frameworks.accelerate_job`'s run, launched on 2 ranks, and what it
    wrote: every launched Accelerate run of these tests in one job, which ends failing, as its
    last run must."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed")
    out = tmp_path_factory.mktemp("accelerate")
    launch = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    return out, _job([*launch, str(SCRIPT), "accelerate-job", str(out)], out)


@pytest.mark.multiproc
@pytest.mark.launcher
def test_accelerate_prepared_model_runs_the_hook(accelerate_job):
    out, res = accelerate_job
    said = res.stdout.count("accelerate job: fit done")
    assert said == 2, f"the fit ended on {said} of 2 ranks:\n{_tail(res.stdout, res.stderr)}"
    ranks = [json.loads((out / "fit" / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["stats"]["calls"] >= 6 and r["stats"]["path"] == "alltoall", r["stats"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.launcher
def test_an_accelerate_resume_keeps_each_ranks_residuals(accelerate_job):
    # accelerator.save_state writes each process's hook state of each model beside the models';
    # load_state loads it into the same rank and model: the resumed steps end bit for bit where
    # the whole run does (with one file a rank, the second model's residuals went to both).
    import torch

    out, res = accelerate_job
    told, tail = res.stdout + res.stderr, _tail(res.stdout, res.stderr)
    assert "accelerate job: lost" in res.stdout, tail  # every run before it passed
    saved = sorted(p.name for p in (out / "ckpt").glob("fastddp_hook_state_*"))
    lost = "fastddp_hook_state_model1_rank1.pt"  # removed before the last run
    assert saved + [lost] == [
        f"fastddp_hook_state_model{m}_rank{r}.pt" for m in (0, 1) for r in (0, 1)
    ]
    for r in range(2):
        whole = torch.load(out / f"whole-rank{r}.pt")
        resumed = torch.load(out / f"resumed-rank{r}.pt")
        assert torch.equal(resumed, whole), (resumed - whole).abs().max()
    # A checkpoint that lost a process's file is refused on every process, naming it.
    assert res.returncode != 0, tail
    assert "was saved by 2 processes, each with fastddp's hook state, but 1 of those" in told, tail
    assert "fastddp_hook_state_model1_rank1.pt...): copy them with the checkpoint" in told, tail


def test_accelerate_helper_refuses_an_unprepared_model():
    pytest.importorskip("accelerate")
    import torch

    from fastddp.integrations.accelerate import register_comm_hook

    class Two:
        num_processes = 2

    with pytest.raises(TypeError, match="pass the model returned by accelerator.prepare"):
        register_comm_hook(Two(), torch.nn.Linear(2, 2))
    from torch.distributed.fsdp import FSDPModule

    sharded = torch.nn.Linear(2, 2)  # its class swapped, as fully_shard does
    sharded.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    with pytest.raises(TypeError, match=r"sharded by FSDP.*use fastddp.fsdp"):
        register_comm_hook(Two(), sharded)


def test_accelerate_seeing_one_process_of_several_is_refused(monkeypatch):
    # Accelerator() on a machine without GPUs, under torchrun: each rank a job of one, which
    # the helper left without a hook while the ranks trained apart.
    pytest.importorskip("accelerate")
    import torch

    from fastddp.integrations.accelerate import register_comm_hook

    class One:
        num_processes = 1

    assert register_comm_hook(One(), torch.nn.Linear(2, 2)) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"sees one process, but WORLD_SIZE=2.*cpu=True"):
        register_comm_hook(One(), torch.nn.Linear(2, 2))


def test_an_accelerate_resume_refuses_a_model_saved_without_its_state(tmp_path):
    # Saved with one model hooked, resumed with two: the second model's residuals are not in
    # the checkpoint, and starting them from zero would go unnoticed.
    pytest.importorskip("accelerate")
    import fastddp
    from fastddp.integrations.accelerate import _keep_with_checkpoints

    class Accelerator:  # what the helper uses of one
        process_index, num_processes = 0, 1

        def __init__(self):
            self.save, self.load = [], []

        def register_save_state_pre_hook(self, hook):
            self.save.append(hook)

        def register_load_state_pre_hook(self, hook):
            self.load.append(hook)

    saving, resuming = Accelerator(), Accelerator()
    _keep_with_checkpoints(saving, fastddp.CompressState())
    saving.save[0]([], [], str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["fastddp_hook_state_model0_rank0.pt"]
    for _ in range(2):
        _keep_with_checkpoints(resuming, fastddp.CompressState())
    resuming.load[0]([], str(tmp_path))  # the first model's state is there
    with pytest.raises(FileNotFoundError, match=r"none for model 1 \(the second model given"):
        resuming.load[1]([], str(tmp_path))


class _TwoProcesses:
    num_processes = 2  # all the helper reads of an Accelerator


def _framework_checks(rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastddp
    from fastddp.integrations.accelerate import register_comm_hook

    # delay=1 with find_unused_parameters would lose gradients: refused as by
    # fastddp.register_comm_hook (through Lightning: in lightning_job's run).
    unused = DDP(torch.nn.Linear(4, 4), find_unused_parameters=True)
    with pytest.raises(ValueError, match="with find_unused_parameters=True use delay=0"):
        register_comm_hook(_TwoProcesses(), unused, fastddp.CompressState(delay=1))
    # A preset's name for a state, and one auto state for two models (whose turns would
    # alternate between their backward passes), refused as by fastddp.register_comm_hook.
    with pytest.raises(TypeError, match=r"CompressState.from_preset\('int8-ef'\)"):
        register_comm_hook(_TwoProcesses(), DDP(torch.nn.Linear(4, 4)), "int8-ef")
    auto, kept = fastddp.CompressState(dtype="auto"), DDP(torch.nn.Linear(4, 4))
    register_comm_hook(_TwoProcesses(), kept, auto)
    with pytest.raises(RuntimeError, match="registered on another model, which still exists"):
        register_comm_hook(_TwoProcesses(), DDP(torch.nn.Linear(4, 4)), auto)
    # Accelerator(dynamo_backend=...) returns torch.compile(DDP(model)): the hook goes inside.
    model = DDP(torch.nn.Linear(4, 4))
    state = register_comm_hook(_TwoProcesses(), torch.compile(model))
    model(torch.randn(2, 4)).sum().backward()
    assert state.stats()["calls"] == 1


@pytest.mark.multiproc
def test_the_frameworks_check_what_fastddp_register_comm_hook_checks(lightning_job):
    # Lightning's FastDDPStrategy, on the 2 ranks of the job that has Lightning imported.
    _, res = lightning_job
    said = "lightning job: delay=1 with find_unused_parameters refused"
    assert res.stdout.count(said) == 2, _tail(res.stdout, res.stderr)
    pytest.importorskip("accelerate")
    from .._dist import run_ranks

    run_ranks(_framework_checks, 2)


def _lightning_saves(rank, world, folder):
    import shutil

    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    import fastddp
    from fastddp.integrations.lightning import FastDDPStrategy

    env = LightningEnvironment()
    env.set_global_rank(rank)
    env.set_world_size(world)
    strategy = FastDDPStrategy(
        fastddp.CompressState.from_preset("int8-ef"), cluster_environment=env
    )
    ckpt = folder / "step.ckpt"
    files = [Path(FastDDPStrategy._beside(ckpt, r)) for r in range(world)]

    def copy(source, target, by):  # on rank `by`, while the other waits
        torch.distributed.barrier()
        if rank == by:
            shutil.copy(folder / source, folder / target)
        torch.distributed.barrier()

    def save():  # and wait for rank 0's checkpoint, as Trainer.save_checkpoint does
        strategy.save_checkpoint({"state_dict": {}}, ckpt)
        torch.distributed.barrier()

    # Two saves at one step (a fit re-run from an earlier checkpoint): the step check of the
    # first reduction cannot tell their files apart.
    save()
    copy("step.ckpt", "step.a", 0)
    copy(files[1], "rank1.a", 1)
    save()
    assert "fastddp" in strategy.load_checkpoint(ckpt)  # one save's files load
    copy(files[1], "rank1.b", 1)

    def refused(wrong):  # on both ranks, naming the files of ranks `wrong` alone
        with pytest.raises(ValueError, match="beside it are of another") as error:
            strategy.load_checkpoint(ckpt)
        for r in range(world):
            assert (f"{files[r]}: save " in str(error.value)) == (r in wrong), error.value
        return str(error.value)

    copy("rank1.a", files[1], 1)  # rank 1's file of the earlier save left (a save cut short)
    said = [refused([1])]
    copy("rank1.b", files[1], 1)
    copy("step.a", "step.ckpt", 0)  # the later save's files beside the earlier checkpoint
    said.append(refused([0, 1]))
    assert "resume_hook_state=False" in said[0]
    return said


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_lightning_resume_refuses_hook_state_files_of_another_save(tmp_path):
    # Lightning writes the checkpoint from rank 0, each rank its hook state beside it: files
    # of two saves mixed in one folder are refused on every rank (one that raised alone would
    # leave the others waiting in the first reduction), naming the files that do not belong.
    pytest.importorskip("lightning")
    from .._dist import run_ranks

    said = run_ranks(_lightning_saves, 2, tmp_path, timeout=120)
    assert said[0] == said[1]


@pytest.mark.timeout(60)
def test_lightning_hook_state_files_without_a_save_id_still_load(tmp_path):
    # Saved before save ids: neither the checkpoint nor its files have one, and nothing tells
    # their saves apart; a file without one beside a checkpoint with one is of another save.
    pytest.importorskip("lightning")
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    import fastddp
    from fastddp.integrations.lightning import FastDDPStrategy

    strategy = FastDDPStrategy(
        fastddp.CompressState.from_preset("int8-ef"), cluster_environment=LightningEnvironment()
    )
    ckpt = tmp_path / "old.ckpt"
    beside = Path(FastDDPStrategy._beside(ckpt, 0))
    beside.parent.mkdir()
    torch.save(fastddp.CompressState.from_preset("int8-ef").state_dict(), beside)
    torch.save({"state_dict": {}, "fastddp": {"world_size": 1}}, ckpt)
    assert "fastddp" in strategy.load_checkpoint(ckpt)
    torch.save({"state_dict": {}, "fastddp": {"world_size": 1, "save": "0" * 32}}, ckpt)
    with pytest.raises(ValueError, match=f"{beside}: a save without an id"):
        strategy.load_checkpoint(ckpt)


class _Accelerator:  # what the helper uses of one, on a rank of a real process group
    def __init__(self, rank, world):
        self.process_index, self.num_processes = rank, world
        self.save, self.load = [], []

    def register_save_state_pre_hook(self, hook):
        self.save.append(hook)

    def register_load_state_pre_hook(self, hook):
        self.load.append(hook)


def _accelerate_saves(rank, world, folder):
    import shutil

    import torch

    import fastddp
    from fastddp.integrations.accelerate import _keep_with_checkpoints

    accelerator = _Accelerator(rank, world)
    _keep_with_checkpoints(accelerator, fastddp.CompressState.from_preset("int8-ef"))
    files = [folder / f"fastddp_hook_state_model0_rank{r}.pt" for r in range(world)]

    def save():
        accelerator.save[0]([], [], str(folder))
        torch.distributed.barrier()

    def copy(source, target):
        torch.distributed.barrier()
        if rank == 1:
            shutil.copy(source, target)
        torch.distributed.barrier()

    # Two saves at one step: rank 1's file of the first left beside the second's (a save cut
    # short) is refused on every process, which each list every file's save.
    save()
    copy(files[1], folder / "rank1.a")
    save()
    accelerator.load[0]([], str(folder))  # one save's files load
    copy(folder / "rank1.a", files[1])
    with pytest.raises(ValueError, match="of different saves") as refused:
        accelerator.load[0]([], str(folder))
    said = str(refused.value)
    ids = [torch.load(f)["save"] for f in files]
    assert ids[0] != ids[1] and all(f"{f}: save {i}" in said for f, i in zip(files, ids)), said
    assert "remove every fastddp_hook_state_* file there" in said
    torch.distributed.barrier()  # every rank has read the files before rank 0 rewrites one
    # Files saved before save ids load as they did; one beside a file with an id is refused.
    for r in range(world):
        if rank == r:
            saved = torch.load(files[r])
            torch.save({k: v for k, v in saved.items() if k != "save"}, files[r])
        torch.distributed.barrier()
        if r == 0:
            with pytest.raises(ValueError, match=f"{files[0]}: a save without an id"):
                accelerator.load[0]([], str(folder))
    accelerator.load[0]([], str(folder))
    return said


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_an_accelerate_resume_refuses_hook_state_files_of_different_saves(tmp_path):
    pytest.importorskip("accelerate")
    from .._dist import run_ranks

    said = run_ranks(_accelerate_saves, 2, tmp_path, timeout=120)
    assert said[0] == said[1]
