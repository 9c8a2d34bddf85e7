"""Fits used by test_integrations.py: Lightning (2 CPU processes) and Accelerate."""

import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

import fastddp


def _data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].sin())


def _lightning_module():
    """A small regression LightningModule class, its weights seeded."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def test_step(self, batch, _):
            return self.training_step(batch, _)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module


def lightning_fit(out: Path, kind: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from fastddp.integrations.lightning import FastDDPStrategy

    class Module(_lightning_module()):
        def on_train_end(self):
            flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
            (out / f"rank{self.global_rank}.json").write_text(
                json.dumps({"stats": state.stats(), "checksum": flat.double().sum().item()})
            )

    state = fastddp.CompressState(dtype=torch.float16)
    if kind == "fastddp":
        strategy = FastDDPStrategy(state)
    else:  # Lightning's own argument: skipped on CPU
        strategy = DDPStrategy(ddp_comm_hook=fastddp.compress_hook, ddp_comm_state=state)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    trainer.fit(Module(), loader)


def lightning_resume(out: Path, phase: str) -> None:
    """bf16 summed in fp32 with error feedback, 2 ranks x 8 steps an epoch: "whole" runs 2
        epochs, "first" 1 and saves a checkpoint at its end, "resumed" the second from it, "alone"
        too on 1 rank, "lonely" from a copy without the hook's files; each writes its parameters.
    "tested" tests from that copy, "switched" resumes under int8 without the hook's state.
        (Elementwise rounding: the first resumed step's bucket layout, DDP's first, changes
        nothing, where a block codec's scales would see other blocks.)"""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastddp.integrations.lightning import FastDDPStrategy

    # "switched": resumed under int8, which bf16's saved state does not fit, left unloaded.
    state = fastddp.CompressState.from_preset("int8-ef" if phase == "switched" else "bf16-acc-ef")
    saving = phase == "first"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if phase == "alone" else 2,
        strategy=FastDDPStrategy(state, resume_hook_state=phase != "switched"),
        max_epochs=1 if saving else 2,
        logger=False,
        enable_checkpointing=saving,
        # last.ckpt a link to first.ckpt: "resumed" goes on from the link.
        callbacks=[ModelCheckpoint(dirpath=out, filename="first", save_last="link")]
        if saving
        else [],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    module = _lightning_module()()
    if phase == "tested":  # a test run from the copy without the hook's files
        trainer.test(module, loader, ckpt_path=out / "lonely.ckpt")
        return
    ckpt = {"resumed": "last.ckpt", "alone": "first.ckpt", "lonely": "lonely.ckpt",
            "switched": "first.ckpt"}.get(phase)  # fmt: skip
    trainer.fit(module, loader, ckpt_path=None if ckpt is None else out / ckpt)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    torch.save(flat, out / f"{phase}-rank{trainer.global_rank}.pt")


def lightning_refusals() -> None:
    """FastDDPStrategy refuses delay=1 with find_unused_parameters, which would lose gradients,
    as fastddp.register_comm_hook does (on 2 ranks: DDP needs its group); says so on each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastddp.integrations.lightning import FastDDPStrategy

    strategy = FastDDPStrategy(state=fastddp.CompressState(delay=1))
    strategy.model = DDP(nn.Linear(4, 4), find_unused_parameters=True)
    try:
        strategy._register_ddp_hooks()
    except ValueError as e:
        if "with find_unused_parameters=True use delay=0" not in str(e):
            raise
        print("lightning job: delay=1 with find_unused_parameters refused", flush=True)
        return
    raise AssertionError("FastDDPStrategy took delay=1 with find_unused_parameters=True")


def lightning_job(out: Path) -> None:
    """Every 2-process Lightning run of test_integrations.py, one after another in one job (a
    later Trainer reuses the processes and the process group of the first): the fits of
    :func:`lightning_fit`, each into a folder of its own, then the phases of
    :func:`lightning_resume`, "lonely" last, for it fails."""
    import torch.distributed as dist

    for kind in ("fastddp", "lightning-ddp"):
        (out / kind).mkdir(exist_ok=True)
        lightning_fit(out / kind, kind)
        print(f"lightning job: {kind} fit done", flush=True)  # its teardown passed too
    for phase in ("whole", "first"):
        lightning_resume(out, phase)
    if dist.get_rank() == 0:  # a copy of the checkpoint without the hook's files
        shutil.copy(out / "first.ckpt", out / "lonely.ckpt")
    dist.barrier()
    for phase in ("resumed", "tested", "switched"):
        lightning_resume(out, phase)
    lightning_refusals()
    print("lightning job: lonely", flush=True)
    lightning_resume(out, "lonely")


def accelerate_fit(out: Path) -> None:
    from accelerate import Accelerator

    from fastddp.integrations.accelerate import register_comm_hook

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_comm_hook(accelerator, model, fastddp.CompressState.from_preset("bf16-acc"))
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        if step == 5:
            break
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank = accelerator.process_index
    (out / f"rank{rank}.json").write_text(
        json.dumps({"stats": state.stats(), "checksum": flat.double().sum().item()})
    )
    accelerator.wait_for_everyone()


def accelerate_resume(out: Path, phase: str) -> None:
    """bf16 summed in fp32 with error feedback on two models, as a GAN has: "whole" runs 12
    steps, saving the state after 6; "resumed" (and "lost", from a checkpoint that lost a file)
    loads it and runs the last 6; each writes both models' parameters."""
    from accelerate import Accelerator

    from fastddp.integrations.accelerate import register_comm_hook

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    b = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    a, b, opt = accelerator.prepare(a, b, opt)
    for model in (a, b):
        register_comm_hook(accelerator, model, fastddp.CompressState.from_preset("bf16-acc-ef"))
    rank = accelerator.process_index

    def step(i: int) -> None:
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1000 * i + rank))
        opt.zero_grad()
        loss = nn.functional.mse_loss(a(x), x[:, :4].sin())
        accelerator.backward(loss + nn.functional.mse_loss(b(x), 3 * x[:, :4].cos()))
        opt.step()

    if phase in ("resumed", "lost"):
        accelerator.load_state(str(out / "ckpt"))
    for i in range(12):
        if phase == "whole" and i == 6:
            accelerator.save_state(str(out / "ckpt"))
        if phase == "whole" or i >= 6:
            step(i)
    flat = torch.cat([p.detach().reshape(-1) for p in [*a.parameters(), *b.parameters()]])
    torch.save(flat, out / f"{phase}-rank{rank}.pt")
    accelerator.wait_for_everyone()


def accelerate_job(out: Path) -> None:
    """Every launched Accelerate run of test_integrations.py in one job: :func:`accelerate_fit`
    into a folder of its own, :func:`accelerate_resume`'s "whole" and "resumed", then "lost":
    "resumed" again from the checkpoint without rank 1's file of model 1, which fails."""
    import torch.distributed as dist

    (out / "fit").mkdir(exist_ok=True)
    accelerate_fit(out / "fit")
    print("accelerate job: fit done", flush=True)
    for phase in ("whole", "resumed"):
        accelerate_resume(out, phase)
    if dist.get_rank() == 0:
        (out / "ckpt" / "fastddp_hook_state_model1_rank1.pt").unlink()
    dist.barrier()
    print("accelerate job: lost", flush=True)
    accelerate_resume(out, "lost")


if __name__ == "__main__":
    what, out = sys.argv[1], Path(sys.argv[2])
    if what == "accelerate-job":
        accelerate_job(out)
        import torch.distributed as dist

        dist.destroy_process_group()
        fastddp.distributed.exit_after_shutdown()
    elif what == "lightning-job":
        lightning_job(out)
    elif what.startswith("resume-"):
        lightning_resume(out, what[len("resume-") :])
    else:
        raise SystemExit(f"{what!r}: give lightning-job, accelerate-job or resume-PHASE")
