"""``dtype="auto"`` re-plans when the link between two nodes (of two ranks each) slows down.

The job starts on a fast link and plans; the test then lowers both nodes' rate to 20 Mbit/s.
The plan's step must drift from what was measured, and a new trial must choose int8 with
error feedback (for every bucket, or as the uniform choice a mixed plan was held against),
having measured fp32 far slower than int8, and the rate across nodes lower than before and
under 10 MB/s.
Needs root; skipped otherwise.
"""

import json
import time
from pathlib import Path

import pytest

from fastddp.testing import netns, slack

pytestmark = [pytest.mark.netns, pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("_auto_worker.py")


def test_a_link_that_slows_down_is_planned_for_again(tmp_path):
    out, slowed = tmp_path / "plans.json", tmp_path / "slowed"
    with netns.nodes(2, "10gbit") as made:
        procs = netns.start(made, "2", [str(WORKER), str(out), str(slowed)])
        try:
            deadline = time.monotonic() + slack.guard(150)
            while not Path(str(out) + ".planned").exists():
                assert time.monotonic() < deadline, "no plan in time"
                assert all(p.poll() is None for p in procs), "a launcher exited before a plan"
                time.sleep(0.2)
            for node in made:
                # A 32 KB burst: int8's 0.27 MB a step across nodes must feel the rate, however
                # long the bucket had to fill since the last step (512 KB let it all through).
                netns.set_rate(node, "20mbit", burst="32kb")
            slowed.touch()
            codes = [p.wait(timeout=slack.guard(200)) for p in procs]
        finally:
            netns.stop(procs)
    assert codes == [0, 0], codes
    report = json.loads(out.read_text())
    first, last = report["plans"][0], report["plans"][-1]
    assert report["slowed_at"] is not None and last["made_at_step"] > report["slowed_at"], report
    assert last["uniform"] == "int8-ef", report
    # fp32 against int8 in the same trial, their turns interleaved: a load on the machine
    # slows both alike. (Against the first plan's fp32 step it is not: under a full suite
    # that trial once measured fp32 at 625 ms on the fast link, against 802 on the slow one.)
    assert last["step_ms"]["none"] > 2 * last["step_ms"]["int8-ef"], report
    # What the collectives measured of each level, int8's two-level path: the slowed link
    # (2.5 MB/s) gives less than the fast one, and less than the node's own loopback. Both of
    # those are CPU-bound on a busy 2-core machine, and the fast link was measured at another
    # time, under another load: the loopback measured 20.7 MB/s against the slowed link's 5.6,
    # and on a slower CPU the unslowed 10 Gbit/s link 16 MB/s against the slowed one's 3.65.
    # So the bound on the slowed link is absolute (a load only lowers a rate), and the
    # comparisons only say which is faster.
    fast, slow = first["links"], last["links"]
    assert slow["cross"]["MBps"] < 10 and slow["cross"]["MBps"] < fast["cross"]["MBps"], report
    assert slow["intra"]["MBps"] > slow["cross"]["MBps"], report
