"""Train a small character-level decoder with FSDP2 and fastddp's compressed reductions.

    python -m fastddp.launch --standalone --nproc-per-node 2 examples/fsdp_train.py
    python -m fastddp.launch --standalone --nproc-per-node 2 examples/fsdp_train.py --wire int8

On several nodes, ``--hybrid PRESET`` shards inside each node and all-reduces each shard across
nodes as PRESET (``fastddp.fsdp.hybrid``; ``--wire`` then compresses the reduce-scatter inside
the node), and ``--quantize-all-gather`` gathers the parameters as int8:

    python -m fastddp.launch --nnodes 2 --nproc-per-node 4 ... examples/fsdp_train.py \
        --hybrid int8-ef --wire none --quantize-all-gather

The text is Python's own ``argparse`` module source (it ships with every Python), as
printable-ASCII characters. Each rank reads its own windows of it; every rank prints nothing
but rank 0, which prints the loss, and at the end the reduce-scatter's statistics.
"""

import argparse
import time

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fastddp
import fastddp.fsdp
from fastddp.bench.models import Decoder

# The presets the compressed reduce-scatter can take (it sums in fp32 and keeps no residuals:
# those that set only the wire dtype), and "none" for FSDP2's own reduce-scatter.
WIRES = {n: s["dtype"] for n, s in fastddp.PRESETS.items() if s.keys() == {"dtype"}}
WIRES["none"] = None


def corpus() -> torch.Tensor:
    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()
    codes = torch.tensor([min(max(ord(c), 32), 127) - 32 for c in text], dtype=torch.long)
    return codes  # 96 symbols: printable ASCII, anything else folded to its ends


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wire", choices=list(WIRES), default="bf16", help="'none': FSDP2's own")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hybrid", choices=list(fastddp.PRESETS), help="shard inside each node")
    p.add_argument("--quantize-all-gather", action="store_true", help="int8 parameter gathers")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    problem = Decoder.options_problem(args.width, args.layers, args.seq, args.batch)
    if problem:
        p.error(problem)

    with fastddp.distributed_session() as env:
        torch.manual_seed(0)  # the same initial model on every rank
        model = Decoder(width=args.width, layers=args.layers).to(env.device)
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        mesh = fastddp.fsdp.node_mesh() if args.hybrid else None
        over = mesh["shard"] if mesh is not None else None  # None: every rank
        for block in model.blocks:
            fully_shard(block, mesh=over, mp_policy=mp)
        fully_shard(model, mesh=over, mp_policy=mp)
        comm = across = gather = None
        if WIRES[args.wire] is not None:
            comm = fastddp.fsdp.compress_reduce_scatter(model, WIRES[args.wire])
        if args.hybrid:
            across = fastddp.fsdp.hybrid(model, mesh["replicate"], args.hybrid)
        if args.quantize_all_gather:
            gather = fastddp.fsdp.quantize_all_gather(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

        data = corpus()
        gen = torch.Generator().manual_seed(1 + env.rank)  # each rank its own windows
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            at = torch.randint(0, len(data) - args.seq - 1, (args.batch, 1), generator=gen)
            windows = data[at + torch.arange(args.seq + 1)].to(env.device)
            loss = Decoder.loss(model(windows[:, :-1]), windows[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if env.rank == 0 and (step % 20 == 0 or step == args.steps):
                print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
        if env.rank == 0:
            print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s, wire {args.wire}")
            if comm is not None:
                s = comm.stats()
                ratio = s["wire_bytes"] / max(1, s["fp32_wire_bytes"])  # 0 on one rank
                print(f"reduce-scatters: {s['calls']}, bytes sent vs fp32: {ratio:.3f}")
            if across is not None:
                s = across.stats()
                ratio = s["all_reduce"]["cross_node_bytes"] / max(
                    1, s["all_reduce"]["fp32_ring_cross_node_bytes"]
                )
                print(
                    f"across {s['nodes']} node(s) ({args.hybrid}): {s['calls']} shard all-reduces, "
                    f"bytes to other nodes vs an fp32 ring: {ratio:.3f}"
                )
            if gather is not None:
                s = gather.stats()
                ratio = s["wire_bytes"] / max(1, s["bf16_wire_bytes"])  # 0 on one rank
                print(f"all-gathers: {s['calls']}, bytes sent vs bf16 parameters: {ratio:.3f}")


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
