"""``DiLoCo``: DDP inside the node every step, an outer step across nodes every ``sync_every``."""

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fastddp.diloco import checks, start
from fastddp.diloco.groups import node_group
from fastddp.diloco.shards import Shards
from fastddp.diloco.wire import Background, CrossAverage

__all__ = ["DiLoCo"]

STATE_VERSION = 1


class DiLoCo:
    r"""Train each node on its own, and average the nodes' progress every ``sync_every`` steps.

    The model is DDP over the ranks of one node (:meth:`node_group`), so the gradients of every
    step stay inside the node. Every ``sync_every`` inner steps, each node's pseudo-gradient
    (the global parameters minus its own, in fp32) is averaged across nodes, compressed by the
    preset ``compress`` with its error feedback, and an outer SGD step with Nesterov momentum
    moves the global parameters by it; every rank then continues from them. Ranks of one node
    hold the same parameters, so each sends only its slice: local rank ``k`` averages slice
    ``k`` (1/L of the model, L ranks per node) with local rank ``k`` of every other node, and
    the node all-gathers the new slices. The slow link carries one model's worth of
    compressed bytes per node and round. Each rank keeps the fp32 global parameters and outer
    momentum of its slice only.

    Call :meth:`step` after every inner ``optimizer.step()``; the inner optimizer is left as
    it is (its state stays local, as in DiLoCo). Construction is a collective over ``group``:
    it checks that every rank has the same settings and a model of the same layout, then sets
    every rank's parameters, frozen ones and buffers included, to those of the first node's
    (as DDP broadcasts rank 0's).

    Args:
        model (nn.Module): DDP over this rank's node (``process_group=DiLoCo.node_group()``);
            a node of one rank may pass the bare module.
        sync_every (int): inner steps per outer round (``H``; DiLoCo uses hundreds).
        outer_lr (float): the outer step size (default 0.7).
        outer_momentum (float): the outer momentum, in [0, 1) (default 0.9).
        nesterov (bool): Nesterov momentum (default True).
        compress (str, optional): a preset of :data:`fastddp.PRESETS` for the slow link
            (default ``"int8-ef"``: int8 with error feedback); ``None`` sends fp32.
        group (ProcessGroup, optional): the ranks that train together; ``None`` is every rank.
        overlap (bool): average round ``r``'s pseudo-gradient on a thread of its own while the
            next inner steps train, and apply it at the end of round ``r + 1`` (the outer
            update is one round late; the first round applies none). Measured, this trains
            worse than ``False`` (it warns so): keep the default.

    Raises:
        ValueError: on every rank alike, for a bad argument on any rank, settings that differ
            between ranks, nodes of different sizes, or a model that is not DDP over its node.

    .. warning::
        With ``overlap=True`` a round's average may still be in flight after the last step:
        call :meth:`wait` (or :meth:`state_dict`) before shutting the process group down.

    Example::

        >>> model = DDP(model, process_group=fastddp.DiLoCo.node_group())
        >>> diloco = fastddp.DiLoCo(model, sync_every=100, compress="int4-ef")
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()
        ...     opt.step(); opt.zero_grad()
        ...     diloco.step()  # every 100th call: the outer round
    """

    node_group = staticmethod(node_group)

    def __init__(
        self,
        model: nn.Module,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compress: Optional[str] = "int8-ef",
        group: Optional[dist.ProcessGroup] = None,
        overlap: bool = False,
    ) -> None:
        if group is not None and not isinstance(group, dist.ProcessGroup):  # (the exchange's)
            raise TypeError(f"fastddp.DiLoCo: group must be a ProcessGroup or None, got {group!r}")
        args = (sync_every, outer_lr, outer_momentum)
        inner = getattr(model, "_orig_mod", model)  # torch.compile(DDP(...)): the DDP inside
        problems = checks.local_problems(inner, *args, compress, nesterov, overlap)
        self.settings = checks.settings_of(inner, *args, nesterov, compress, overlap)
        rows = checks.exchange(inner, self.settings, problems, group)
        topo = checks.verdict(rows, dist.get_rank(group), group)
        topo.make_groups(group, hierarchical=True)
        if overlap:
            warnings.warn(
                "fastddp.DiLoCo(overlap=True) applies each round's outer step one round late: "
                "measured, that diverged with outer momentum 0.9 and trained slower than "
                "overlap=False even without momentum (benchmarks/results/diloco.md, "
                "'overlap=True'). Use overlap=False",
                UserWarning,
                stacklevel=2,
            )
        self.model = model
        self._group = group
        self.sync_every, self.overlap, self.compress = sync_every, bool(overlap), compress
        self.round = 0  # outer rounds done
        self.inner_steps = 0  # step() calls
        self.nodes, self.per_node = len(topo.nodes), topo.per_node
        self._intra, self._cross = topo.groups["intra"], topo.groups["cross"]
        # This rank's peer on the first node, whose parameters start everyone (the cross
        # group's lowest rank is on another node where the nodes' ranks interleave).
        first = topo.nodes[0][topo.local_rank]
        self._first = first if group is None else dist.get_global_rank(group, first)
        self._wire = CrossAverage(compress, self._cross, self.nodes)
        module = inner.module if isinstance(inner, DDP) else inner
        params = [p for p in module.parameters() if p.requires_grad]
        self._module, self._trained = module, [p.requires_grad for p in module.parameters()]
        self._shards = Shards(params, self.per_node, topo.local_rank, self._wire.block * self.nodes)
        size, device = self._shards.size, self._shards.device
        fp32 = dict(dtype=torch.float32, device=device)  # (whatever the default dtype)
        self._global = torch.zeros(size, **fp32)  # this rank's slice
        self._delta = torch.zeros(size, **fp32)  # this round's pseudo-gradient
        # overlap: the previous round's average, reduced in the background, applied next
        self._pending: Optional[torch.Tensor] = torch.zeros_like(self._delta) if overlap else None
        self._has_pending = False
        self._background = Background(device) if overlap else None
        momentum = outer_momentum
        self._outer = torch.optim.SGD(
            [self._global], lr=outer_lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        self._start(module)

    def _start(self, module: nn.Module) -> None:
        # The first node's parameters are everyone's start, as DDP starts from rank 0's; so
        # are its frozen parameters and buffers, which the outer step does not move.
        with torch.no_grad():
            self._shards.read(self._global)
            if self.nodes > 1:
                dist.broadcast(self._global, src=self._first, group=self._cross)
            self._shards.write(self._global, self._intra)
        if self.nodes > 1:
            states = start.start_states(module)
            start.from_first_node(states, self._cross, self._first, self._shards.device)

    def step(self) -> bool:
        """Count one inner step; every ``sync_every``-th call runs an outer round.

        Call it after each inner ``optimizer.step()``, on every rank. Returns whether this
        call ran an outer round.

        Raises:
            RuntimeError: on every rank alike, at a round, where any rank froze or unfroze a
                parameter since construction (naming the ranks and parameters).
        """
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self._check_trained()
        with torch.no_grad():
            self._round()
        self.round += 1
        return True

    def _check_trained(self) -> None:
        # The slices hold the parameters that required a gradient at construction: one frozen
        # or unfrozen since would be averaged, or left to drift apart on each node, unsaid. A
        # change on some ranks only must fail on all, not leave the others in the round's
        # collectives: one flag is agreed on (an all-reduce of one int per round, which the
        # round's own collectives cannot carry: compressed, or one round late with overlap),
        # and only when it is set are the ranks' findings gathered to be named.
        found = self._trained_problem()
        per_rank = [[found] if found else []]
        if self.nodes * self.per_node > 1:
            flag = torch.tensor([int(found is not None)], device=self._shards.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            if not flag.item():
                return
            per_rank = checks.gather(per_rank[0], self._group)
        checks.raise_problems(
            per_rank,
            f"{checks.WHERE}.step: parameters were frozen or unfrozen since it was built, and "
            "the outer rounds average those that required a gradient then",
            "Freeze or unfreeze alike on every rank, then build the DDP model and DiLoCo again",
            error=RuntimeError,
        )

    def _trained_problem(self) -> Optional[str]:
        now = [p.requires_grad for p in self._module.parameters()]
        if now == self._trained:
            return None
        if len(now) != len(self._trained):  # (parameters added or removed: no pairs)
            return "parameters were added or removed"
        named = zip(self._module.named_parameters(), self._trained)
        names = [n for (n, p), was in named if p.requires_grad != was]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"requires_grad of {shown} changed"

    def _round(self) -> None:
        delta = self._shards.read(self._delta)
        torch.sub(self._global, delta, out=delta)  # global - local: the pseudo-gradient
        if not self.overlap:
            self._wire(delta)
            self._apply(delta)
        else:
            # Round r's average starts now and is applied at the end of round r + 1; its
            # buffer is free once the previous one is taken.
            self._background.wait()
            previous = self._pending if self._has_pending else None
            self._delta, self._pending = self._pending, delta
            self._background.start(lambda: self._wire(delta), uses=(delta,))
            self._has_pending = True
            if previous is not None:
                self._apply(previous)
        self._shards.write(self._global, self._intra)

    def _apply(self, average: torch.Tensor) -> None:
        self._global.grad = average
        self._outer.step()
        self._global.grad = None

    def wait(self) -> None:
        """Finish the average in flight (``overlap=True``); it is still applied next round."""
        if self._background is not None:
            self._background.wait()

    def close(self) -> None:
        """Finish the average in flight and let its thread go (``overlap=True``)."""
        if self._background is not None:
            self._background.close()

    def stats(self) -> dict[str, Any]:
        """Rounds, inner steps, the layout, and the bytes this rank sent to other nodes.

        ``cross_node_bytes`` is what this rank's slices sent over the slow link in the outer
        rounds (the start's broadcast of the first node's parameters and buffers not counted);
        ``compress`` the codec's :meth:`~fastddp.CompressState.stats` (``None`` for fp32).
        """
        self.wait()
        state = self._wire.state
        return {
            "round": self.round,
            "inner_steps": self.inner_steps,
            "nodes": self.nodes,
            "ranks_per_node": self.per_node,
            "slice_numel": self._shards.size,
            "cross_node_bytes": self._wire.sent(),
            "compress": None if state is None else state.stats(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's outer state, on the CPU, for a checkpoint.

        It holds the settings, the layout, the round and inner-step counters, this rank's
        slice of the global parameters and outer momentum, the codec's residuals and, with
        ``overlap=True``, the average in waiting (the one in flight is finished first).
        Save one per rank, with the model's and the inner optimizer's; a job of the same
        layout that loads all three continues bit for bit.
        """
        self.wait()
        pending = self._pending if self._has_pending else None
        return {
            "version": STATE_VERSION,
            "settings": dict(self.settings),
            "layout": self._layout(),
            "round": self.round,
            "inner_steps": self.inner_steps,
            "global": self._global.detach().cpu().clone(),
            "outer": _cpu(self._outer.state_dict()),
            "compress": self._wire.state_dict(),
            "pending": None if pending is None else pending.cpu().clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by this rank of a job of the same layout; a
        collective of the group, as construction is: call it on every rank.

        Load the model's and the inner optimizer's state too (after constructing this
        object, which sets the parameters to the first node's): mid-round, the model holds
        this node's own parameters, not the global ones.
        """
        # Checked on every rank and shared, so that a state dict that fits some ranks only
        # (rank 0's loaded everywhere) fails on all of them, not while the others go on.
        sizes = {"global": self._global.numel(),
                 "pending": None if self._pending is None else self._pending.numel()}  # fmt: skip
        try:
            problems = checks.load_problems(
                state_dict, STATE_VERSION, self.settings, self._layout(), sizes
            )
            if not problems:  # the codec's part, tried on a state of its own (nothing loaded)
                wire = self._wire.load_problem(state_dict["compress"])
                problems += [wire] if wire else []
        except Exception as error:  # damage the checks did not foresee: still every rank's
            problems = [f"it could not be read ({type(error).__name__}: {error})"]
        rows = checks.gather((problems, checks.saved_at(state_dict)), self._group)
        checks.raise_problems(
            [row[0] for row in rows],
            f"{checks.WHERE}.load_state_dict: this state dict does not fit",
            "Load each rank's own state dict into a DiLoCo built with the same arguments, on "
            "the same number of nodes and ranks per node",
        )
        checks.raise_other_steps([row[1] for row in rows])
        self.wait()
        self._global.copy_(state_dict["global"])
        self._outer.load_state_dict(state_dict["outer"])
        self._wire.load_state_dict(state_dict["compress"])
        pending = state_dict["pending"]
        self._has_pending = pending is not None
        if pending is not None:
            self._pending.copy_(pending)
        self.round, self.inner_steps = int(state_dict["round"]), int(state_dict["inner_steps"])

    def _layout(self) -> dict[str, int]:
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.per_node,
            "local_rank": self._shards.lo // self._shards.size,
            "slice_numel": self._shards.size,
        }

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"DiLoCo(sync_every={s['sync_every']}, outer_lr={s['outer_lr']}, "
            f"outer_momentum={s['outer_momentum']}, nesterov={s['nesterov']}, "
            f"compress={s['compress']!r}, overlap={s['overlap']}, round={self.round}, "
            f"nodes={self.nodes}, ranks_per_node={self.per_node})"
        )


def _cpu(saved: Any) -> Any:
    if torch.is_tensor(saved):
        return saved.detach().cpu().clone()
    if isinstance(saved, dict):
        return {k: _cpu(v) for k, v in saved.items()}
    if isinstance(saved, list):
        return [_cpu(v) for v in saved]
    return saved
