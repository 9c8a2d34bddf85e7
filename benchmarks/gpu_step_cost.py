"""What a comm hook costs a DDP training step: plain DDP, PyTorch's fp16 hook, fastddp's presets.

One process, world size 1 (NCCL on the GPU; Gloo with ``--device cpu``), so nothing crosses a
wire and what is left is the hook's own cost: its host time per bucket and its kernels. The
model is a small transformer (token embedding, ``--depth`` pre-norm encoder layers of width
``--width``, an output layer over ``--vocab`` tokens), trained with AdamW (fused on CUDA) on
random tokens, under bf16 autocast on CUDA. The variants:

- ``plain DDP``: no hook;
- ``torch fp16_compress_hook``: PyTorch's own, ``model.register_comm_hook(None, hook)``;
- every preset of :data:`fastddp.PRESETS`, registered the two documented ways:
  ``model.register_comm_hook(state, fastddp.compress_hook)`` (``ddp.register_comm_hook``) and
  ``fastddp.register_comm_hook(model, state)`` (``fastddp.register_comm_hook``).

Each variant is its own DDP model from the same initial weights, warmed up first (DDP rebuilds
its buckets after the first step). Then the variants take turns: a round runs ``--steps``
steps of each (the first variant of a round moves on by one every round), timed from one
device synchronisation to the next. A variant's figure is the median over rounds of its mean
ms per step, and its ratio that over plain DDP's; the target is a ratio of at most 1.03.
Rounds go on until ``--seconds`` have passed (at least ``--min-rounds``, at most
``--rounds``), so the run fits a time budget on any machine.

    python benchmarks/gpu_step_cost.py --json step.json --markdown step.md
    python benchmarks/gpu_step_cost.py --device cpu --rounds 2    # Gloo, a tiny model

Exits 1 if a variant's gradients are not finite after its steps.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

TARGET = 1.03  # a hook's step at most this times plain DDP's
REGISTRATIONS = ("ddp.register_comm_hook", "fastddp.register_comm_hook")
# Model and batch per device: a mid-size model that runs in seconds on a GPU, a tiny one here.
SIZES = {
    "cuda": dict(width=1024, depth=4, vocab=8192, batch=8, tokens=256),
    "cpu": dict(width=64, depth=2, vocab=256, batch=2, tokens=16),
}


class Transformer(nn.Module):
    """Token embedding, pre-norm encoder layers and an output layer."""

    def __init__(self, width: int, depth: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(
            width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(tokens))))


@dataclass
class Variant:
    """One DDP model with its hook (or none), its optimiser and its timed rounds."""

    name: str
    registration: str
    model: DDP
    optimizer: torch.optim.Optimizer
    state: object = None
    rounds: list = field(default_factory=list)  # mean seconds per step, one per round


def variant_names() -> list:
    """``(name, registration)`` of every variant, plain DDP first."""
    names = [("plain DDP", "none"), ("torch fp16_compress_hook", "ddp.register_comm_hook")]
    names += [(f"fastddp {p}", how) for p in fastddp.PRESETS for how in REGISTRATIONS]
    return names


def make_variant(name, registration, initial, device, sizes) -> Variant:
    module = Transformer(sizes["width"], sizes["depth"], sizes["vocab"]).to(device)
    module.load_state_dict(initial)
    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if name == "torch fp16_compress_hook":
        model.register_comm_hook(None, fp16_compress_hook)
    elif name.startswith("fastddp "):
        state = fastddp.CompressState.from_preset(name.removeprefix("fastddp "))
        if registration == "ddp.register_comm_hook":
            model.register_comm_hook(state, fastddp.compress_hook)
        else:
            fastddp.register_comm_hook(model, state)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    return Variant(name, registration, model, optimizer, state)


def train_steps(v: Variant, batches, device) -> None:
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    for tokens, targets in batches:
        v.optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = v.model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        v.optimizer.step()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, sizes, steps, warmup, min_rounds, max_rounds, seconds, log=print) -> list:
    """Build every variant, take turns until the budget is spent; one result row per variant."""
    started = time.monotonic()
    torch.manual_seed(0)
    initial = Transformer(sizes["width"], sizes["depth"], sizes["vocab"]).state_dict()
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (sizes["batch"], sizes["tokens"])
    batches = [
        (
            torch.randint(sizes["vocab"], shape, generator=gen, device=device),
            torch.randint(sizes["vocab"], shape, generator=gen, device=device),
        )
        for _ in range(steps)
    ]
    variants = [make_variant(n, r, initial, device, sizes) for n, r in variant_names()]
    params = sum(p.numel() for p in variants[0].model.parameters())
    log(f"step-cost: {len(variants)} variants, {params / 1e6:.1f}M parameters, on {device}")
    for v in variants:
        train_steps(v, batches[:warmup], device)
    _sync(device)
    log(f"step-cost: built and warmed up in {time.monotonic() - started:.1f} s")
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.monotonic() - started < seconds):
        for i in range(len(variants)):
            v = variants[(i + rounds) % len(variants)]
            _sync(device)
            start = time.perf_counter()
            train_steps(v, batches, device)
            _sync(device)
            v.rounds.append((time.perf_counter() - start) / steps)
        rounds += 1
    log(f"step-cost: {rounds} rounds of {steps} steps in {time.monotonic() - started:.1f} s")
    plain = statistics.median(variants[0].rounds)
    rows = []
    for v in variants:
        ms = statistics.median(v.rounds) * 1e3
        finite = all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in v.model.parameters()
        )
        hooked = v.registration != "none"
        rows.append(
            {
                "variant": v.name,
                "registration": v.registration,
                "ms_per_step": ms,
                "ms_min": min(v.rounds) * 1e3,
                "ms_max": max(v.rounds) * 1e3,
                "rounds": len(v.rounds),
                "ratio": ms / (plain * 1e3),
                "target": TARGET if hooked else None,
                "meets_target": (ms / (plain * 1e3) <= TARGET) if hooked else None,
                "finite_grads": finite,
            }
        )
    return rows


def markdown(rows, steps) -> str:
    lines = [
        f"| variant | registered with | ms/step (median) | min | max | vs plain DDP | "
        f"<= {TARGET} |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        verdict = "" if r["target"] is None else ("met" if r["meets_target"] else "MISSED")
        if not r["finite_grads"]:
            verdict += " (gradients not finite)"
        lines.append(
            f"| {r['variant']} | {r['registration']} | {r['ms_per_step']:.2f} | "
            f"{r['ms_min']:.2f} | {r['ms_max']:.2f} | {r['ratio']:.3f} | {verdict.strip()} |"
        )
    rounds = rows[0]["rounds"] if rows else 0
    lines += ["", f"Median over {rounds} rounds of {steps} steps each, the variants in turn."]
    return "\n".join(lines) + "\n"


def init_group(device) -> None:
    """World size 1 on an in-process store: NCCL on CUDA, Gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for key in SIZES["cuda"]:
        p.add_argument(f"--{key}", type=int, help=f"default {SIZES['cuda'][key]} on cuda")
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--min-rounds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=50, help="at most this many rounds")
    p.add_argument("--seconds", type=float, default=30.0, help="rounds go on this long")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or not 1 <= args.min_rounds <= args.rounds:
        p.error("--steps and --warmup must be at least 1, and 1 <= --min-rounds <= --rounds")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = {k: getattr(args, k) or v for k, v in SIZES[args.device].items()}
    init_group(device)
    try:
        rows = measure(
            device, sizes, args.steps, args.warmup, args.min_rounds, args.rounds, args.seconds
        )
    finally:
        dist.destroy_process_group()
    table = markdown(rows, args.steps)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "sizes": sizes, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    bad = [r["variant"] + " " + r["registration"] for r in rows if not r["finite_grads"]]
    if bad:
        print(f"step-cost: gradients not finite: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
