"""DiLoCo on real nodes: 2 network namespaces x 2 ranks joined by a 30 Mbit/s link.

``examples/diloco_train.py`` under ``fastddp.launch``, one launcher per node: DDP inside each
node, int8 with error feedback across the slow link every 10 steps. The job learns, every rank
ends with the same weights, and each rank sent across nodes only its half of the model (the
node's two ranks split it) in int8. Needs root; skipped cleanly otherwise.
"""

import re
import subprocess
from pathlib import Path

import pytest

from fastddp.testing import netns, slack

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiproc,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "namespaces"
    ),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "diloco_train.py"
PARAMS = 32 * 256 + 256 + 256 * 8 + 8  # the example's model


def test_the_example_trains_two_nodes_of_two_ranks_over_a_slow_link():
    argv = [str(EXAMPLE), "--steps", "40", "--sync-every", "10", "--compress", "int8-ef"]
    with netns.nodes(2, "30mbit") as made:
        procs = netns.start(made, "2", argv, stdout=subprocess.PIPE, env=None)
        try:
            outs = [p.communicate(timeout=slack.guard(200))[0] for p in procs]
        finally:
            netns.stop(procs)
    node0 = outs[-1] if isinstance(outs[-1], str) else outs[-1].decode()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "int8-ef: 2 node(s) x 2 rank(s), 4 rounds" in node0, node0
    assert "weights identical on every rank: True" in node0, node0
    losses = [float(v) for v in re.findall(r"step +\d+ round \d+ loss (\S+)", node0)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2, losses
    # Rank 0 averages half of the model with rank 2 each round: about one byte an element of
    # its half (int8 and a scale per block), against the 4 of fp32 for the whole model.
    sent = int(re.search(r"rounds, (\d+) bytes across nodes", node0).group(1))
    assert 4 * PARAMS / 2 <= sent <= 4 * PARAMS / 2 * 1.1, sent
