"""Where a hooked DDP step's time goes: GPU busy time, kernel launches, host waits, host ops.

The companion of ``gpu_step_cost.py`` (same model, same variants, world size 1), for a few
variants: plain DDP, PyTorch's ``fp16_compress_hook`` and fastddp's bf16 and int8-ef presets
registered both ways. For each, one profiled run of ``--steps`` steps (``torch.profiler``,
CPU and CUDA) gives per step: the GPU kernels and the sum of their durations (GPU busy time),
the calls of the CUDA runtime that launch, copy or wait (``cudaLaunchKernel``,
``cudaMemcpyAsync``, ``cudaStreamSynchronize`` ...), and the host ops whose own CPU time
exceeds plain DDP's the most. Then ``--rounds`` interleaved timed rounds give ms per step
and the ratio to plain DDP, as ``gpu_step_cost.py`` does. ``--model`` picks the step-cost
model (67M parameters, which the host nearly keeps up with) or a larger one (166M, batch 16 x
512, which keeps the GPU busy).

    python benchmarks/gpu_step_profile.py --model both --json profile.json
    python benchmarks/gpu_step_profile.py --device cpu --rounds 2    # Gloo, a tiny model
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_cost as step_cost  # noqa: E402

from fastddp.bench import options  # noqa: E402

VARIANTS = (
    ("plain DDP", "none"),
    ("torch fp16_compress_hook", "ddp.register_comm_hook"),
    ("fastddp bf16", "ddp.register_comm_hook"),
    ("fastddp bf16", "fastddp.register_comm_hook"),
    ("fastddp int8-ef", "ddp.register_comm_hook"),
    ("fastddp int8-ef", "fastddp.register_comm_hook"),
)
# The runtime calls counted per step: launches, copies, stream orderings and host waits.
RUNTIME = (
    "cudaLaunchKernel",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaEventRecord",
    "cudaStreamWaitEvent",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
)
MODELS = {
    "step-cost": dict(step_cost.SIZES["cuda"]),
    "large": dict(width=1024, depth=8, vocab=32000, batch=16, tokens=512),
}
TOP = 12  # host ops listed per variant


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(sizes, device, steps) -> list:
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (sizes["batch"], sizes["tokens"])
    return [
        tuple(torch.randint(sizes["vocab"], shape, generator=gen, device=device) for _ in "xy")
        for _ in range(steps)
    ]


def _profile(v, data, device) -> dict:
    """One profiled run of the variant's steps: the per-step figures."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = len(data)
    with profile(activities=activities) as prof:
        step_cost.train_steps(v, data, device)
        _sync(device)
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = {e.key: e.count / steps for e in averages if e.key in RUNTIME}
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms": sum(e.device_time for e in kernels) / 1e3 / steps,
        "runtime_calls_per_step": {name: counts.get(name, 0.0) for name in RUNTIME},
        "host_us": {e.key: (e.self_cpu_time_total / steps, e.count / steps) for e in averages},
    }


def measure(device, sizes, steps, rounds, log=print) -> list:
    """Profile, then time, every variant on one model; one row per variant."""
    torch.manual_seed(0)
    initial = step_cost.Transformer(sizes["width"], sizes["depth"], sizes["vocab"]).state_dict()
    data = _batches(sizes, device, steps)
    variants = [step_cost.make_variant(n, r, initial, device, sizes) for n, r in VARIANTS]
    for v in variants:
        step_cost.train_steps(v, data[:3], device)  # DDP rebuilds its buckets after step 1
    _sync(device)
    params = sum(p.numel() for p in variants[0].model.parameters())
    log(f"step-profile: {params / 1e6:.0f}M parameters, {sizes}, on {device}")
    profiles = [_profile(v, data, device) for v in variants]
    for _ in range(rounds):
        for v in variants:
            _sync(device)
            start = time.perf_counter()
            step_cost.train_steps(v, data, device)
            _sync(device)
            v.rounds.append((time.perf_counter() - start) / steps)
    plain_ms = statistics.median(variants[0].rounds) * 1e3
    plain_host = profiles[0]["host_us"]
    rows = []
    for v, p in zip(variants, profiles):
        extra = [
            (key, us - plain_host.get(key, (0.0, 0.0))[0], n - plain_host.get(key, (0.0, 0.0))[1])
            for key, (us, n) in p.pop("host_us").items()
        ]
        extra.sort(key=lambda e: -e[1])
        # Which ops a variant calls more often than plain DDP: exact, where times are noisy.
        more_calls = {key: round(n, 2) for key, _, n in extra if n > 0}
        ms = statistics.median(v.rounds) * 1e3
        rows.append(
            {
                "variant": v.name,
                "registration": v.registration,
                "params": params,
                "ms_per_step": ms,
                "ms_min": min(v.rounds) * 1e3,
                "ratio": ms / plain_ms,
                **p,
                "host_over_plain": [
                    {"op": k, "us_per_step": round(us, 1), "calls_per_step": round(n, 2)}
                    for k, us, n in extra[:TOP]
                ]
                if v.registration != "none"
                else [],
                "calls_over_plain": more_calls,
            }
        )
    return rows


def markdown(rows) -> str:
    lines = [
        "| variant | registered with | ms/step | vs plain | GPU busy ms | kernels | launches "
        "| memcpy | syncs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        calls = r["runtime_calls_per_step"]
        syncs = sum(calls[k] for k in RUNTIME if k.endswith("Synchronize"))
        lines.append(
            f"| {r['variant']} | {r['registration']} | {r['ms_per_step']:.2f} | "
            f"{r['ratio']:.3f} | {r['gpu_busy_ms']:.2f} | {r['kernels_per_step']:.0f} | "
            f"{calls['cudaLaunchKernel']:.0f} | {calls['cudaMemcpyAsync']:.0f} | {syncs:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="both", choices=[*MODELS, "both"])
    p.add_argument("--steps", type=int, default=5, help="steps profiled, and per timed round")
    p.add_argument("--rounds", type=int, default=6, help="interleaved timed rounds")
    p.add_argument("--json")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be at least 2 and --rounds at least 1")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        models = {"cpu": dict(step_cost.SIZES["cpu"])}
    else:
        models = MODELS if args.model == "both" else {args.model: MODELS[args.model]}
    step_cost.init_group(device)
    out = {}
    try:
        for name, sizes in models.items():
            rows = measure(device, sizes, args.steps, args.rounds)
            print(f"\n{name}:\n{markdown(rows)}")
            for r in rows[1:]:
                top = "; ".join(f"{e['op']} {e['us_per_step']:.0f}" for e in r["host_over_plain"])
                print(f"{r['variant']} [{r['registration']}] host us over plain: {top}")
            out[name] = {"sizes": sizes, "rows": rows}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "models": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
