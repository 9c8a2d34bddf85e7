"""Worker of the 2 nodes x 2 ranks tests at 1 Gbit/s: three jobs in one netns run.

    python -m fastddp.netns --nodes 2 --nproc-per-node 2 --rate 1gbit \\
        tests/multinode/_two_nodes_worker.py OUT

In one session (each job's own session, inside it, uses its group): ``_hsdp_worker`` writes
``OUT/hsdp.json``, ``_topology_worker`` writes ``OUT/topology.json``, then
``examples/fsdp_train.py`` trains hybrid int8 with quantized all-gathers and prints what it
prints, after a line ``example:``. Each job counts its link bytes between barriers of its own,
so the others' traffic is not in its figures. One run of the namespaces and the four workers
serves the three tests, each of which would start its own.
"""

import runpy
import sys
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _hsdp_worker  # noqa: E402
import _topology_worker  # noqa: E402

import fastddp  # noqa: E402

EXAMPLE = HERE.parents[1] / "examples" / "fsdp_train.py"
EXAMPLE_ARGS = ["--steps", "20", "--width", "32", "--layers", "1", "--wire", "none"]
EXAMPLE_ARGS += ["--hybrid", "int8-ef", "--quantize-all-gather"]


def main(out: Path) -> None:
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
        _hsdp_worker.main(str(out / "hsdp.json"))
        _topology_worker.main(str(out / "topology.json"))
        if env.rank == 0:
            print("example:", flush=True)
        sys.argv = [str(EXAMPLE), *EXAMPLE_ARGS]
        runpy.run_path(str(EXAMPLE), run_name="fsdp_train")["main"]()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    fastddp.distributed.exit_after_shutdown()
