"""Host time per bucket of each comm hook, against PyTorch's own hooks, in one run.

A hook runs on the autograd thread: on a GPU, every microsecond it spends on the host per bucket
is a microsecond the device may wait for its next kernel. This benchmark makes that time
visible on any machine: a model of ``--layers`` tiny ``Linear(--width, --width)`` layers, one
DDP bucket each, so that the kernels and the wire cost next to nothing and a step is mostly the
hooks' host time. Every mode has a DDP model of its own; the modes take turns, ``--steps``
steps each per round over ``--rounds`` rounds, so that a drift of the machine lands on all
alike. A mode's cost per bucket is (its median step - plain DDP's median step) / buckets, and
``vs torch-fp16`` divides it by that of PyTorch's ``fp16_compress_hook`` from the same run.

Modes: ``fp32`` (no hook: the floor), ``torch-allreduce`` and ``torch-fp16`` (PyTorch's
``allreduce_hook`` and ``fp16_compress_hook``), and ``fastddp-<preset>`` for each preset,
registered as PyTorch's users register a hook (``model.register_comm_hook(state,
fastddp.compress_hook)``) and, as ``fastddp-<preset>-native``, through
``fastddp.register_comm_hook(model, state)``.
"""

import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench.common import FASTDDP_MODES, fastddp_state

_NATIVE = "-native"
BASELINE = "torch-fp16"
CHOICES = [
    "fp32",
    "torch-allreduce",
    BASELINE,
    *FASTDDP_MODES,
    *(m + _NATIVE for m in FASTDDP_MODES),
]
MODES = CHOICES


def _model(args, device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    return torch.nn.Sequential(*layers).to(device)


def _ddp(mode: str, args, device) -> tuple[DDP, list[int]]:
    """A DDP model of ``mode`` with one bucket per layer, and a list its hook calls count."""
    per_layer = (args.width + 1) * args.width * 4  # weight and bias, in bytes
    model = DDP(
        _model(args, device),
        device_ids=None,
        bucket_cap_mb=per_layer / 2**20,
        gradient_as_bucket_view=True,
    )
    calls = [0]
    if mode == "fp32":
        return model, calls
    if mode.startswith("torch-"):
        hook = default_hooks.allreduce_hook if mode == "torch-allreduce" else None
        hook = hook or default_hooks.fp16_compress_hook
        model.register_comm_hook(dist.group.WORLD, hook)
        return model, calls
    native = mode.endswith(_NATIVE)
    state = fastddp_state(mode.removesuffix(_NATIVE))
    if native:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    return model, calls


def _step(model: DDP, batch: torch.Tensor) -> None:
    model(batch).sum().backward()


def baseline(median: dict[str, float], buckets: int, warn: bool = True) -> Optional[float]:
    """The baseline's extra seconds a bucket over plain DDP (``fp32``), the ratios' divisor;
    None without both, or where it measured none (noise over too few steps: every ratio would
    be meaningless, or of the wrong sign), with a warning."""
    if "fp32" not in median or BASELINE not in median:
        return None
    base = (median[BASELINE] - median["fp32"]) / buckets
    if base > 0:
        return base
    if warn:
        print(f"warning: {BASELINE} measured {1e6 * base:.1f} us a bucket, no more than plain "
              "DDP: too few steps to tell; no ratios (give more --steps or --rounds)",
              file=sys.stderr, flush=True)  # fmt: skip
    return None


def run(env, args) -> list[dict]:
    """Time every mode of ``args.modes`` in turns; return one row per mode (on every rank)."""
    device = env.device
    batch = torch.randn(args.batch, args.width, device=device)
    models = {mode: _ddp(mode, args, device)[0] for mode in args.modes}
    for model in models.values():  # the first step builds, the second rebuilds the buckets
        for _ in range(3):
            _step(model, batch)
            model.zero_grad(set_to_none=False)
    buckets = len(models[args.modes[0]].reducer._get_zeros_like_grad_buckets())
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.rounds):
        for mode, model in models.items():
            for _ in range(args.steps):
                dist.barrier()
                sync()
                began = time.perf_counter()
                _step(model, batch)
                sync()
                times[mode].append(time.perf_counter() - began)
                model.zero_grad(set_to_none=False)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    floor = median.get("fp32")
    base = baseline(median, buckets, warn=env.rank == 0)
    rows = []
    for mode in args.modes:
        per_bucket = None if floor is None else (median[mode] - floor) / buckets
        rows.append(
            {
                "mode": mode,
                "buckets": buckets,
                "step_us": 1e6 * median[mode],
                "per_bucket_us": None if per_bucket is None else 1e6 * per_bucket,
                "vs_torch_fp16": None if not base or per_bucket is None else per_bucket / base,
            }
        )
    return rows
