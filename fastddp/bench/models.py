"""Models of the benchmarks: a stack of linear layers, and a small decoder-only transformer."""

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def mlp(
    sizes: Sequence[int], activation: type[nn.Module] = nn.GELU, seed: Optional[int] = None
) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ``activation`` between them.

    With ``seed``, the weights are those ``torch.manual_seed(seed)`` gives (the same on every
    rank and in every run).
    """
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), activation()]
    return nn.Sequential(*layers[:-1])


def mlp_width(params: int) -> int:
    """The width of ``ddp``'s mlp of about ``params`` parameters: square layers, 2048 wide
    when large."""
    return 2048 if params >= 4 * 2048 * 2048 else max(16, int((params / 2) ** 0.5))


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


POSITIONS = 1024  # the longest sequence the decoder takes


class Decoder(nn.Module):
    """A character-level decoder: embedding, ``layers`` blocks, a norm and the output layer.

    ``forward(tokens [B, T])`` returns logits flattened to ``[B * T, vocab]`` (a 2-D output, so
    that FSDP2's root module does not return a view).
    """

    def __init__(self, vocab: int = 96, width: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        if width % heads:
            raise ValueError(f"Decoder: width {width} is not a multiple of heads {heads}")
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(POSITIONS, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))

    @staticmethod
    def options_problem(width: int, layers: int, seq: int, batch: int, heads: int = 4):
        """What is wrong with a script's ``--width``, ``--layers``, ``--seq`` and ``--batch``
        for this model (a sentence naming the option), or None."""
        for name, value in (("width", width), ("layers", layers), ("seq", seq), ("batch", batch)):
            if value < 1:
                return f"--{name} must be at least 1"
        if width % heads:
            return f"--width {width} must be a multiple of the model's {heads} heads"
        if seq > POSITIONS:
            return f"--seq {seq} is more than the model's {POSITIONS} positions"
        return None

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets.reshape(-1))
