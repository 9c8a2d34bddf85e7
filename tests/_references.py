"""Uninterrupted runs of the fault tests' jobs, on the session's pooled ranks.

A fault test launches a job, breaks it (a killed worker, a lost node, a lossy link) and holds
its final parameters against those of the same job run without the fault. That reference needs
no launcher and no namespaces of its own: it runs the same training code on pooled ranks, in a
fresh Gloo group over loopback, with ``FASTDDP_NODE_ID`` giving it the job's nodes. A launched
rank costs 3 to 4 CPU seconds before its first step; a pooled call almost nothing. Since the
training never depends on timing or transport, the faulted job must match it bit for bit, which
also shows that the launcher and the namespaces' links change no bit.
"""

import contextlib
import importlib.util
import io
import types
from pathlib import Path
from typing import Optional

import torch

from fastddp.testing import restart_worker

from ._dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
RESUME = ROOT / "examples" / "resume.py"

__all__ = ["resume_example", "resume_ranks", "restart_job"]


def _nodes(world_size: int, nodes: int) -> Optional[list[int]]:
    """Ranks in order, ``world_size // nodes`` a node (as the launchers number them)."""
    return None if nodes == 1 else [r * nodes // world_size for r in range(world_size)]


def _resume_rank(rank: int, world_size: int, argv: list[str]) -> str:
    """``examples/resume.py``'s training on this rank; what it printed. ``{rank}`` in an
    argument is this rank's number."""
    argv = [a.replace("{rank}", str(rank)) for a in argv]
    spec = importlib.util.spec_from_file_location("resume_example", RESUME)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example._args(argv)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    # train() reads only these of the fastddp.DistEnv that the script's session yields (the
    # pooled ranks run Gloo on the CPU).
    env = types.SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.train(env, args)
    return out.getvalue()


def resume_example(argv: list[str], world_size: int, nodes: int = 1) -> str:
    """Run ``examples/resume.py argv`` on ``world_size`` pooled ranks in ``nodes`` nodes, as
    ``fastddp.launch`` would without faults; rank 0's output (with ``--out``, the parameters
    are in that file)."""
    return run_ranks(_resume_rank, world_size, argv, nodes=_nodes(world_size, nodes))[0]


def resume_ranks(argv: list[str], world_size: int) -> list[str]:
    """:func:`resume_example`, every rank's output."""
    return run_ranks(_resume_rank, world_size, argv)


def _restart_rank(rank: int, world_size: int, argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # its timed lines are for launched runs
        restart_worker.train(restart_worker._args(argv))


def restart_job(worker_args: list[str], world_size: int, nodes: int = 1) -> list[torch.Tensor]:
    """The final parameters of :mod:`fastddp.testing.restart_worker` run with ``worker_args``
    (``-m fastddp.testing.restart_worker`` and its arguments, with no ``--kill``)."""
    assert worker_args[:2] == ["-m", restart_worker.__name__], worker_args
    args = restart_worker._args(worker_args[2:])
    if args.kill:
        raise ValueError(f"a reference runs without faults, not with --kill {args.kill}")
    run_ranks(_restart_rank, world_size, worker_args[2:], nodes=_nodes(world_size, nodes))
    return torch.load(args.dir / "params.pt")
