"""``hybrid()``: FSDP2 sharded inside each node, each shard all-reduced across nodes compressed.

Native HSDP (``fully_shard(module, mesh=<2-D mesh>)``) reduce-scatters the gradients inside the
node and then all-reduces each rank's shard across nodes in the ``reduce_dtype``: fp32 over
the slow link. Here the model is sharded over the node only (``mesh["shard"]``, 1-D), and
:func:`hybrid` gives every ``fully_shard``-ed module an all-reduce hook
(``set_all_reduce_hook``), which FSDP2 runs on each reduce-scattered shard: it all-reduces the
shard over the replicate group (this local rank on every node) with the DDP hooks' machinery.
So every codec, the fp32 sum of compressed payloads and error feedback come as they are: one
:class:`~fastddp.CompressState` over the replicate group, in which each module is a bucket of
its own (its index is the module's position in ``model.modules()``), so each shard keeps its
own residual.

FSDP2 reads the shard as soon as the hook returns, so the hook finishes its reduction before
it returns (on CUDA its work is ordered on FSDP2's all-reduce stream, which the hook runs in).
"""

import inspect
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fastddp.codecs import CODECS
from fastddp.fsdp._agree import HYBRID, agree_setup
from fastddp.fsdp._checkpoint import LoadCheck, pack
from fastddp.fsdp._sharded import sharded_modules
from fastddp.fsdp.install import INSTALLED, compress_reduce_scatter
from fastddp.fsdp.reduce_scatter import CompressedReduceScatter
from fastddp.hooks import CompressState, _reduce

__all__ = ["HybridAllReduce", "hybrid"]

_WHERE = "fastddp.fsdp.hybrid"
_SHARD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _param_group(module: FSDPModule):
    # FSDP2 keeps a module's parameters, mesh and divide factor on its parameter group; there is
    # no public accessor for the mesh or the factor.
    return module._get_fsdp_state()._fsdp_param_group


class HybridAllReduce:
    """The cross-node half of :func:`hybrid`: one compressed all-reduce per reduce-scattered
    shard, over the replicate group. Made by :func:`hybrid`; see its docstring.

    It is a checkpoint ``Stateful``: :meth:`state_dict` holds this rank's error-feedback
    residuals under a key of its own rank, so that ``torch.distributed.checkpoint`` keeps every
    rank's (``dcp.save({"model": ..., "fastddp": hybrid_comm})``).
    """

    def __init__(
        self,
        modules: list[tuple[str, FSDPModule]],
        state: CompressState,
        shard_size: int,
        reduce_scatter: Optional[CompressedReduceScatter],
    ) -> None:
        self.state = state
        self.reduce_scatter = reduce_scatter
        self.nodes = dist.get_world_size(state.process_group)
        self.ranks_per_node = shard_size
        self._names = [name for name, _ in modules]
        self._numels: dict[int, int] = {}
        self._calls = 0
        # Per module, the sum of the shards FSDP2 reduced with all-reduce turned off
        # (set_requires_all_reduce(False)), in fp32, until the next one that all-reduces.
        self._partial: dict[int, torch.Tensor] = {}
        self._load = LoadCheck(_WHERE)
        if reduce_scatter is not None:
            reduce_scatter._agree_on_world = True
        for index, (_, module) in enumerate(modules):
            module.set_all_reduce_hook(self._hook_for(index, module))
            setattr(module, HYBRID, self)

    def discard_feedback(self) -> None:
        """Drop the error-feedback residuals of both halves, after a step the optimizer
        skipped (see ``CompressState.discard_feedback``). Call it on every rank."""
        self.state.discard_feedback()
        if self.reduce_scatter is not None:
            self.reduce_scatter.discard_feedback()

    def __repr__(self) -> str:
        return f"HybridAllReduce(nodes={self.nodes}, {self.state!r})"

    def _hook_for(self, index: int, module: FSDPModule):
        def hook(output: torch.Tensor) -> None:
            self._reduce_shard(index, module, output)

        return hook

    def _reduce_shard(self, index: int, module: FSDPModule, output: torch.Tensor) -> None:
        # Everything checked here is the same on every rank of the replicate group (the same
        # model, sharded alike), so a bad call raises on all of them before any collective.
        if output.dtype not in _SHARD_DTYPES:
            raise TypeError(
                f"{_WHERE}: {self._names[index] or 'the root module'}'s reduce-scattered "
                f"gradient is {output.dtype}; use a reduce_dtype of float32, bfloat16 or float16"
            )
        flat = output.view(-1)
        numel = flat.numel()
        seen = self._numels.setdefault(index, numel)
        if seen != numel and self.state.error_feedback:
            raise ValueError(
                f"{_WHERE}: {self._names[index] or 'the root module'}'s reduce-scattered gradient "
                f"had {seen} elements and now has {numel}: a parameter got no gradient in one "
                "of these steps. Error feedback keeps a residual per element of the shard; give "
                "every parameter a gradient each step (or requires_grad=False), or use a mode "
                "without error feedback"
            )
        self._numels[index] = numel
        self._load.agree(output.device)
        if self.nodes == 1:
            return
        if output.is_cuda:
            # FSDP2 made this buffer on its reduce-scatter stream and, with a reduce_dtype
            # other than the parameters', drops it once this hook's work is queued on the
            # all-reduce stream (the current one): the next module's reduce-scatter could then
            # take the block while that work still reads and writes it. (Native HSDP holds it.)
            output.record_stream(torch.cuda.current_stream(output.device))
        if not _param_group(module).all_reduce_grads:
            # set_requires_all_reduce(False): as native HSDP, keep the node's sum for the
            # next reduction and leave nothing for FSDP2 to add to the gradient now.
            partial = self._partial.get(index)
            if partial is None:
                self._partial[index] = flat.to(torch.float32, copy=True)
            elif partial.numel() != numel:
                raise ValueError(
                    f"{_WHERE}: {self._names[index] or 'the root module'}'s reduce-scattered "
                    f"gradient had {partial.numel()} elements in an earlier micro-batch without "
                    f"all-reduce and has {numel} now: give every parameter a gradient in each "
                    "micro-batch"
                )
            else:
                partial += flat
            flat.zero_()
            return
        self._calls += 1
        # FSDP2 divides by the shard group's size (its average); the hook adds the nodes'. With a
        # gradient_divide_factor the user's factor is the whole division, and nodes are summed.
        average = _param_group(module).gradient_divide_factor is None
        work = flat if flat.dtype == torch.float32 else flat.float()
        partial = self._partial.pop(index, None)
        if partial is not None:  # what the micro-batches without all-reduce left
            work += partial
        params = ((index, numel),)
        _reduce(self.state, work, index, is_last=True, average=average, params=params).wait()
        if work is not flat:
            flat.copy_(work)

    def stats(self) -> dict[str, Any]:
        """``nodes``, ``ranks_per_node``, ``calls`` (shards reduced), ``all_reduce`` (the
        cross-node state's :meth:`~fastddp.CompressState.stats`: bytes, per-module buckets) and
        ``reduce_scatter`` (the intra-node comm's stats, ``None`` when FSDP2 reduces inside the
        node itself)."""
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "calls": self._calls,
            "all_reduce": self.state.stats(),
            "reduce_scatter": None if self.reduce_scatter is None else self.reduce_scatter.stats(),
        }

    def state_dict(self) -> dict[str, bytes]:
        """This rank's cross-node state (residuals, counters) and the job's layout (nodes x
        ranks per node), serialised under a key naming its rank (``rank<r>_of_<world>``): DCP
        keeps one copy of values saved under one key."""
        layout = [self.nodes, self.ranks_per_node]
        return pack({"layout": layout, "state": self.state.state_dict()})

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        """Restore what :meth:`state_dict` saved on this rank of a job of the same shape. Call
        it on every rank: what does not fit is raised on every rank at the first reduction."""
        self._load.load(state_dict, self._restore)

    def _restore(self, saved: dict[str, Any]) -> None:
        if "layout" in saved:  # (states saved before the layout was kept hold the state alone)
            nodes, per_node = saved["layout"]
            if (nodes, per_node) != (self.nodes, self.ranks_per_node):
                raise ValueError(
                    f"{_WHERE}: the state was saved by a job of {nodes} nodes x {per_node} "
                    f"ranks, and this one has {self.nodes} x {self.ranks_per_node}: its "
                    "residuals belong to the shards of that layout. Resume on the same nodes "
                    'and ranks per node, or leave "fastddp" out of what you load (the '
                    "residuals then start from zero)"
                )
            saved = saved["state"]
        self.state.load_state_dict(saved)


def hybrid(
    model: torch.nn.Module,
    replicate_group: Union[dist.ProcessGroup, DeviceMesh],
    dtype: Union[str, torch.dtype] = "bf16-acc",
    *,
    reduce_scatter: Optional[torch.dtype] = None,
    **settings: Any,
) -> HybridAllReduce:
    """All-reduce every FSDP2 shard across nodes compressed; FSDP2 shards inside the node.

    Shard with ``fully_shard(module, mesh=mesh["shard"])`` (``mesh`` from
    :func:`fastddp.fsdp.node_mesh`) on the layers and the root, then call ``hybrid`` once, on
    every rank, before the first backward. The result is HSDP's, with the cross-node
    all-reduce sent as ``dtype``; every node ends with the same parameters, bit for bit.

    Args:
        model (nn.Module): the model, its layers and root ``fully_shard``-ed over one node.
        replicate_group (ProcessGroup or DeviceMesh): the ranks with this rank's local position
            on every node: ``mesh["replicate"]``.
        dtype (str or torch.dtype): a preset of :data:`fastddp.PRESETS` (``"bf16-acc"``, the
            default: bf16 summed in fp32; ``"int8-ef"``, ``"int4-ef"``: with error feedback),
            or a wire dtype with ``settings`` as for :class:`~fastddp.CompressState`.
        reduce_scatter (torch.dtype, optional): also compress the reduce-scatter inside the
            node (:func:`compress_reduce_scatter`); by default FSDP2 reduces inside the node in
            its ``reduce_dtype``.
        **settings: :class:`~fastddp.CompressState` settings (``error_feedback``,
            ``block_size``, ``accumulate_dtype``, ``stochastic_rounding``, ``seed``), with a
            dtype; overrides of the preset's, with a preset name.

    Returns:
        HybridAllReduce: its :meth:`~HybridAllReduce.stats`, and its state for checkpoints
        (error-feedback residuals): save it with the model, e.g. with
        ``torch.distributed.checkpoint``.

    Example::

        >>> mesh = fastddp.fsdp.node_mesh()
        >>> for layer in model.layers:
        ...     fully_shard(layer, mesh=mesh["shard"])
        >>> fully_shard(model, mesh=mesh["shard"])
        >>> comm = fastddp.fsdp.hybrid(model, mesh["replicate"], "int8-ef")
    """
    # What each rank was given may be wrong on some ranks only (the model, the group, the
    # settings): found here, and raised on every rank after one all-gather over the job
    # (agree_setup), before FSDP2's first collective.
    group = shard_ranks = state = problem = None
    try:
        modules = sharded_modules(model, _WHERE, 'fully_shard(layer, mesh=mesh["shard"])')
        _check_installed(modules, reduce_scatter)
        group = _replicate_group(replicate_group)
        shard_ranks = _shard_ranks(modules)
        _check_groups(group, shard_ranks)
        state = _state(group, dtype, reduce_scatter, settings)
    except (TypeError, ValueError) as error:
        problem = error
    agree_setup(_WHERE, group, shard_ranks, state, reduce_scatter, problem)
    rs = None if reduce_scatter is None else compress_reduce_scatter(model, reduce_scatter)
    return HybridAllReduce(modules, state, len(shard_ranks), rs)


def _check_installed(modules: list, reduce_scatter) -> None:
    # A second comm would take over silently: the first's stats() stop, its residuals unused.
    if any(hasattr(m, HYBRID) for _, m in modules):
        raise ValueError(
            f"{_WHERE}: this model's modules all-reduce across nodes through a fastddp comm "
            "already (an earlier hybrid call); keep the HybridAllReduce it returned"
        )
    if reduce_scatter is not None and any(hasattr(m, INSTALLED) for _, m in modules):
        raise ValueError(
            f"{_WHERE}: reduce_scatter={reduce_scatter}, but this model's modules reduce-scatter "
            "through a fastddp comm already (compress_reduce_scatter's): leave reduce_scatter "
            "out to keep that one"
        )


def _state(group, dtype, reduce_scatter, settings: dict) -> CompressState:
    for name in ("process_group", "topology", "delay"):
        if name in settings:
            raise TypeError(f"{_WHERE}: {name} is not a setting here (the group is given)")
    known = [n for n in inspect.signature(CompressState.__init__).parameters
             if n not in ("self", "dtype", "process_group", "topology", "delay")]  # fmt: skip
    unknown = [n for n in settings if n not in known]
    if unknown:
        raise TypeError(
            f"{_WHERE}: unknown setting {unknown[0]!r}; the settings are CompressState's: "
            f"{', '.join(known)}"
        )
    codec = CODECS.get(reduce_scatter) if isinstance(reduce_scatter, torch.dtype) else None
    if codec is not None and codec.feedback_required:
        raise ValueError(
            f"{_WHERE}: reduce_scatter={reduce_scatter} trains only with error feedback, which "
            "the reduce-scatter inside the node does not keep here; give it torch.int8 or a "
            "16-bit dtype (the link inside a node is the fast one)"
        )
    if dtype == "auto":  # (from_preset's refusal named CompressState(dtype='auto'))
        raise ValueError(f"{_WHERE}: dtype='auto' is DDP's; give a preset name or a wire dtype")
    # The replicate group holds one rank per node: the flat path is the cross-node path.
    if isinstance(dtype, str):
        return CompressState.from_preset(dtype, group, topology="flat", **settings)
    return CompressState(dtype, group, topology="flat", **settings)


def _replicate_group(given) -> dist.ProcessGroup:
    if isinstance(given, DeviceMesh):
        if given.ndim != 1:
            raise ValueError(
                f"{_WHERE}: replicate_group is a {given.ndim}-D mesh; pass its replicate "
                'dimension, mesh["replicate"]'
            )
        return given.get_group()
    if not isinstance(given, dist.ProcessGroup):
        raise TypeError(
            f"{_WHERE}: replicate_group must be a ProcessGroup or a 1-D DeviceMesh "
            f'(mesh["replicate"] of fastddp.fsdp.node_mesh()), got {type(given).__name__}'
        )
    return given


def _shard_ranks(modules: list[tuple[str, FSDPModule]]) -> list[int]:
    meshes = {}
    for name, module in modules:
        group = _param_group(module)
        if group is None:
            continue  # a module without parameters of its own reduces nothing
        mesh = group.mesh_info.mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"{_WHERE}: {name or 'the root module'} is sharded on a {mesh.ndim}-D mesh "
                "(native HSDP, which all-reduces across nodes itself); shard over the node "
                'only: fully_shard(module, mesh=mesh["shard"])'
            )
        meshes[tuple(mesh.mesh.flatten().tolist())] = name
    if len(meshes) != 1:
        raise ValueError(
            f"{_WHERE}: the modules are sharded over different ranks ({list(meshes)}); shard "
            'every module over the same mesh["shard"]'
        )
    return list(next(iter(meshes)))


def _check_groups(group: dist.ProcessGroup, shard_ranks: list[int]) -> None:
    replicate_ranks = dist.get_process_group_ranks(group)
    world, rank = dist.get_world_size(), dist.get_rank()
    if set(replicate_ranks) & set(shard_ranks) != {rank} or (
        len(replicate_ranks) * len(shard_ranks) != world
    ):
        raise ValueError(
            f"{_WHERE}: replicate_group (ranks {replicate_ranks}) is not the replicate dimension "
            f"of the shard group (ranks {shard_ranks}) in a world of {world}: it must hold "
            "this rank and one rank of every other shard group. Pass "
            'mesh["replicate"] of the mesh whose mesh["shard"] you sharded with '
            "(fastddp.fsdp.node_mesh())"
        )
