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
steps of each hooked variant, with plain DDP's between every two and at both ends (the first
hooked variant of a round moves on by one every round), each run timed from one device
synchronisation to the next. A GPU's step time drifts by a third and more between runs
seconds apart (clocks, the host), so a hooked variant is held against the plain runs beside
it: its ratio in a round is its mean step over the mean of the two plain runs next to it, and
its figure the median of those ratios over the rounds, with a distribution-free confidence
interval of at least 95% where there are 6 rounds or more (order statistics of the ratios;
the whole range below that, at the coverage it has). The target is a ratio of at most 1.03:
``met`` where the interval's top is within it, ``missed`` where its bottom is above it, and
``undecided`` where it straddles it or the rounds are too few for 95% (more ``--seconds``
decide). The same figures of each plain run against the two beside it show the method's own
noise. Rounds go on until ``--seconds`` have passed (at least ``--min-rounds``, at most
``--rounds``), so the run fits a time budget on any machine.

    python benchmarks/gpu_step_cost.py --json step.json --markdown step.md
    python benchmarks/gpu_step_cost.py --device cpu --rounds 2    # Gloo, a tiny model

Exits 1 if a variant's gradients are not finite after its steps.
"""

import argparse
import json
import math
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
from fastddp.bench import options

TARGET = 1.03  # a hook's step at most this times plain DDP's
LEVEL = 0.95  # the least coverage of the interval that decides a verdict
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
    rounds: list = field(default_factory=list)  # mean seconds per step, one per run
    ratios: list = field(default_factory=list)  # against the plain runs beside it, per round


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
    plain, hooked = variants[0], variants[1:]
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.monotonic() - started < seconds):
        order = hooked[rounds % len(hooked) :] + hooked[: rounds % len(hooked)]
        runs = [plain]
        for v in order:
            runs += [v, plain]
        times = [_timed(v, batches, device) for v in runs]
        for i in range(1, len(runs), 2):  # each hooked run against the plain runs beside it
            runs[i].ratios.append(times[i] / ((times[i - 1] + times[i + 1]) / 2))
        for i in range(2, len(runs) - 1, 2):  # each inner plain run against its neighbours
            plain.ratios.append(times[i] / ((times[i - 2] + times[i + 2]) / 2))
        rounds += 1
    log(f"step-cost: {rounds} rounds of {steps} steps in {time.monotonic() - started:.1f} s")
    rows = []
    for v in variants:
        ms = statistics.median(v.rounds) * 1e3
        finite = all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in v.model.parameters()
        )
        row = {
            "variant": v.name,
            "registration": v.registration,
            "ms_per_step": ms,
            "ms_min": min(v.rounds) * 1e3,
            "ms_max": max(v.rounds) * 1e3,
            "rounds": rounds,
            "finite_grads": finite,
        }
        if v is plain:
            # The noise: a plain run against the plain runs beside it, where it is the same.
            low, high, coverage = median_interval(v.ratios)
            noise = {"median": statistics.median(v.ratios) if v.ratios else None}
            noise.update(low=low, high=high, coverage=coverage, runs=len(v.ratios))
            row.update(ratio=1.0, target=None, meets_target=None, verdict=None, noise=noise)
        else:
            low, high, coverage = median_interval(v.ratios)
            verdict = "met" if high <= TARGET else "missed" if low > TARGET else "undecided"
            if coverage < LEVEL:
                verdict = "undecided"  # too few rounds for an interval at LEVEL
            row.update(ratio=statistics.median(v.ratios), ratio_low=low, ratio_high=high)
            row.update(coverage=coverage, target=TARGET, verdict=verdict)
            row["meets_target"] = {"met": True, "missed": False}.get(verdict)
        rows.append(row)
    return rows


def _timed(v: Variant, batches, device) -> float:
    """Mean seconds per step of ``batches`` on ``v``, from one device synchronisation to the
    next; recorded in ``v.rounds`` too."""
    _sync(device)
    start = time.perf_counter()
    train_steps(v, batches, device)
    _sync(device)
    took = (time.perf_counter() - start) / len(batches)
    v.rounds.append(took)
    return took


def median_interval(values, level=LEVEL) -> tuple:
    """``(low, high, coverage)``: a distribution-free confidence interval for the median of the
    population ``values`` were drawn from: the k-th smallest and k-th largest value, for the
    largest k whose coverage is at least ``level``; with too few values for that, their whole
    range (k = 1) at the coverage it has. ``(nan, nan, 0.0)`` for no values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0.0
    ordered = sorted(values)

    def coverage(k):  # P(x_(k) <= median <= x_(n-k+1)) = 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def markdown(rows, steps) -> str:
    lines = [
        "| variant | registered with | ms/step (median) | min | max | vs plain DDP beside it "
        f"| interval | <= {TARGET} |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        verdict = r["verdict"] or ""
        span = ""
        if r["target"] is not None:
            span = f"{r['ratio_low']:.3f}–{r['ratio_high']:.3f} ({r['coverage']:.0%})"
            verdict = verdict.upper() if verdict == "missed" else verdict
        if not r["finite_grads"]:
            verdict += " (gradients not finite)"
        lines.append(
            f"| {r['variant']} | {r['registration']} | {r['ms_per_step']:.2f} | "
            f"{r['ms_min']:.2f} | {r['ms_max']:.2f} | {r['ratio']:.3f} | {span} | "
            f"{verdict.strip()} |"
        )
    rounds = rows[0]["rounds"] if rows else 0
    lines += [
        "",
        f"{rounds} rounds of {steps} steps a run, plain DDP's runs between the hooked "
        "variants'; a ratio is the median over rounds of a run against the plain runs beside "
        "it, with the interval of that median (its coverage in brackets).",
    ]
    noise = rows[0].get("noise") if rows else None
    if noise and noise["runs"]:
        lines.append(
            f"The method's noise: a plain run against the plain runs beside it, "
            f"{noise['median']:.3f} ({noise['low']:.3f}–{noise['high']:.3f}, "
            f"{noise['coverage']:.0%}) over {noise['runs']} runs."
        )
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
    p.add_argument("--steps", type=int, default=5, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--min-rounds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=50, help="at most this many rounds")
    p.add_argument("--seconds", type=float, default=30.0, help="rounds go on this long")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
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
