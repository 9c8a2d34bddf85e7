"""The periodic methods of the convergence benchmark: the nodes train apart and meet every H
steps.

``diloco-<preset>-H<n>``: :class:`fastddp.DiLoCo` with ``sync_every=n`` and ``compress=<preset>``
(``diloco-fp32-H<n>``: the outer average in fp32), over DDP inside each node. ``postlocal-H<n>``:
PyTorch's post-local SGD, that is, DDP over every rank with ``post_localSGD_hook``
(``PostLocalSGDState(process_group=None, subgroup=<the node's group>, start_localSGD_iter=W)``:
gradients all-reduced over every rank for the first W steps, inside the node after) and a
``PeriodicModelAverager(period=n, warmup_steps=W)`` that averages the parameters over every
rank every n steps after the warm-up. W is the smallest number of steps at or above the
benchmark's warm-up for which the averages fall on the steps that are multiples of n.

Both methods leave the ranks of different nodes on different parameters between rounds, so the
benchmark checks the validation loss only right after a round, on the parameters every rank
then shares (DiLoCo's global parameters, post-local SGD's average): at every multiple of n
nearest to ``--eval-every``.
"""

import argparse
import re
from typing import Optional

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench import ddp
from fastddp.hooks.topology import ring_bytes

_DILOCO = re.compile(r"diloco-(?P<preset>[a-z0-9-]+)-H(?P<every>[0-9]+)(?P<overlap>-overlap)?")
_POSTLOCAL = re.compile(r"postlocal-H(?P<every>[0-9]+)")
#: The shapes of the periodic modes' names, for help texts and errors.
PATTERNS = ["diloco-<preset>-H<n>[-overlap]", "diloco-fp32-H<n>[-overlap]", "postlocal-H<n>"]


def parse(mode: str) -> Optional[tuple[str, Optional[str], int, bool]]:
    """``(method, preset, H, overlap)`` of a periodic mode (``preset`` None for fp32 or
    post-local SGD; ``overlap``: DiLoCo's ``overlap=True``), or None for a per-step mode.
    Raises ``ValueError`` for a malformed periodic name."""
    found = _DILOCO.fullmatch(mode)
    if found:
        preset, every = found["preset"], int(found["every"])
        if preset != "fp32" and preset not in fastddp.PRESETS:
            known = ", ".join(["fp32", *fastddp.PRESETS])
            raise ValueError(f"mode {mode!r}: no preset {preset!r} (one of {known})")
        _check_every(mode, every)
        return "diloco", None if preset == "fp32" else preset, every, bool(found["overlap"])
    found = _POSTLOCAL.fullmatch(mode)
    if found:
        _check_every(mode, int(found["every"]))
        return "postlocal", None, int(found["every"]), False
    if mode.startswith(("diloco", "postlocal")):
        raise ValueError(f"mode {mode!r} is not of the form {' or '.join(PATTERNS)}")
    return None


def _check_every(mode: str, every: int) -> None:
    if every < 2:
        raise ValueError(f"mode {mode!r}: H must be at least 2 (H=1 is plain DDP)")


def mode_name(text: str) -> str:
    """``--modes``'s type: a per-step mode of the DDP benchmark, or a periodic one."""
    try:
        if parse(text) is not None or text in ddp.CHOICES:
            return text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    raise argparse.ArgumentTypeError(
        f"unknown mode {text!r}: give one of {', '.join(ddp.CHOICES)}, or "
        f"{', '.join(PATTERNS)} (<preset> one of {', '.join(fastddp.PRESETS)})"
    )


class Choices(list):
    """``--modes``'s choices: the DDP benchmark's modes as a list, and any periodic mode."""

    def __contains__(self, mode) -> bool:
        try:
            return list.__contains__(self, mode) or parse(mode) is not None
        except ValueError:
            return False


def postlocal_warmup(warmup: int, every: int) -> int:
    """The smallest W >= ``warmup`` with W + 1 a multiple of ``every``: the averager (called
    after each step) then averages at the steps that are multiples of ``every``."""
    return -(-(warmup + 1) // every) * every - 1


class Periodic:
    """One periodic method around a fresh module: ``model`` to train, :meth:`after_step` after
    every optimizer step, :meth:`wire_bytes` and :meth:`cross_node_bytes` at the end.

    Args:
        module: the model, the same on every rank.
        mode: a periodic mode name (:func:`parse`).
        args: the benchmark's options (``outer_lr``, ``outer_momentum``, ``bucket_cap_mb``).
        warmup: post-local SGD's global all-reduce steps before it goes local (rounded up, see
            :func:`postlocal_warmup`).
        topo: the ranks' :class:`~fastddp.hooks.topology.Topology`, for the bytes.
    """

    __slots__ = ("method", "every", "model", "diloco", "averager", "warmup", "steps", "rounds",
                 "_inside", "_everyone", "_ring")  # fmt: skip

    def __init__(self, module, mode, args, warmup, topo):
        self.method, preset, self.every, overlap = parse(mode)
        self.steps = self.rounds = 0
        node = fastddp.DiLoCo.node_group()  # a collective; the same group object every time
        numel = sum(p.numel() for p in module.parameters())
        # What one fp32 ring all-reduce of the model sends: inside the node (nothing where the
        # node is this rank alone), over every rank, and of that to other nodes.
        self._inside = ring_bytes(numel, dist.get_world_size(node), 4)
        self._everyone = ring_bytes(numel, topo.world, 4)
        self._ring = topo.ring_cross_bytes(numel, 4)
        self.diloco = self.averager = None
        if self.method == "diloco":
            self.warmup = 0
            self.model = DDP(module, process_group=node, bucket_cap_mb=args.bucket_cap_mb)
            self.diloco = fastddp.DiLoCo(
                self.model,
                sync_every=self.every,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                compress=preset,
                overlap=overlap,
            )
            return
        self.warmup = postlocal_warmup(warmup, self.every)
        self.model = DDP(module, bucket_cap_mb=args.bucket_cap_mb)
        state = post_local.PostLocalSGDState(
            process_group=None, subgroup=node, start_localSGD_iter=self.warmup
        )
        self.model.register_comm_hook(state, post_local.post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=self.every, warmup_steps=self.warmup)

    def after_step(self) -> bool:
        """Run the method's part after an optimizer step, before ``zero_grad`` (the averager
        skips parameters without a gradient); returns whether the ranks now share their
        parameters (after a round)."""
        self.steps += 1
        if self.diloco is not None:
            synced = self.diloco.step()
        else:
            before = self.averager.step
            synced = before >= self.warmup and (before - self.warmup) % self.every == 0
            self.averager.average_parameters(self.model.parameters())
        self.rounds += synced
        return synced

    def eval_interval(self, eval_every: int) -> int:
        """The multiple of H nearest to ``eval_every`` (at least H): checks land after rounds."""
        return self.every * max(1, round(eval_every / self.every))

    def cross_node_bytes(self) -> int:
        """What this rank sent to other nodes: DiLoCo's own count; for post-local SGD, one fp32
        ring all-reduce per warm-up step and per average (none inside the node)."""
        if self.diloco is not None:
            return int(self.diloco.stats()["cross_node_bytes"])
        return (min(self.steps, self.warmup) + self.rounds) * self._ring

    def wire_bytes(self) -> int:
        """What this rank sent on the wire, inside its node and across (rings in rank order).

        DiLoCo: DDP's fp32 gradients inside the node every step, its rounds' own count across
        nodes, and after each round the node's all-gather of the new slices (a ring: L - 1 slices
        from each of the L ranks). Post-local SGD: the gradients over every rank in the
        warm-up and inside the node after, and each average over every rank.
        """
        if self.diloco is not None:
            stats = self.diloco.stats()
            gather = (stats["ranks_per_node"] - 1) * stats["slice_numel"] * 4
            rounds = stats["round"] * gather + int(stats["cross_node_bytes"])
            return self.steps * self._inside + rounds
        warm = min(self.steps, self.warmup)
        return (warm + self.rounds) * self._everyone + (self.steps - warm) * self._inside

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()
