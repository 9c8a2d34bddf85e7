"""The two-level path on real nodes: 2 network namespaces x 2 ranks on a 1 Gbit/s link.

Every codec matches plain DDP there, and the bytes the nodes' links really sent (interface
counters) are what ``stats()`` reports: fastddp's own cross-node bytes, and the fp32 ring's
estimate against plain DDP's measured traffic. Needs root; skipped cleanly otherwise.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastddp import netns

ROOT = Path(__file__).resolve().parents[1]


def test_two_nodes_of_two_ranks_over_a_real_link(tmp_path):
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    out = tmp_path / "topology.json"
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", "--nproc-per-node", "2"]
    cmd += ["--rate", "1gbit", "--timeout", "150", "tests/_topology_worker.py", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["world"], report["nodes"]) == (4, 2)
    for name, row in report["codecs"].items():
        assert row["topology_used"] == "hierarchical", name
        assert row["nodes"] == [[0, 1], [2, 3]], name
        # What left the nodes is what stats() counted, plus TCP/IP headers.
        ratio = row["link_bytes"] / row["counted_cross_node_bytes"]
        assert 1.0 <= ratio <= 1.1, f"{name}: link sent {ratio:.3f}x the counted bytes"
        # The fp32 ring estimate is what plain DDP (Gloo's ring) really sent.
        ring = row["plain_ddp_link_bytes"] / row["counted_fp32_ring_cross_node_bytes"]
        assert 1.0 <= ring <= 1.1, f"{name}: plain DDP sent {ring:.3f}x the ring estimate"
        # 16-bit on 1/L of each bucket: a third of the fp32 ring's cross-node bytes here.
        assert row["link_bytes"] < row["plain_ddp_link_bytes"] / 2.5, name
