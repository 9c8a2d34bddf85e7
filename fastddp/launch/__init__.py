"""``python -m fastddp.launch``: torchrun, plus cluster detection and a network preflight.

Before ``torch.distributed.run`` starts the workers, fastddp:

1. fills torchrun's defaults from the cluster (Slurm, mpirun, or ``NNODES``/``NODE_RANK``/
   ``NPROC_PER_NODE``/``ADDR``/``PORT``/``MASTER_ADDR``/``MASTER_PORT``); command-line options
   win over the user's ``PET_*`` variables, which win over what was detected
   (:mod:`~fastddp.launch.cli`, with the tables in :mod:`fastddp.cluster`);
2. checks, in seconds, what would otherwise surface as a hang, and picks the network interface
   that reaches the master, exporting ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for the
   workers unless already set (:mod:`~fastddp.launch.preflight`, over
   :mod:`~fastddp.launch.net`);
3. gives the workers of every restarted or re-formed round a fresh store, on every rendezvous,
   so that ``--max-restarts`` and a node that rejoins work every time
   (:mod:`~fastddp.launch.store`);
4. while the rendezvous forms, has every node sign in with its settings
   (:mod:`~fastddp.launch.cards`), ends the launch where two nodes disagree (``--nnodes``,
   one ``--node-rank`` twice) or cannot reach each other on the workers' ports
   (:mod:`~fastddp.launch.reach`), and names the nodes still missing
   (:mod:`~fastddp.launch.roster`); and, under the static rendezvous, stops
   the other nodes' workers when one node's fail (:mod:`~fastddp.launch.failures`).

Example::

    python -m fastddp.launch --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
        --master-addr 10.0.0.1 train.py
"""

from fastddp.launch.cli import build_parser, main
from fastddp.launch.preflight import Decisions, LaunchError, apply, preflight
from fastddp.launch.store import StorePlan, restart_store

__all__ = [
    "Decisions",
    "LaunchError",
    "StorePlan",
    "apply",
    "build_parser",
    "main",
    "preflight",
    "restart_store",
]
