"""Does a Walsh-Hadamard rotation within each block lower the block codecs' error?

    python benchmarks/rotation.py --json benchmarks/results/rotation.json

Trains the convergence benchmark's transformer (``python -m fastddp.bench convergence``'s
model, data and optimiser, one process) and, at a few steps, takes its real gradient (heavy
tailed: its kurtosis is printed) and measures the relative error ``|decode(encode(g)) - g| /
|g|`` of int8, int4 and int2 at each block size, plain and rotated: the rotated codec sends
``H g`` (``H`` the orthonormal Hadamard matrix of the block, its own inverse) and the receiver
applies ``H`` to what it decodes. A rotation spreads an outlier over its block, which helps
where one value dominates a block and hurts where the block's values are alike.
"""

import argparse
import json
import math
from types import SimpleNamespace

import torch

from fastddp import ops
from fastddp.bench import options
from fastddp.bench.convergence import _batch, corpus
from fastddp.bench.models import Decoder

BITS = (8, 4, 2)
BLOCKS = (64, 128, 256)


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` times the orthonormal Hadamard matrix of ``block``, block by block."""
    y = x.reshape(-1, block)
    h = 1
    while h < block:
        y = y.view(-1, block // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(-1) * (1 / math.sqrt(block))


def round_trip(v: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``v`` encoded by the codec of ``bits`` bits and decoded, to nearest."""
    n = v.numel()
    scales, out = torch.empty(-(-n // block)), torch.empty(n)
    if bits == 8:
        codes = torch.empty(n, dtype=torch.int8)
        ops.quantize_int8(v, codes, scales, block)
        ops.unpack_int8(codes, scales, out, block)
    else:
        codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
        ops.quantize_packed(v, codes, scales, bits, block)
        ops.unpack_packed(codes, scales, out, bits, block)
    return out


def errors(g: torch.Tensor) -> dict[str, float]:
    out = {}
    for bits in BITS:
        for block in BLOCKS:
            plain = round_trip(g, bits, block)
            rotated = hadamard(round_trip(hadamard(g, block), bits, block), block)
            for name, got in (("plain", plain), ("rotated", rotated)):
                out[f"int{bits}/{block}/{name}"] = float((got - g).norm() / g.norm())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[0, 10, 30, 100])
    p.add_argument("--json", help="write the errors here")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    torch.manual_seed(0)
    data, shape = corpus(), SimpleNamespace(seq=64, batch=8)
    model = Decoder(width=256, heads=8, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = []
    for step in range(max(args.steps) + 1):
        tokens = _batch(data, shape, step, 0, 0)
        opt.zero_grad()
        Decoder.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if step in args.steps:
            g = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
            g = torch.nn.functional.pad(g, (0, -g.numel() % max(BLOCKS)))
            kurtosis = float(((g - g.mean()) ** 4).mean() / g.var() ** 2)
            rows.append({"step": step, "kurtosis": kurtosis, "errors": errors(g)})
        opt.step()
    print(f"{'codec/block':14s}" + "".join(f"  step {r['step']:>3d}" for r in rows))
    print(f"{'kurtosis':14s}" + "".join(f"  {r['kurtosis']:8.0f}" for r in rows))
    for bits in BITS:
        for block in BLOCKS:
            key = f"int{bits}/{block}"
            cells = "".join(
                f"  {r['errors'][key + '/plain']:.3f}/{r['errors'][key + '/rotated']:.3f}"
                for r in rows
            )
            print(f"{key:14s}{cells}")
    print("(relative error: plain/rotated)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
