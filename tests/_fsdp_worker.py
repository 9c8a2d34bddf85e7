"""A small decoder block stack for the FSDP2 tests, and one training run of it."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fastddp.fsdp


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, as in a decoder-only transformer."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 61, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        # Flat logits: a 2-D linear output is not a view (FSDP2 warns about root views).
        return self.head(self.norm(x).flatten(0, 1))


def train(
    rank: int,
    comm_dtype=None,
    *,
    steps: int = 3,
    reduce_dtype=None,
    divide_factor=None,
    force_sum=False,
    block_size=None,
):
    """Train a sharded TinyDecoder; return (first-step grads, final params, comm stats).

    Same seed for the model on every rank, each rank its own batch, same for every call. The
    stats (``None`` without a comm) are those after the first step and after the last.
    """
    torch.manual_seed(0)
    model = TinyDecoder()
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in (*model.blocks, model):  # these setters do not recurse
        if divide_factor is not None:
            module.set_gradient_divide_factor(divide_factor)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
    comm = None
    if comm_dtype is not None:
        comm = fastddp.fsdp.compress_reduce_scatter(model, comm_dtype, block_size=block_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    first, stats = None, []
    for _ in range(steps):
        tokens = torch.randint(0, 61, (4, 17), generator=data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        loss.backward()
        if first is None:
            first = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if comm is not None:
            stats.append(comm.stats())
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return first, params, (stats[0], stats[-1]) if stats else None
