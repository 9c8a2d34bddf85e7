"""The launchers' roll call (fastddp/launch/roster.py): nodes launched with other settings end
before any worker starts, a missing node is named while the others wait."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fastddp.launch import cards, roster
from fastddp.testing import slack
from fastddp.testing.ports import free_port

from ._netns import two_nodes
from .test_launch import LAUNCH, WORKER, _children, _env, _finish, _kill

pytestmark = [pytest.mark.multiproc, pytest.mark.launcher]


def _card(**change):
    card = cards.Card("198.18.0.2", "gpu2", 1, 2, 2, "static", 0, "2.13.0", "0.1.0", 7)
    return cards.Card(**{**card.__dict__, **change})


def test_cards_that_disagree_on_the_nodes_or_the_backend_are_named():
    mine = _card(node_rank=0, address="198.18.0.1", host="gpu1")
    assert cards.disagreement(mine, _card()) is None
    said = cards.disagreement(mine, _card(max_nodes=3, min_nodes=3))
    assert said.startswith(
        "node 1 at 198.18.0.2 (gpu2) was launched with --nnodes 3, and node 0 at 198.18.0.1 "
        "(gpu1) with --nnodes 2: launch every node with the same --nnodes"
    ), said
    elastic = cards.disagreement(mine, _card(min_nodes=1, node_rank=None, backend="c10d"))
    assert elastic.startswith(
        "the node at 198.18.0.2 (gpu2) was launched with --nnodes 1:2 and the c10d rendezvous, "
        "and node 0 at 198.18.0.1 (gpu1) with --nnodes 2 and the static rendezvous"
    ), elastic
    assert cards.warnings(mine, _card()) == []
    lines = cards.warnings(mine, _card(torch="2.12.0", fastddp="0.0.9", max_restarts=3))
    assert [line.split(": ")[1] for line in lines] == [
        "node 1 at 198.18.0.2 (gpu2) runs torch 2.12.0, this node 2.13.0",
        "node 1 at 198.18.0.2 (gpu2) runs fastddp 0.0.9, this node 0.1.0",
        "node 1 at 198.18.0.2 (gpu2) has --max-restarts 3, this node 0",
    ]


def test_a_node_started_again_counts_once():
    # torch's static store counts connections: node 1 started twice makes three of --nnodes 3
    # while node 2 is missing. The roll call counts node ranks, so the workers do not start.
    from datetime import timedelta

    roll = roster.RollCall(("127.0.0.1", 1), "job", _card(max_nodes=3, min_nodes=3), timedelta())
    roll._cards = {1: _card(node_rank=0), 2: _card(), 3: _card(pid=8)}
    assert roll._signed_in() == 2
    assert roll.confirm(3).startswith("2 of the round's 3 nodes signed in at 127.0.0.1:1 within")
    elastic = roster.RollCall(("h", 1), "job", _card(node_rank=None), timedelta())
    elastic._cards = {1: _card(node_rank=None), 2: _card(node_rank=None)}
    elastic._waiting = 0  # (the thread's count of the nodes still to say their checks passed)
    assert elastic._signed_in() == 2 and elastic.confirm(2) is None


def test_a_failed_probe_holds_the_round_until_the_roll_call_ends_the_launch():
    # A probe's thread records its failure between two polls of the roll call, and the next
    # poll ends the launch with it: the round must not be confirmed in between, or every
    # node's workers would wait for Gloo's dropped connections until their timeout.
    from datetime import timedelta

    from fastddp.launch import reach

    def roll_call(problem):
        roll = roster.RollCall(("127.0.0.1", 1), "job", _card(node_rank=0), timedelta())
        roll._cards = {1: _card(node_rank=0), 2: _card()}
        roll._prober = reach.Prober("node 0 at 198.18.0.1", "127.0.0.1:1")
        roll._waiting = 0  # (the thread's count of the nodes still to say their checks passed)
        if problem:
            roll._prober.problems.append(problem)
        return roll

    assert roll_call(None).confirm(2) is None
    failed = "node 0 at 198.18.0.1 cannot reach node 1 at 198.18.0.2 on 198.18.0.2:40000"
    assert roll_call(failed).confirm(2) == failed


class _Ended(Exception):
    pass


def test_a_card_this_version_cannot_read_ends_the_roll_call_not_a_running_job(monkeypatch, capsys):
    # In the roll call such a card ends this launch (run the same fastddp everywhere); once
    # the job runs, node 0's watcher reads late launchers' cards too, and one of another
    # version ends alone: node 0's launcher used to end there, leaving its workers behind.
    import dataclasses
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import failures, reach, stop

    def ended(self, problem, post=True):
        raise _Ended(problem)

    def exited(code):
        raise _Ended(f"exit {code}")

    monkeypatch.setattr(roster.RollCall, "_end", ended)
    monkeypatch.setattr(stop, "end", exited)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    prefix, odd = "fastddp/roster/job/", b'{"address": "198.18.0.9", "shoe_size": 44}'
    for card in (_card(node_rank=0), _card(node_rank=1)):
        number = store.add(prefix + "count", 1)
        store.set(prefix + f"card/{number}", json.dumps(dataclasses.asdict(card)))
    store.set(prefix + f"card/{store.add(prefix + 'count', 1)}", odd)
    roll = roster.RollCall(("127.0.0.1", store.port), "job", _card(node_rank=0), timedelta())
    roll._mine, roll._prober = 1, reach.Prober("node 0 at 198.18.0.1", "127.0.0.1:1")
    with pytest.raises(_Ended, match=r"a node signed in with a card this fastddp .* cannot read"):
        roll._poll(store)
    names = ("node 0 at 198.18.0.1", "node 0 at 198.18.0.1")
    watcher = failures._Watcher(store, prefix, 1, 0, 2, "job", names)
    watcher._stop.set()
    for _ in range(2):
        watcher._read_cards()
    assert watcher.peers == {2: (1, _card(node_rank=1).name())} and watcher.ignored == {3}
    said = capsys.readouterr().err
    assert said.count("cannot read") == 1 and "the job goes on without it" in said, said


def test_a_node_checks_in_only_once_it_has_reached_the_nodes_already_there(monkeypatch):
    # Under c10d a node joins the job's next round once checked in, and the running job
    # restarts its workers for it: one that cannot reach the job's nodes must end before.
    import dataclasses
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import reach

    ended = []

    def end(self, problem, post=True):
        ended.append(problem)
        raise RuntimeError("ended")  # (the thread stops, as the process would)

    def no_answer(address, port):
        time.sleep(1.0)
        return "no answer within 5 s"

    monkeypatch.setattr(roster.RollCall, "_end", end)
    monkeypatch.setattr(reach.Prober, "_connect", staticmethod(no_answer))
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    prefix, running = "fastddp/roster/job/", _card(node_rank=None, listen_port=40000)
    store.set(
        prefix + f"card/{store.add(prefix + 'count', 1)}", json.dumps(dataclasses.asdict(running))
    )
    roll = roster.RollCall(
        ("127.0.0.1", store.port), "job", _card(node_rank=None), timedelta(seconds=30)
    )
    roll.start()
    try:
        roll.checked_in()
        assert ended and "cannot reach the node at 198.18.0.2" in ended[0], ended
    finally:
        roll.stop()


def test_a_node_rank_taken_twice_is_judged_before_its_cards_complete_the_round(monkeypatch):
    # Two live launchers with --node-rank 1 complete a round of 2 with node 0: the roll call
    # judges them (slow store round trips here) before confirm() may count them.
    import dataclasses
    import json
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    ended, alive = [], roster.RollCall._alive

    def end(self, problem, post=True):
        ended.append(problem)
        raise RuntimeError("ended")  # (the thread stops, as the process would)

    def slow_alive(self, number):
        time.sleep(0.0 if number == self._mine else 1.5)
        return alive(self, number)

    monkeypatch.setattr(roster.RollCall, "_end", end)
    monkeypatch.setattr(roster.RollCall, "_alive", slow_alive)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    prefix, numbers, beating = "fastddp/roster/job/", [], threading.Event()
    for pid in (101, 102):
        numbers.append(store.add(prefix + "count", 1))
        card = dataclasses.asdict(_card(node_rank=1, pid=pid))
        store.set(prefix + f"card/{numbers[-1]}", json.dumps(card))

    def beat():
        while not beating.wait(0.1):
            for number in numbers:
                store.add(prefix + f"beat/{number}", 1)

    threading.Thread(target=beat, daemon=True).start()
    roll = roster.RollCall(
        ("127.0.0.1", store.port), "job", _card(node_rank=0), timedelta(seconds=30)
    )
    roll.start()
    try:
        roll.confirm(2)
        assert not roll._confirmed, "the round was confirmed with node rank 1 taken twice"
        assert ended and ended[0].startswith("two launchers wait with --node-rank 1"), ended
    finally:
        beating.set()
        roll.stop()


def test_a_node_waits_for_the_others_check_and_ends_on_the_note_of_one_that_failed(monkeypatch):
    # Under c10d no watcher follows the roll call: node A, whose probe of B passed, used to
    # start at once and wait in torch's rendezvous for B's workers (60 s, then a traceback),
    # while B, which could not reach A, ended with the reason. Now A waits for B's check.
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import failures, reach

    ended, refused, real = {}, [], reach.Prober._connect

    def end(self, problem, post=True):
        ended[self.card.host] = problem
        if post:
            failures.post(self.store, self._prefix, problem, 5.0)
        raise RuntimeError("ended")  # (the thread stops, as the process would)

    def connect(address, port):
        if port in refused:  # (A's port, from B: a firewall that drops)
            time.sleep(0.5)
            return "no answer within 5 s"
        return real(address, port)

    monkeypatch.setattr(roster.RollCall, "_end", end)
    monkeypatch.setattr(reach.Prober, "_connect", staticmethod(connect))
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    rolls = {
        host: roster.RollCall(
            ("127.0.0.1", store.port),
            "job",
            _card(node_rank=None, host=host),
            timedelta(seconds=30),
        )
        for host in ("a", "b")
    }
    rolls["a"].start()
    rolls["a"].checked_in()
    refused.append(rolls["a"].card.listen_port)
    rolls["b"].start()
    confirmed = {}
    threads = [
        threading.Thread(target=lambda h=h: confirmed.update({h: rolls[h].confirm(2)}), daemon=True)
        for h in rolls
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(slack.guard(30))
    finally:
        for roll in rolls.values():
            roll.stop()
    assert not rolls["a"]._confirmed and not rolls["b"]._confirmed, (confirmed, ended)
    assert "cannot reach the node at 127.0.0.1 (a)" in ended["b"], ended
    assert ended["a"].startswith(ended["b"]) and "this launch ends too" in ended["a"], ended


@pytest.mark.parametrize("promised", [True, False])
def test_a_node_that_stopped_before_its_checks_passed_ends_the_round(monkeypatch, promised):
    # Static: node 1 signed in, then stopped (killed, or a signal before its failures note
    # could be posted). Node 0 waits for its checks: the round ends once node 1's heartbeat
    # has stopped, rather than at the rendezvous timeout (600 s by default). A card that
    # did not promise to say so (a launcher without this phase) is not waited for.
    import dataclasses
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import ready

    ended = []

    def end(self, problem, post=True):
        ended.append(problem)
        raise RuntimeError("ended")  # (the thread stops, as the process would)

    monkeypatch.setattr(roster.RollCall, "_end", end)
    monkeypatch.setattr(ready, "GONE_S", 1.0)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    prefix, stopped = "fastddp/roster/job/", _card(node_rank=1, listen_port=0)
    number = store.add(prefix + "count", 1)
    if promised:
        ready.promise(store, prefix, number)  # (what its launcher did at sign-in)
    store.set(prefix + f"card/{number}", json.dumps(dataclasses.asdict(stopped)))
    roll = roster.RollCall(
        ("127.0.0.1", store.port), "job", _card(node_rank=0), timedelta(seconds=30)
    )
    roll.start()
    try:
        assert roll.confirm(2) is None  # (ended: the thread stopped; or confirmed)
    finally:
        roll.stop()
    if not promised:
        assert roll._confirmed and ended == [], ended
        return
    assert not roll._confirmed and ended == [ready.gone_line(stopped.name())], ended
    assert "the launcher of node 1 at 198.18.0.2 (gpu2) stopped before its checks" in ended[0]


def test_node_0_keeps_its_store_until_the_others_read_its_note_of_a_silent_node(monkeypatch):
    # Node 0 names a silent node (the peer timeout) and stops; in a job of three nodes the
    # third reads node 0's note in its store, which must outlive that read (it would say
    # "node 0 is gone ... killed?" instead).
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import failures, stop

    monkeypatch.setattr(stop, "stop_self", lambda code: None)  # (the test's own process)
    monkeypatch.setattr(failures, "_peer_note", None)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    prefix, names = "fastddp/roster/job/", ("node 0 at 198.18.0.1", "node 0 at 198.18.0.1")
    watcher = failures._Watcher(store, prefix, 1, 0, 3, "job", names)
    watcher._quiet("node 2 at 198.18.0.3 has not answered node 0's launcher for 310 s")
    read = threading.Event()

    def the_others():  # node 1 reads the note, then node 2's launch ends
        assert store.get(prefix + "failed").decode().startswith("fnode 0 at 198.18.0.1 stopped")
        time.sleep(0.5)
        store.add(prefix + "let_go", 2)
        read.set()

    threading.Thread(target=the_others, daemon=True).start()
    failures._end(watcher, None, False)
    assert read.is_set(), "node 0's launch ended before the others were done with its store"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer_timeout, limit", [(None, "0"), ("20", "30")])
def test_the_launchers_silent_node_watch_follows_the_workers_default_for_the_job_size(
    peer_timeout, limit
):
    # 2 nodes x 33 workers: 66 ranks, whose watchdogs are off by default (on up to 64). The
    # launchers' watch of a silent node used to count one rank, and stayed on at 300 s + 10;
    # it now counts the job's ranks, and FASTDDP_PEER_TIMEOUT set turns both on at any size.
    # (The workers are `true`: the launchers' watch starts before them, and ends after.)
    port = free_port()
    cmds = [[*_static(port, 2, r, "--no-python", nproc=33)[:-1], "true"] for r in (0, 1)]
    results = _finish([_launcher(c, _telling_the_watch(peer_timeout)) for c in cmds], timeout=90)
    for rc, out in results:
        assert rc == 0, out
        assert f"quiet limit {limit}\n" in out, out


@pytest.mark.timeout(120)
def test_nodes_with_other_nproc_per_node_watch_for_the_job_s_summed_ranks_alike():
    # Node 0 runs 3 workers, node 1 one: 4 ranks. Each launcher used to count --nnodes x its
    # own --nproc-per-node (6 and 2): around the default's 64 ranks one node would watch for
    # a silent node and the other not. Both now sum the roll call's cards, and warn of it.
    port = free_port()
    cmds = [
        [*_static(port, 2, r, "--no-python", nproc=n)[:-1], "true"] for r, n in ((0, 3), (1, 1))
    ]
    results = _finish([_launcher(c, _telling_the_watch()) for c in cmds], timeout=90)
    for rc, out in results:
        assert rc == 0, out
        assert "watching 4 ranks\n" in out and "quiet limit 310\n" in out, out
        uneven = "warning: the nodes run different numbers of workers (--nproc-per-node: 1 on "
        assert uneven + "node 1 at 127.0.0.1 (" in out and "; 3 on node 0 at 127.0.0.1 (" in out


def test_the_job_s_ranks_are_summed_over_one_card_a_node():
    # A node rank's card whose launcher is gone (a node started again) counts no more, and an
    # older fastddp's card, which does not say, counts as many as this node's.
    import dataclasses
    import json

    mine = _card(node_rank=0, nproc_per_node=3)
    older = {k: v for k, v in dataclasses.asdict(_card()).items() if k != "nproc_per_node"}
    known = {1: mine, 2: _card(nproc_per_node=8), 3: _card(nproc_per_node=1)}
    assert cards.ranks(cards.members(known, {2}), mine) == 4
    assert cards.ranks(cards.members(known, {3}), mine) == 11
    known[4] = cards.read(json.dumps(older).encode())
    assert cards.ranks(cards.members(known, set()), mine) == 6
    assert cards.uneven([mine, known[4]]) is None


def _telling_the_watch(peer_timeout=None):
    """A launcher patch: its silent-node watch says the ranks it counts and its quiet limit,
    ``FASTDDP_PEER_TIMEOUT`` set to ``peer_timeout`` (None: unset)."""
    setting = "os.environ.pop('FASTDDP_PEER_TIMEOUT', None)"
    if peer_timeout is not None:
        setting = f"os.environ['FASTDDP_PEER_TIMEOUT'] = {peer_timeout!r}"
    return (
        f"import os; {setting}\n"
        "import fastddp.launch.failures as failures\n"
        "def timeout(env, world, _timeout=failures.peer_timeout_from_env):\n"
        "    print(f'watching {world} ranks', flush=True)\n"
        "    return _timeout(env, world)\n"
        "def watch(*args, _watch=failures.watch):\n"
        "    _watch(*args)\n"
        "    print(f'quiet limit {failures._watcher.quiet_limit:g}', flush=True)\n"
        "failures.peer_timeout_from_env, failures.watch = timeout, watch\n"
    )


def _launcher(args, patch=""):
    """A launcher, its roster module patched first (``patch``: lines run after importing it)."""
    code = (
        "import runpy, sys\n"
        "import fastddp.launch.roster as roster\n"
        f"{patch}\n"
        f"sys.argv[1:] = {list(args)!r}\n"
        "runpy.run_module('fastddp.launch', run_name='__main__', alter_sys=True)\n"
    )
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen([sys.executable, "-c", code], env=_env(), **merged)


def _static(port, nnodes, rank, *extra, nproc=1):
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port), *extra, WORKER]  # fmt: skip


def _c10d(port, nnodes):
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "roster", WORKER]  # fmt: skip


def _wait_for(proc, text, lines):
    """Read ``proc``'s output into ``lines`` until a line holds ``text``."""
    deadline = time.monotonic() + slack.guard(60)
    for line in proc.stdout:  # ends if the process exits
        lines.append(line)
        if text in line or time.monotonic() > deadline:
            break
    assert text in "".join(lines), "".join(lines)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_node_launched_with_other_nnodes_ends_every_launcher(backend):
    # Without the roll call, the static rendezvous forms with node 0's count and the workers
    # wait in init_process_group; c10d's rounds never agree. Here both launchers end at once.
    # (Each ends on the other's card, or on the note of the one that read it first.)
    port = free_port()
    if backend == "static":
        first, second = _static(port, 2, 0), _static(port, 3, 1)
        said = ("node 1 at 127.0.0.1 (", "node 0 at 127.0.0.1 (", " was launched with --nnodes ")
    else:
        first, second = _c10d(port, "2"), _c10d(port, "1:2")
        said = ("the node at 127.0.0.1 (", " was launched with --nnodes ", ", and the node at ")
    node0, lines = _launcher(first), []
    _wait_for(node0, "this node hosts the rendezvous", lines)
    results = _finish([node0, _launcher(second)], timeout=90)
    told = [("".join(lines) if i == 0 else "") + out for i, (_, out) in enumerate(results)]
    for (rc, _), text in zip(results, told):
        assert rc == 2, text
        error = [line for line in text.splitlines() if "fastddp.launch: error: " in line]
        assert len(error) == 1 and all(part in error[0] for part in said), text
        assert "launch every node with the same --nnodes and --rdzv-backend" in error[0], text
        if backend == "static":  # node 0 says 2 and node 1 says 3, whoever wrote the line
            assert "--nnodes 2" in error[0] and "--nnodes 3" in error[0], text
        else:
            assert "--nnodes 2" in error[0] and "--nnodes 1:2" in error[0], text
        assert "worker ok" not in text and "Traceback" not in text, text


def test_two_launchers_with_one_node_rank_end_every_launcher():
    # Node 0's static store counts three connections and the rendezvous forms: without the
    # roll call, node 0's worker would wait for a node rank 2 that never comes.
    port = free_port()
    node0, lines = _launcher(_static(port, 3, 0)), []
    _wait_for(node0, "this node hosts the rendezvous", lines)
    results = _finish(
        [node0, _launcher(_static(port, 3, 1)), _launcher(_static(port, 3, 1))], timeout=90
    )
    for rc, out in results:
        assert rc == 2, out
        assert "error: two launchers wait with --node-rank 1: at 127.0.0.1" in out, out
        assert "give every node its own --node-rank, from 0 to 2" in out, out
        assert "worker ok" not in out, out


@pytest.mark.faults
def test_a_late_launcher_with_a_running_nodes_rank_ends_alone(tmp_path):
    # Static rendezvous: a third launcher with node 1's rank, once the workers run. Without
    # the running launchers' heartbeat it was taken for a node started again, and joined the
    # next round, for which node 0's agent restarted its workers. It ends alone instead.
    port, script = free_port(), os.path.join(os.path.dirname(WORKER), "_failing_worker.py")
    cmds = [[*LAUNCH, *_static(port, 2, r, nproc=2)[:-1], script] for r in (0, 1, 1)]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    env = _env(HOLD_S=120, HOLD_UNTIL=str(tmp_path / "go"))
    procs = [subprocess.Popen(c, env=env, **merged) for c in cmds[:2]]
    seen = [[], []]
    try:
        for p, lines in zip(procs, seen):
            _wait_for(p, "worker joined", lines)
        late = _finish([subprocess.Popen(cmds[2], env=env, **merged)], timeout=60)[0]
    finally:
        (tmp_path / "go").touch()
        results = _finish(procs, timeout=60)
    rc, out = late
    assert rc == 2, out
    assert "error: --node-rank 1 is taken: the job running at 127.0.0.1:" in out, out
    assert "has a launcher with it at 127.0.0.1" in out and "the job goes on" in out, out
    told = ["".join(lines) + text for lines, (_, text) in zip(seen, results)]
    assert [r for r, _ in results] == [0, 0], told
    # (Workers restarted for the late one would wait for it, and fail.)
    assert "".join(told).count("worker ok") == 4, told


def test_a_missing_node_is_named_while_the_others_wait_and_the_job_then_runs():
    # Node 0 says which node rank is missing, again and again; node 1 comes with another
    # fastddp version, which is warned of on both sides, and the job runs.
    port = free_port()
    often = "roster.SAY_AFTER_S = 1.0; roster.SAY_EVERY_S = 1.0"
    node0, lines = _launcher(_static(port, 2, 0), often), []
    missing = "missing node rank(s) 1: start them with --nnodes 2"
    _wait_for(node0, missing, lines)
    _wait_for(node0, missing, lines)  # once more: it keeps saying it
    older = "import fastddp.launch.cards as cards; cards.__version__ = '0.0.9'"
    node1 = _launcher(_static(port, 2, 1), older)
    results = _finish([node0, node1], timeout=90)
    text0, text1 = "".join(lines) + results[0][1], results[1][1]
    assert [rc for rc, _ in results] == [0, 0], (text0, text1)
    assert "waiting for the other nodes at 127.0.0.1:" in text0, text0
    assert "1 of 2 signed in (node 0 at 127.0.0.1" in text0, text0
    assert "all 2 nodes have signed in; the workers start" in text0, text0
    assert "warning: node 1 at 127.0.0.1" in text0 and "runs fastddp 0.0.9, this node" in text0
    assert "warning: node 0 at 127.0.0.1" in text1 and "this node 0.0.9" in text1, text1
    assert "worker ok" in text0 + text1


def test_a_node_that_does_not_sign_in_is_named_within_the_rendezvous_timeout():
    # Node 1 is plain torchrun: it joins torch's rendezvous but never signs in, so node 0's
    # workers would wait for a store it does not read. Node 0 ends with the cause instead.
    # (Node 1 starts first and retries until node 0's store listens: its joining is no race.)
    port = free_port()
    plain = [sys.executable, "-m", "torch.distributed.run", *_static(port, 2, 1)]
    node1 = subprocess.Popen(plain, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        node0 = _launcher(_static(port, 2, 0, "--rdzv-conf", "timeout=10"))
        (rc, out), = _finish([node0], timeout=90)  # fmt: skip
    finally:
        node1.kill()
        node1.wait()
    assert rc == 1, out
    assert "error: 1 of the round's 2 nodes signed in at 127.0.0.1:" in out, out
    assert "within 10 s (node 0 at 127.0.0.1" in out and "launch every node with fastddp" in out


@pytest.mark.faults
@pytest.mark.parametrize("failing", [0, 1])
def test_a_node_whose_workers_fail_stops_the_others(failing):
    # Two ranks a node; one rank of the failing node exits at start. The other node's workers
    # would wait in init_distributed for the failed node's ranks until their timeout; its
    # launcher reads the failed node's note and stops them instead. Node 0 serves both
    # stores: failing, it keeps them until node 1 has read its note.
    port, script = free_port(), os.path.join(os.path.dirname(WORKER), "_failing_worker.py")
    cmds = [_static(port, 2, r, nproc=2)[:-1] + [script] for r in (0, 1)]
    env = _env(FAIL_NODE=failing, FAIL_LOCAL_RANK=1)
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen([*LAUNCH, *c], env=env, **merged) for c in cmds]
    results = _finish(procs, timeout=60)
    (failed_rc, failed), (other_rc, other) = results[failing], results[1 - failing]
    assert failed_rc == 1 and "error: workers failed" in failed, failed
    rank = 2 * failing + 1
    note = f"error: node {failing} at 127.0.0.1 ("
    assert note in other and f"failed: its rank {rank} exited with 1" in other, other
    assert "stopping this node's workers, which cannot go on without that node" in other, other
    assert other_rc == 1 and "worker ok" not in other and "Traceback" not in other, other


@pytest.mark.faults
def test_a_node_whose_workers_restart_alone_brings_the_others_along():
    # Static rendezvous, --max-restarts 1: node 1's rank fails once and its agent restarts it
    # into the next round, which torch's static handler never tells node 0 of (its workers
    # would wait for node 1's first-round ranks, and node 1 for node 0's round store). Counted
    # as a node waiting, node 0's agent restarts its workers too, and the job runs.
    port, script = free_port(), os.path.join(os.path.dirname(WORKER), "_failing_worker.py")
    # Two ranks a node; node 1's local rank 1 fails.
    extra = ("--max-restarts", "1")
    cmds = [[*LAUNCH, *_static(port, 2, r, *extra, nproc=2)[:-1], script] for r in (0, 1)]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    env = _env(FAIL_NODE=1, FAIL_LOCAL_RANK=1, FAIL_ONCE=1)
    results = _finish([subprocess.Popen(c, env=env, **merged) for c in cmds], timeout=90)
    text = "".join(out for _, out in results)
    assert [rc for rc, _ in results] == [0, 0], text
    assert text.count("worker ok") == 4 and "cannot start" in text, text


@pytest.mark.faults
@pytest.mark.parametrize("stopped", ["node 1", "both"])
def test_a_node_stopped_by_a_signal_stops_the_others_unless_they_stop_too(stopped):
    # A scheduler that ends the job signals every node: none must then be signalled again for
    # another's note (a second SIGTERM would interrupt torch's stopping of the workers).
    port, script = free_port(), os.path.join(os.path.dirname(WORKER), "_failing_worker.py")
    cmds = [[*LAUNCH, *_static(port, 2, r)[:-1], script] for r in (0, 1)]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen(c, env=_env(HOLD_S=120), **merged) for c in cmds]
    lines = [[], []]
    try:
        for p, seen in zip(procs, lines):
            _wait_for(p, "worker joined", seen)
        for p in procs if stopped == "both" else procs[1:]:
            p.send_signal(signal.SIGTERM)
    finally:
        results = _finish(procs, timeout=60)
    told = ["".join(seen) + out for seen, (_, out) in zip(lines, results)]
    assert results[1][0] == 128 + signal.SIGTERM, told[1]
    if stopped == "both":
        assert results[0][0] == 128 + signal.SIGTERM, told[0]
        assert "stopping this node's workers" not in "".join(told), told
    else:
        assert results[0][0] == 1, told[0]
        assert "failed: stopped by SIGTERM; stopping this node's workers" in told[0], told[0]
    assert "worker ok" not in "".join(told) and "Traceback" not in "".join(told), told


@pytest.mark.faults
def test_a_node_stopped_by_a_signal_before_its_workers_start_tells_the_others():
    # Node 1's launcher waits in C++ for node 0's round (node 0 held after its roll call), so
    # stop.py's thread ends it; it used to end it without a note, and node 0 waited for node
    # 1's silence (the peer timeout, 300 s) to blame the network.
    port = free_port()
    hold = (
        "import time\n_confirm = roster.RollCall.confirm\n"
        "def confirm(self, n):\n    found = _confirm(self, n)\n    time.sleep(6.0)\n"
        "    return found\nroster.RollCall.confirm = confirm\n"
    )
    handed = (
        "_hand_over = roster.RollCall.hand_over\n"
        "def hand_over(self):\n    _hand_over(self)\n    print('handed over', flush=True)\n"
        "roster.RollCall.hand_over = hand_over\n"
    )
    node0 = _launcher(_static(port, 2, 0), hold)
    node1 = _launcher(_static(port, 2, 1), handed)
    lines = []
    try:
        _wait_for(node1, "handed over", lines)
        time.sleep(1.0)  # (into the C++ wait)
        node1.send_signal(signal.SIGTERM)
    finally:
        (rc1, out1), (rc0, out0) = _finish([node1, node0], timeout=60)
    assert rc1 == 128 + signal.SIGTERM, "".join(lines) + out1
    # (Node 0 reads the note in its roll call or after it: its launch ends either way.)
    assert rc0 in (1, 2) and "node 1 at 127.0.0.1" in out0, out0
    assert "failed: stopped by SIGTERM" in out0 and "has not answered" not in out0, out0


@pytest.mark.faults
@pytest.mark.parametrize("moment", ["starting", "joining", "running"])
def test_a_node_whose_launcher_is_killed_stops_the_others(moment):
    # Node 0's launcher SIGKILLed (its host still up): its store closes without a word. Node
    # 1's workers would wait for node 0's ranks until their timeouts ("starting": they join
    # late, and their store client tries to connect for init_distributed's 10 minutes), and
    # its launcher in silence. Workers that wait in the store when it closes ("joining",
    # mostly) fail at once, and their launcher says why.
    port, script = free_port(), os.path.join(os.path.dirname(WORKER), "_failing_worker.py")
    cmds = [[*LAUNCH, *_static(port, 2, r, nproc=2)[:-1], script] for r in (0, 1)]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    slow = {"starting": 1, "joining": 0}.get(moment)
    env = _env(HOLD_S=120, **({} if slow is None else {"SLOW_NODE": slow}))
    procs = [subprocess.Popen(c, env=env, **merged) for c in cmds]
    orphans = []
    try:
        if moment == "joining":
            _wait_for(procs[0], "worker started", [])
        else:
            _wait_for(procs[1], "worker started" if slow else "worker joined", [])
        deadline = time.monotonic() + slack.guard(30)
        while len(orphans) < 2 and time.monotonic() < deadline:
            orphans = _children(procs[0].pid)  # node 0's workers, which outlive it
            time.sleep(0.05)
        procs[0].kill()
        start = time.monotonic()
        rc, out = _finish(procs[1:], timeout=60)[0]
        took = time.monotonic() - start
    finally:
        _kill(orphans)  # (they hold its output open)
        _finish(procs, timeout=30)
    assert len(orphans) == 2, orphans
    assert rc == 1, out
    assert "error: node 0 at 127.0.0.1 (" in out, out
    assert "is gone: the rendezvous store its launcher served closed without that launch" in out
    assert "worker ok" not in out and took < slack.guard(30), (took, out)
    if "error: workers failed" in out:  # (they were in the store)
        assert moment == "joining" and "and this node's workers failed with it" in out, out
    else:
        assert "stopping this node's workers" in out, out
        # A worker that waited in the store may fail as it closes, with its own traceback,
        # before its agent has noticed (on a busy machine): "joining" only.
        assert "Traceback" not in out or moment == "joining", out


def test_a_peer_that_does_not_answer_is_named_with_both_addresses(monkeypatch):
    # A refused connection passes where the launcher there has exited (a node started again
    # leaves its old card behind), and is a firewall that rejects where it runs; one without
    # an answer (a firewall that drops: the namespace test below) names both nodes.
    from fastddp.launch import reach

    port, free = reach.listen("127.0.0.1"), free_port()
    assert reach.Prober._connect("127.0.0.1", port) is None
    assert reach.Prober._connect("127.0.0.1", free) == reach.REFUSED
    prober = reach.Prober("node 0 at 198.18.0.1", "198.18.0.1:29500")
    for key in (1, 2, 3):
        prober.probe(f"node {key} at 127.0.0.1", "127.0.0.1", free, key)
    deadline = time.monotonic() + slack.guard(30)
    while len(prober.refused) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    prober.judge_refused({1: None, 2: False, 3: True}.get)
    assert prober.pending() and list(prober.refused) == [1], prober.refused  # 1: not known yet
    assert len(prober.problems) == 1 and "cannot reach node 3 at 127.0.0.1" in prober.problems[0]
    assert (
        "(connection refused, though that launcher runs: a firewall that rejects)"
        in (prober.problems[0])
    )
    monkeypatch.setattr(reach.Prober, "_connect", staticmethod(lambda a, p: "no answer"))
    prober = reach.Prober("node 1 at 198.18.0.2", "198.18.0.1:29500")
    prober.probe("node 0 at 198.18.0.1", "198.18.0.1", 40000)
    prober.probe("a node that listens nowhere", "198.18.0.3", 0)
    deadline = time.monotonic() + slack.guard(30)
    while prober.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prober.problems == [
        "node 1 at 198.18.0.2 cannot reach node 0 at 198.18.0.1 on 198.18.0.1:40000, a port "
        "the kernel picked (no answer), though both reach the rendezvous at 198.18.0.1:29500: "
        "Gloo and NCCL connect every pair of nodes on such ports; let the nodes' addresses "
        "reach each other on every port (a firewall between them?)"
    ]


@pytest.mark.netns
@pytest.mark.skipif(shutil.which("nft") is None, reason="the firewall needs nft (nftables)")
@pytest.mark.parametrize("verdict", ["drop", "reject with tcp reset"])
def test_nodes_behind_a_firewall_that_passes_only_the_masters_port_are_told_so(verdict):
    # Without the probes the rendezvous forms and the workers wait in init_process_group for
    # Gloo's connections, which the firewall drops (or refuses: Gloo tries again), until its
    # timeout.
    with two_nodes() as (a, b):
        port = free_port()
        rules = (
            "add table inet fastddp_fw\n"
            "add chain inet fastddp_fw input { type filter hook input priority 0; }\n"
            # Stateful, as firewalls are: node 0's own connections get their answers.
            "add rule inet fastddp_fw input ct state established,related accept\n"
            f"add rule inet fastddp_fw input iifname {a['dev']} tcp dport != {port} {verdict}\n"
        )
        subprocess.run(["ip", "netns", "exec", a["ns"], "nft", "-f", "-"], input=rules,
                       check=True, capture_output=True, text=True, timeout=30)  # fmt: skip
        line = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", a["addr"],
                "--master-port", str(port), WORKER]  # fmt: skip
        cmds = [["ip", "netns", "exec", n["ns"], *LAUNCH, "--node-rank", str(r), *line]
                for r, n in ((1, b), (0, a))]  # fmt: skip
        merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        results = _finish([subprocess.Popen(c, env=_env(), **merged) for c in cmds], 120)
    for rc, out in results:
        assert rc == 2, out
        # (Whichever node's probe fails first, the other may end with its note.)
        assert f"cannot reach node 0 at {a['addr']}" in out or "cannot reach node 1 at" in out
        why = "no answer within 5 s" if verdict == "drop" else "connection refused, though"
        assert f"a port the kernel picked ({why}" in out, out
        assert "worker ok" not in out and "Traceback" not in out, out
