"""python -m fastddp.launch and fastddp.init_distributed, with real processes and sockets."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from fastddp.testing import netns, slack
from fastddp.testing.ports import free_port

from ._netns import lonely_node, two_nodes

pytestmark = [pytest.mark.multiproc, pytest.mark.launcher]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "_ddp_worker.py")
LAUNCH = [sys.executable, "-m", "fastddp.launch"]

# Variables a test must not inherit: the launcher would read them.
_STRIP = (
    "PET_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "GLOO_",
    "NCCL_",
    "MASTER_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "ADDR",
    "PORT",
    "TORCHELASTIC_",
    "GROUP_RANK",
)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(*args, **env):
    """Run the launcher in the foreground; for runs that start no workers."""
    cmd = [*LAUNCH, *args]
    return slack.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=slack.guard(60))


def _python(code):
    cmd = [sys.executable, "-c", code]
    return slack.run(cmd, env=_env(), capture_output=True, text=True, timeout=slack.guard(60))


def _run_all(cmds, timeout=150, envs=None):
    """Start every command, wait for all; kill them all if the time (a hang guard, scaled to
    the machine) runs out."""
    envs = envs or [_env() for _ in cmds]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return _finish([subprocess.Popen(c, env=e, **merged) for c, e in zip(cmds, envs)], timeout)


def _finish(procs, timeout):
    """``(exit code, output)`` of every process, killing them all once ``timeout`` seconds (a
    hang guard, scaled to the machine) have passed; a process killed so fails the test with
    every process's output (each launcher's side of the hang)."""
    deadline = time.monotonic() + slack.guard(timeout)
    outs, killed = [], []
    try:
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop(p)
                out, _ = p.communicate()
                killed.append(i)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                _stop(p)
                p.communicate()
    if killed:
        said = "".join(f"\n--- process {i} ({procs[i].args}):\n{out}" for i, out in enumerate(outs))
        raise AssertionError(f"process(es) {killed} ran past {slack.guard(timeout):.0f} s:{said}")
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def _stop(proc):
    # Its workers too: torch starts them in sessions of their own, and a killed launcher's
    # workers would hold its output open.
    _kill([*_children(proc.pid), proc.pid])


def _children(pid):
    """The pids of ``pid``'s child processes (none once it has exited)."""
    found, tasks = [], []
    with contextlib.suppress(OSError):
        tasks = os.listdir(f"/proc/{pid}/task")
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _kill(pids):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ok(results, workers):
    for rc, out in results:
        assert rc == 0, out
    text = "".join(out for _, out in results)
    assert text.count("worker ok") == workers, text
    return text


def test_help_lists_torchrun_and_fastddp_options():
    out = _launch("--help").stdout
    for option in (
        "--nproc-per-node",
        "--nproc_per_node",
        "--rdzv-backend",
        "--max-restarts",
        "--master-addr",
        "--cluster",
        "--dry-run",
        "--no-preflight",
    ):
        assert option in out


def test_help_without_the_compiled_extension():
    # The launcher runs on nodes without a build of fastddp._C (None in sys.modules makes its
    # import fail, as a missing build does): `import fastddp` must not need it.
    code = (
        "import runpy, sys\n"
        "sys.modules['fastddp._C'] = None\n"
        "import fastddp\n"
        "assert 'fastddp.ops' not in sys.modules, 'import fastddp loaded the compiled ops'\n"
        "sys.argv[1:] = ['--help']\n"
        "runpy.run_module('fastddp.launch', run_name='__main__', alter_sys=True)\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: python -m fastddp.launch"), res.stdout
    assert "--preflight-timeout" in res.stdout and "--max-restarts" in res.stdout


def test_a_rank_started_by_hand_says_it_waits_for_the_others():
    # Rank 0 serves the store and waits for rank 1, which never comes; then rank 1 of another
    # job waits for a rank 0 that never serves. Each says so before its timeout, and rank 0
    # names the missing rank at it.
    code = (
        "import os, sys\n"
        "from datetime import timedelta\n"
        "import fastddp, fastddp.joining as j\n"
        "j.WAIT_SAY_S = 0.5\n"
        "for rank, port in ((0, sys.argv[1]), (1, sys.argv[2])):\n"
        "    os.environ.update(RANK=str(rank), WORLD_SIZE='2', LOCAL_RANK='0',\n"
        "                      MASTER_ADDR='127.0.0.1', MASTER_PORT=port)\n"
        "    try:\n"
        "        fastddp.init_distributed(backend='gloo', timeout=timedelta(seconds=3))\n"
        "    except Exception as e:\n"
        "        print('raised', type(e).__name__, e, flush=True)\n"
    )
    ports = [str(free_port()), str(free_port())]
    res = slack.run([sys.executable, "-c", code, *ports], env=_env(), timeout=slack.guard(60))
    assert res.stdout.count("raised") == 2, res.stdout + res.stderr
    said = "s for the others, and 1 of 2 rank(s) never came (1); start every rank"
    assert "raised ClusterError fastddp.init_distributed: rank 0 waited" in res.stdout, res.stdout
    assert said in res.stdout, res.stdout
    for rank, port in zip((0, 1), ports):
        line = f"rank {rank} has waited 0.5 s for the other 1 rank(s) at 127.0.0.1:{port}; start"
        assert line in res.stderr, res.stderr


def test_every_rank_that_came_names_the_rank_that_never_did(tmp_path):
    # Ranks 0 and 1 of 3 started by hand, rank 2 never. Rank 0, whose process serves the
    # store, waits first (rank 1 starts once rank 0 says it waits), so it gives up first: it
    # posts why and stays until rank 1 has read it, and both raise the same ClusterError.
    # Rank 1 would otherwise find the store gone, and fail in torch's terms.
    code = (
        "import os, sys\n"
        "from datetime import timedelta\n"
        "import fastddp, fastddp.joining as j\n"
        "j.WAIT_SAY_S = 0.5\n"
        "os.environ.update(RANK=sys.argv[1], WORLD_SIZE='3', LOCAL_RANK=sys.argv[1],\n"
        "                  MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[2])\n"
        "try:\n"
        "    wait = timedelta(seconds=int(sys.argv[3]))\n"
        "    fastddp.init_distributed(backend='gloo', timeout=wait)\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__, e, flush=True)\n"
    )
    # Long enough for rank 1's start on a loaded machine: it must arrive before rank 0 gives up
    # (8 s was too short twice under CI's load).
    port, procs, errs, wait = str(free_port()), [], [], round(slack.guard(16))
    for rank in (0, 1):
        errs.append(tmp_path / f"rank{rank}.err")
        with open(errs[-1], "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(rank), port, str(wait)],
                    env=_env(),
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            )
        deadline = time.monotonic() + slack.guard(30)
        while rank == 0 and "rank 0 has waited 0.5 s" not in errs[0].read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, errs[0].read_text()
            time.sleep(0.05)
    outs = [p.communicate(timeout=slack.guard(60))[0] for p in procs]
    # (the seconds as rank 0 rounds them: a stall on a loaded machine may add one)
    said = re.compile(
        r"rank 0 waited \d+ s for the others, and 1 of 3 rank\(s\) never came \(2\); start"
    )
    for p, out, err in zip(procs, outs, errs):
        assert p.returncode == 0 and out.startswith("raised ClusterError "), out + err.read_text()
    told = [said.search(out) for out in outs]
    assert all(told) and told[0].group(0) == told[1].group(0), outs


@pytest.mark.parametrize(
    "launcher, advice",
    [
        ("env", "start every rank with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT"),
        ("slurm", "every task of the srun step must reach init_distributed"),
        ("mpi", "every task of the mpirun job must reach init_distributed"),
    ],
)
def test_a_rank_that_gives_up_advises_for_its_launcher(launcher, advice):
    # Under srun or mpirun the launcher set WORLD_SIZE and the rest: advice to set them by
    # hand would send the reader the wrong way.
    from datetime import timedelta

    from torch import distributed as dist

    from fastddp import joining
    from fastddp.cluster import ClusterError

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(ClusterError) as info:
        joining.agree(store, 0, 2, "gloo", None, launcher=launcher)
    said = str(info.value)
    assert "1 of 2 rank(s) never came (1)" in said and advice in said, said
    if launcher != "env":
        assert "WORLD_SIZE" not in said, said


def test_a_rank_that_gives_up_names_a_rank_given_twice():
    # The join's protocol over a real c10d store, two threads for two processes given RANK 0
    # of 2: the second raises at once; the first, after its timeout, names rank 1 that never
    # came and the RANK given twice.
    import threading
    from datetime import timedelta

    from torch import distributed as dist

    from fastddp import joining
    from fastddp.cluster import ClusterError

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    said = {}

    def join(who):
        try:
            joining.agree(store, 0, 2, "gloo", None)
        except ClusterError as e:
            said[who] = str(e)

    first = threading.Thread(target=join, args=("first",))
    first.start()
    deadline = time.monotonic() + slack.guard(30)
    while not store.check(["fastddp/join/came"]):  # the first has arrived
        assert time.monotonic() < deadline
        time.sleep(0.01)
    join("second")
    first.join(slack.guard(30))
    assert "as RANK 0 already: two processes were given the same RANK" in said["second"], said
    assert (
        "and 1 of 2 rank(s) never came (1), and RANK 0 was given to two processes (the second "
        "raised); start" in said["first"]
    ), said


def test_ranks_of_torchrun_nodes_restarted_apart_are_told_why():
    # Plain torchrun keeps one store across restarts, so fastddp keys each restart count
    # apart; it counts a restart only on the node whose workers failed. The test serves the
    # store as torchrun's agent would, with round 0's rank 0 in it; round 1's two one-rank
    # nodes come with counts 0 and 1: rank 0 meets its round-0 self, rank 1 waits alone.
    from torch import distributed as dist

    code = (
        "import os, sys\n"
        "from datetime import timedelta\n"
        "import fastddp\n"
        "rank = sys.argv[1]\n"
        "os.environ.update(RANK=rank, WORLD_SIZE='2', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',\n"
        "                  GROUP_RANK=rank, MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[2],\n"
        "                  TORCHELASTIC_RUN_ID='job', TORCHELASTIC_USE_AGENT_STORE='True',\n"
        "                  TORCHELASTIC_RESTART_COUNT=rank)\n"
        "try:\n"
        "    wait = timedelta(seconds=int(sys.argv[3]))\n"
        "    fastddp.init_distributed(backend='gloo', timeout=wait)\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__, e, flush=True)\n"
    )
    port, wait = free_port(), round(slack.guard(3))
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dist.PrefixStore("fastddp/attempt/job/0/", agent).add("fastddp/join/rank/0", 1)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), str(port), str(wait)],
                         env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=slack.guard(60)) for p in procs]
    finally:
        for p in procs:
            p.kill()
        del agent
    for rank, (out, err) in enumerate(outs):
        assert out.startswith("raised ClusterError "), out + err
        told = "as RANK 0 already" if rank == 0 else "1 of 2 rank(s) never came (0)"
        assert f"{told}" in out, out
        assert f"under torchrun, this node's workers have restarted {rank} time(s);" in out, out
        assert "python -m fastddp.launch gives every round a store of its own" in out, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_launcher_waiting_for_the_other_nodes_stops_on_a_signal(tmp_path, signum):
    # Node 0 of 2 waits in the rendezvous store's C++ wait for node 1, which never comes: no
    # Python handler runs there until the wait times out, minutes later (fastddp/launch/stop.py).
    err, tmp = tmp_path / "stderr", tmp_path / "tmp"
    tmp.mkdir()  # where torch makes the launch's log folder, pruned also on this stop
    cmd = [*LAUNCH, "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), WORKER]  # fmt: skip
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, env=_env(TMPDIR=tmp), stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + slack.guard(60)
        while "fastddp.launch: environment" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        time.sleep(2)  # into the rendezvous
        proc.send_signal(signum)
        rc = proc.wait(timeout=slack.guard(20))
    finally:
        proc.kill()
        proc.wait()
    told = err.read_text()
    # (Node 0 knows its own workers only: another node may run more or fewer.)
    assert "nodes 2, 1 worker(s) on this node, world size 2 if every node runs 1" in told, told
    assert rc == 128 + signum, told
    assert told.rstrip().endswith(f"fastddp.launch: stopped by {signum.name}"), told
    assert "Traceback" not in told, told
    assert not list(tmp.iterdir()), list(tmp.iterdir())


def test_the_launchers_stop_is_torchs_signal_exception():
    # On any other exception torch's launch_agent shuts the rendezvous down, which closes a
    # c10d rendezvous for every node of the job, not for the one stopped.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from fastddp.launch import stop

    with pytest.raises(SignalException) as raised:
        stop._raise(signal.SIGTERM, None)
    assert raised.value.sigval == signal.SIGTERM


def test_the_launcher_freezes_its_objects_before_it_exits():
    # So that the interpreter's last cycle collection skips them (fastddp/launch/__main__.py).
    code = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"
        "sys.argv[1:] = ['--dry-run', '--standalone', '--nproc-per-node', '2', 'train.py']\n"
        "runpy.run_module('fastddp.launch', run_name='__main__', alter_sys=True)\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr
    frozen = int(res.stdout.split("frozen ")[-1])
    assert frozen > 10_000, res.stdout  # torch's objects, not a handful


def test_slurm_dry_run_on_both_nodes():
    # One srun task a node (a launcher of the batch script itself is refused: test_detected.py).
    slurm = {
        "SLURM_JOB_ID": "918273",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    ports = set()
    for node in (0, 1):
        res = _launch("--dry-run", "train.py", **slurm, SLURM_NODEID=node)
        assert res.returncode == 0, res.stderr
        assert "nnodes=2 (from slurm: SLURM_JOB_NUM_NODES)" in res.stderr
        assert f"node_rank={node} (from slurm: SLURM_NODEID)" in res.stderr
        assert "master_addr=gpu07 (from slurm: first host of SLURM_JOB_NODELIST)" in res.stderr
        assert "config max_nodes=2" in res.stderr
        line = next(x for x in res.stderr.splitlines() if "config node_rank=" in x)
        assert f"node_rank={node} master_addr=gpu07" in line
        ports.add(line.rsplit("master_port=", 1)[1])
        assert "worker command:" in res.stderr and "train.py" in res.stderr
        assert "loopback" not in res.stderr  # a host name: a dry run resolves nothing
    assert len(ports) == 1


def test_dry_run_warns_of_a_loopback_master_for_several_nodes():
    res = _launch("--dry-run", "--nnodes", "2", "--master-addr", "[::1]", "x.py")
    assert res.returncode == 0, res.stderr
    assert "warning: the master [::1] is a loopback address" in res.stderr


def test_c10d_without_an_endpoint_is_checked_where_torch_goes():
    res = _launch("--dry-run", "--rdzv-backend", "c10d", "--nnodes", "2", "x.py")
    assert res.returncode == 0, res.stderr
    assert "rendezvous c10d at localhost:29400" in res.stderr  # torch's default endpoint
    assert "warning: the master localhost is a loopback address" in res.stderr
    # c10d numbers the nodes and meets at its endpoint: the static master is not printed.
    assert "config node_rank assigned by the c10d rendezvous" in res.stderr
    assert "master_port=" not in res.stderr, res.stderr


def test_command_line_beats_pet_beats_detection():
    env = {"NNODES": "4", "NODE_RANK": "3", "PET_NODE_RANK": "1", "MASTER_ADDR": "h0"}
    res = _launch("--dry-run", "--nnodes", "2", "x.py", **env)
    assert res.returncode == 0, res.stderr
    assert "nnodes: command line wins over 4 from NNODES" in res.stderr
    assert "node_rank: PET_NODE_RANK=1 wins over 3 from NODE_RANK" in res.stderr
    assert "config max_nodes=2" in res.stderr and "node_rank=1 master_addr=h0" in res.stderr


def test_standalone_inside_a_slurm_allocation_is_one_node():
    slurm = dict(SLURM_JOB_ID=88, SLURM_JOB_NUM_NODES=2, SLURM_NODEID=0, SLURM_JOB_NODELIST="a,b")
    res = _launch("--dry-run", "--standalone", "x.py", **slurm)
    assert res.returncode == 0, res.stderr
    assert "nnodes: --standalone (one node) wins over 2 from SLURM_JOB_NUM_NODES" in res.stderr
    assert "config max_nodes=1" in res.stderr and "rdzv_endpoint='localhost:0'" in res.stderr


def test_the_master_given_on_the_command_line_under_mpirun_and_kubernetes():
    mpi = dict(OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=1)
    res = _launch("--dry-run", "x.py", **mpi)
    assert res.returncode == 2 and "mpirun does not say which host is the master" in res.stderr
    res = _launch("--dry-run", "--master-addr", "h0", "x.py", **mpi)
    assert res.returncode == 0 and "config node_rank=1" in res.stderr, res.stderr
    # c10d numbers the nodes itself, and its endpoint stands for the master: Kubernetes'
    # MASTER_PORT=tcp://IP:PORT is not read (it was refused as no port), nor mpirun's rank.
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:1"]
    res = _launch("--dry-run", *c10d, "x.py", **mpi, MASTER_PORT="tcp://10.96.0.5:29500")
    assert res.returncode == 0, res.stderr
    assert (
        "node_rank: not used by the c10d rendezvous at h0:1; 1 from OMPI_COMM_WORLD_RANK is "
        "not read"
        in res.stderr
        and "--node-rank 1 is ignored" not in res.stderr
    )
    assert (
        "master_port: not used by the c10d rendezvous at h0:1; tcp://10.96.0.5:29500 from "
        "MASTER_PORT is not read" in res.stderr
    )
    res = _launch("--dry-run", "x.py", **mpi, PET_MASTER_ADDR="h0")
    assert res.returncode == 0 and "node_rank=1 master_addr=h0" in res.stderr, res.stderr
    # Kubernetes' MASTER_PORT=tcp://IP:PORT, overridden on the command line.
    two = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29555"]
    res = _launch("--dry-run", *two, "x.py", MASTER_PORT="tcp://10.96.0.5:29500")
    assert res.returncode == 0 and "master_port=29555" in res.stderr, res.stderr


def test_bad_node_rank_is_refused():
    res = _launch("--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", WORKER)
    assert res.returncode == 2
    assert "--node-rank 2 is not valid with --nnodes 2: node ranks run from 0 to 1" in res.stderr


def test_a_missing_script_is_refused_before_any_worker_starts(tmp_path):
    missing = str(tmp_path / "trian.py")
    res = _launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "3", missing)
    assert res.returncode == 2, res.stderr
    assert f"error: the training script {missing} does not exist" in res.stderr
    assert "can't open file" not in res.stderr  # no worker started
    res = _launch("--dry-run", "--standalone", missing)
    assert res.returncode == 0 and "warning: the training script" in res.stderr, res.stderr


def test_srun_with_several_tasks_per_node_is_refused():
    slurm = dict(SLURM_JOB_ID=5, SLURM_STEP_ID=0, SLURM_NTASKS_PER_NODE=4, SLURM_JOB_NODELIST="n1")
    res = _launch("--dry-run", "x.py", **slurm)
    assert res.returncode == 2
    assert "srun started 4 tasks per node" in res.stderr


def test_port_in_use_on_the_master():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        master = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        res = _launch("--nnodes", "2", "--node-rank", "0", *master, WORKER)
    assert res.returncode == 2
    assert f"port {port} on this node (the master) is already in use" in res.stderr
    # Before any rendezvous wait: the launcher's start and the check, scaled like the guards.
    assert time.monotonic() - start < slack.guard(30)


def test_a_rendezvous_port_held_by_a_closed_connection():
    # c10d: the first launcher on the endpoint's host serves the store, and one that finds the
    # port taken joins the store there. A port that closed connections hold has no store to
    # join: it is refused as such, not waited on as a node 0 that has not started.
    from fastddp.testing.ports import port_in_time_wait

    port = port_in_time_wait()
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    res = _launch("--nnodes", "1:2", *rdzv, WORKER)
    assert res.returncode == 2, res.stderr
    assert f"port {port} on this node (the master) is already in use" in res.stderr
    assert "No process listens on it" in res.stderr and "TIME_WAIT" in res.stderr, res.stderr
    assert "cannot reach the master" not in res.stderr, res.stderr


def test_a_master_port_held_by_a_program_that_is_not_a_store():
    # A program that accepts connections and never answers: torchrun's agents would wait on
    # it for ever. Node 1 of a static launch and a c10d launcher that would join the store
    # on its own host both name it instead, within the store query's 5 s.
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        static = ["--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        res = _launch("--nnodes", "2", *static, WORKER)
        c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        joined = _launch("--nnodes", "1:2", *c10d, WORKER)
    for r in (res, joined):
        assert r.returncode == 2, r.stderr
        want = (
            f"127.0.0.1:{port} accepts connections but is not a torch.distributed store: it "
            "sent no answer to a store query within 5 s"
        )
        assert want in r.stderr, r.stderr
    assert "joining it" not in joined.stderr, joined.stderr


def test_standalone_two_ranks(tmp_path):
    cmd = [*LAUNCH, "--standalone", "--nproc-per-node", "2", WORKER, "--ddp"]
    res = _run_all([cmd], envs=[_env(TMPDIR=tmp_path)])
    text = _ok(res, 2)
    assert "launcher=torchrun ddp" in text
    # torch's log folder for the launch (no --log-dir) held nothing, and is gone.
    assert not list(tmp_path.glob("torchelastic_*")), list(tmp_path.rglob("*"))


def test_two_launchers_static_on_loopback():
    # Node 1 starts first and finds nothing listening on the master's port: its preflight
    # keeps waiting for node 0 past its own timeout (2 s here), says so, and the job runs once
    # node 0 starts, which it does only after that line.
    port = free_port()
    cmds = [
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(r),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--preflight-timeout",
            "2",
            WORKER,
        ]
        for r in (0, 1)
    ]
    merged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    node1 = subprocess.Popen(cmds[1], env=_env(), **merged)
    first, node0 = [], None
    try:
        deadline = time.monotonic() + slack.guard(60)
        for line in node1.stdout:  # ends if node 1 exits
            first.append(line)
            if "waiting for the master 127.0.0.1" in line or time.monotonic() > deadline:
                break
        assert "nothing listens there yet (connection refused" in "".join(first), first
        node0 = subprocess.Popen(cmds[0], env=_env(), **merged)
        outs = [p.communicate(timeout=slack.guard(150))[0] for p in (node0, node1)]
    finally:
        for p in (node1, node0):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert (node0.returncode, node1.returncode) == (0, 0), outs
    text = "".join(first) + "".join(outs)
    assert text.count("worker ok") == 2, text
    assert "the master 127.0.0.1 is a loopback address" in text
    assert f"this node hosts the rendezvous at 127.0.0.1:{port}; the workers start" in text
    assert "node_rank=1 nodes=2" in text and "node_rank=0 nodes=2" in text
    # Node 0 tells node 1 that its launch ended well before its store goes: no store call of
    # either meets a closed connection (torch prints each such failure).
    assert "failed on SocketImpl" not in text, text


_FRESH = "restarts: a fresh workers' store for every rendezvous round"


@pytest.mark.parametrize(
    "backend, nnodes, restarts, user, fresh",
    [
        ("c10d", "1:2", "0", None, True),
        ("c10d", "2", "1", None, True),
        ("c10d", "2", "0", None, True),  # all nodes alike, whatever their --max-restarts
        ("c10d", "2", "1", "0", False),  # the user's setting wins...
        ("c10d", "2", "1", "1", False),
        ("static", "2", "1", "0", True),  # ...where torch reads it: static does not
    ],
)
def test_a_job_with_a_second_round_gets_a_store_per_round(backend, nnodes, restarts, user, fresh):
    extra = {} if user is None else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": user}
    args = ["--dry-run", "--nnodes", nnodes, "--max-restarts", restarts]
    if backend == "c10d":
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "198.18.0.1:29400", "x.py"]
    else:
        args += ["--node-rank", "0", "--master-addr", "198.18.0.1", "x.py"]
    res = _launch(*args, **extra)
    assert res.returncode == 0, res.stderr
    assert (_FRESH in res.stderr) == fresh, res.stderr
    want = f"'fastddp-{backend}'" if fresh else f"'{backend}'"
    assert f"config rdzv_backend={want}" in res.stderr, res.stderr
    warned = "warning: a restarted attempt can read the previous attempt's" in res.stderr
    assert warned == (user == "0" and backend == "c10d"), res.stderr


def test_two_launchers_c10d_on_loopback():
    port = free_port()
    cmd = [
        *LAUNCH,
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_id",
        "t1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        WORKER,
    ]
    _ok(_run_all([cmd, cmd]), 2)


def _plain_env_ranks(world, **common):
    port = free_port()
    envs = [
        _env(
            RANK=r,
            WORLD_SIZE=world,
            LOCAL_RANK=r,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **common,
        )
        for r in range(world)
    ]
    return [[sys.executable, WORKER]] * world, envs


def test_init_distributed_from_hand_set_variables():
    cmds, envs = _plain_env_ranks(2)
    # Each rank a node of its own by FASTDDP_NODE_ID, as containers that share a host name
    # are told apart (docs/topology.md): a per-node variable, not a setting ranks must share.
    for rank, env in enumerate(envs):
        env["FASTDDP_NODE_ID"] = f"box{rank}"
    text = _ok(_run_all(cmds, envs=envs), 2)
    assert "launcher=env" in text
    assert "node_rank=0 nodes=2" in text and "node_rank=1 nodes=2" in text, text


def test_init_distributed_under_srun_and_mpirun_variables():
    port = free_port()
    srun = [
        _env(
            SLURM_JOB_ID="1",
            SLURM_STEP_ID="0",
            SLURM_PROCID=r,
            SLURM_NTASKS=2,
            SLURM_LOCALID=r,
            SLURM_NODEID=0,
            SLURM_JOB_NODELIST="localhost",
            SLURM_STEP_TASKS_PER_NODE="2",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    text = _ok(_run_all([[sys.executable, WORKER]] * 2, envs=srun), 2)
    assert "launcher=slurm" in text
    port = free_port()
    mpi = [
        _env(
            OMPI_COMM_WORLD_RANK=r,
            OMPI_COMM_WORLD_SIZE=2,
            OMPI_COMM_WORLD_LOCAL_RANK=r,
            OMPI_COMM_WORLD_LOCAL_SIZE=2,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    text = _ok(_run_all([[sys.executable, WORKER]] * 2, envs=mpi), 2)
    assert "launcher=mpi" in text


_SESSIONS = """
import torch, torch.distributed as dist, fastddp
for session in range(3):
    with fastddp.distributed_session() as env:
        t = torch.full((1,), float(env.rank + 1))
        dist.all_reduce(t)
        print(f"session {session} rank {env.rank}: {t.item():g}", flush=True)
print("worker ok", flush=True)
fastddp.distributed.exit_after_shutdown(0)
"""


def test_sessions_one_after_another(tmp_path):
    # Each session's join and group take store keys of their own: torch names the new group
    # as it named the old one, whose keys (a dead rank's address) are still in the store.
    script = tmp_path / "sessions.py"
    script.write_text(_SESSIONS)
    under_launcher = [*LAUNCH, "--standalone", "--nproc-per-node", "2", str(script)]
    by_hand, hand_envs = _plain_env_ranks(2)
    by_hand = [c[:1] + [str(script)] for c in by_hand]
    for cmds, envs in (([under_launcher], None), (by_hand, hand_envs)):
        text = _ok(_run_all(cmds, envs=envs), 2)
        for session in range(3):
            for rank in range(2):
                assert f"session {session} rank {rank}: 3" in text, text


def test_mismatched_settings_fail_on_every_rank():
    cmds, envs = _plain_env_ranks(2)
    envs[1]["FASTDDP_DISABLE_SIMD"] = "1"
    results = _run_all(cmds, envs=envs)
    for rc, out in results:
        assert rc != 0
        assert "rank 1 runs with different fastddp settings than rank 0" in out, out


def test_one_node_id_over_two_launcher_nodes_fails_every_rank():
    # FASTDDP_NODE_ID copied to every node: the hooks would take the two nodes for one.
    cmds, envs = _plain_env_ranks(2, FASTDDP_NODE_ID="rack7")
    for rank, env in enumerate(envs):
        env.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    for rc, out in _run_all(cmds, envs=envs):
        assert rc != 0
        assert "FASTDDP_NODE_ID='rack7' names ranks on the launcher's nodes [0, 1]" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a rank that sees no GPU")
def test_a_rank_that_cannot_start_fails_every_rank():
    # Rank 1 asks for NCCL where torch sees no GPU, as on a node whose driver shows none. It
    # cannot start; rank 0 must raise the same error, not wait in init_process_group for it
    # (the group's timeout is 10 minutes, past this test's hang guard).
    code = (
        "import sys, fastddp\n"
        "try:\n"
        "    fastddp.init_distributed(backend=sys.argv[1])\n"
        "except fastddp.ClusterError as e:\n"
        "    print('refused:', e)\n"
        "    raise SystemExit(3)\n"
        "print('started')\n"
    )
    cmds = [[sys.executable, "-c", code, backend] for backend in ("gloo", "nccl")]
    _, envs = _plain_env_ranks(2)
    for rc, out in _run_all(cmds, timeout=120, envs=envs):
        assert rc == 3, out
        assert "1 of 2 rank(s) cannot start (1); rank 1: backend='nccl' needs a GPU" in out, out
        assert "chose different backends (1 rank(s) gloo, 1 rank(s) nccl)" in out, out


# A rank that prints whether init_distributed started it, or why not (and exits 3).
_STARTED_OR_REFUSED = (
    "import fastddp\n"
    "try:\n"
    "    fastddp.init_distributed(backend='gloo')\n"
    "except fastddp.ClusterError as e:\n"
    "    print('refused:', e)\n"
    "    raise SystemExit(3)\n"
    "print('started')\n"
)


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("FASTDDP_PEER_TIMEOUT", "5m", "1 of 2 rank(s) cannot start (1); rank 1: "
         "FASTDDP_PEER_TIMEOUT='5m' is not"),
        # Refused before this rank knew its settings: it still finds the store to say so.
        ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer"),
        ("WORLD_SIZE", "3", "the ranks were started with different WORLD_SIZE (1 rank(s) "
         "WORLD_SIZE=2, 1 rank(s) WORLD_SIZE=3)"),
    ],
)  # fmt: skip
def test_a_bad_variable_on_one_rank_fails_every_rank(name, value, said):
    # Set wrong on one node only: rank 0 must not wait for rank 1 until its timeout.
    cmds, envs = _plain_env_ranks(2)
    cmds = [[sys.executable, "-c", _STARTED_OR_REFUSED]] * 2
    envs[1][name] = value
    for rc, out in _run_all(cmds, timeout=120, envs=envs):
        assert rc == 3, out
        assert said in out, out


def test_one_rank_given_twice_is_refused_by_the_second():
    # A second process with RANK 1 (or a rank of another job on this port) joins a running
    # job's store: it says so, and the job goes on. (Started together, the second could come
    # after the job had ended and its store was gone, and wait for it.)
    code = _STARTED_OR_REFUSED + "input()\nfastddp.shutdown_distributed()\n"
    _, envs = _plain_env_ranks(2)
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    job = [subprocess.Popen([sys.executable, "-c", code], env=e, text=True, **pipes) for e in envs]
    try:
        for p in job:  # (torch's warnings may come first)
            while (line := p.stdout.readline()) and line.strip() != "started":
                pass
            assert line, "a rank of the job ended before it started"
        late = slack.run([sys.executable, "-c", code], env=envs[1], capture_output=True,
                         text=True, timeout=slack.guard(60))  # fmt: skip
        # A second RANK 0 finds the store's port taken (torch said EADDRINUSE alone).
        late0 = slack.run([sys.executable, "-c", code], env=envs[0], capture_output=True,
                          text=True, timeout=slack.guard(60))  # fmt: skip
    finally:
        for p in job:
            with contextlib.suppress(OSError):
                p.stdin.write("\n")
                p.stdin.flush()
    results = _finish(job, 60)
    assert [rc for rc, _ in results] == [0, 0], results
    assert late.returncode == 3, late.stdout + late.stderr
    assert "another process joined the store at MASTER_ADDR:MASTER_PORT as RANK 1" in late.stdout
    assert late0.returncode == 3, late0.stdout + late0.stderr
    taken = "that port is taken on this host: another job uses it, or another process was given"
    assert f"{taken} RANK=0 as well" in late0.stdout, late0.stdout + late0.stderr


def test_init_distributed_single_process_is_idempotent():
    code = (
        "import fastddp, torch.distributed as dist\n"
        "env = fastddp.init_distributed()\n"
        "assert fastddp.init_distributed() is env and env.world_size == 1\n"
        "assert env.launcher == 'single' and fastddp.is_main_process()\n"
        "from torch.distributed.distributed_c10d import _get_default_store\n"
        "assert isinstance(_get_default_store().underlying_store, dist.HashStore)  # no port\n"
        "try:\n"
        "    fastddp.init_distributed(backend='nccl')\n"
        "except fastddp.ClusterError as e:\n"
        "    assert 'already initialised with backend' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "fastddp.shutdown_distributed()\n"
        "assert not dist.is_initialized()\n"
        "with fastddp.distributed_session() as env2:\n"
        "    assert dist.is_initialized() and env2.backend == 'gloo'\n"
        "    with fastddp.distributed_session() as env3:  # a library's, inside\n"
        "        assert env3 is env2\n"
        "    assert dist.is_initialized()  # the inner session leaves the group to the outer\n"
        "assert not dist.is_initialized()\n"
        "print('ok')\n"
    )
    res = _python(code)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_init_distributed_refuses_bad_ranks_and_foreign_groups():
    import fastddp

    bad = {
        "RANK": "2",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    with pytest.raises(fastddp.ClusterError, match="rank 2 is outside world size 2"):
        fastddp.init_distributed(environ=bad)
    code = (
        "import torch.distributed as dist, fastddp\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "try:\n"
        "    fastddp.init_distributed()\n"
        "except fastddp.ClusterError as e:\n"
        "    print(e)\n"
        "dist.destroy_process_group()\n"
    )
    res = _python(code)
    assert "torch.distributed was initialised elsewhere" in res.stdout, res.stderr


# ------------------------------------------------------------- two nodes: network namespaces


def _in(ns, cmd):
    return ["ip", "netns", "exec", ns, *cmd]


@contextlib.contextmanager
def _hosts(entries):
    """``/etc/hosts`` of each namespace (``{ns: text}``), as ``ip netns exec`` mounts it."""
    made = []
    try:
        for ns, text in entries.items():
            folder = f"/etc/netns/{ns}"
            os.makedirs(folder, exist_ok=True)
            made.append(folder)
            with open(f"{folder}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{text}\n")
        yield
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                os.remove(f"{folder}/hosts")
                os.rmdir(folder)


@pytest.mark.netns
def test_two_nodes_by_a_host_name_that_is_loopback_on_its_own_node():
    # The master given by its host name, as Slurm's node lists give it, which node 0's
    # /etc/hosts maps to 127.0.1.1 (Debian's default) and node 1's to node 0's address. Each
    # node's workers must use the interface between the nodes, node 0's too (on loopback its
    # workers were out of node 1's reach).
    with (
        two_nodes() as (a, b),
        _hosts({a["ns"]: "127.0.1.1 fdnode0", b["ns"]: f"{a['addr']} fdnode0"}),
    ):
        port = free_port()
        cmds = [
            _in(
                n["ns"],
                [
                    *LAUNCH,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--node-rank",
                    str(r),
                    "--master-addr",
                    "fdnode0",
                    "--master-port",
                    str(port),
                    WORKER,
                ],
            )
            for r, n in ((1, b), (0, a))
        ]
        text = _ok(_run_all(cmds, timeout=200), 4)
        assert (
            f"the master fdnode0 resolves to 127.0.1.1 on this node, as a host's own name often "
            f"does (/etc/hosts), and to this node's address on the others; its workers use "
            f"{a['dev']} ({a['addr']}), its only interface besides loopback"
        ) in text
        assert f"GLOO_SOCKET_IFNAME={a['dev']} (this node's interface to the others)" in text
        assert f"GLOO_SOCKET_IFNAME={b['dev']} (the interface that reaches the master)" in text
        assert "loopback address" not in text and "nodes=2" in text


@pytest.mark.netns
def test_a_host_name_that_is_loopback_with_several_interfaces_takes_the_default_route():
    # Node 0 with two interfaces besides loopback: its default route's carries the workers;
    # without a default route none stands out, and the launch stops naming them.
    code = (
        "import importlib\np = importlib.import_module('fastddp.launch.preflight')\n"
        "try:\n    print('chose', *p._own_interface('fdnode0', '127.0.1.1'))\n"
        "except p.LaunchError as e:\n    print('error', e)\n"
    )
    with lonely_node() as ns:
        for i, net in ((0, "198.18.7"), (1, "198.18.8")):
            netns._ip("-n", ns, "link", "add", f"fd{i}", "type", "veth", "peer", f"fd{i}p")
            netns._ip("-n", ns, "addr", "add", f"{net}.1/24", "dev", f"fd{i}")
            for dev in (f"fd{i}", f"fd{i}p"):
                netns._ip("-n", ns, "link", "set", dev, "up")
        cmd = _in(ns, [sys.executable, "-c", code])
        res = slack.run(cmd, env=_env(), capture_output=True, text=True, timeout=slack.guard(60))
        assert (
            "error --master-addr fdnode0 resolves to 127.0.1.1 on this node, a loopback "
            "address, and no interface stands out for the other nodes to reach it (interfaces "
            "besides loopback: fd0 198.18.7.1, fd1 198.18.8.1)" in res.stdout
        ), res.stdout + res.stderr
        netns._ip("-n", ns, "route", "add", "default", "via", "198.18.8.2", "dev", "fd1")
        res = slack.run(cmd, env=_env(), capture_output=True, text=True, timeout=slack.guard(60))
        assert "chose 198.18.8.1 fd1" in res.stdout, res.stdout + res.stderr
        assert "the interface of its default route" in res.stderr, res.stderr


@pytest.mark.netns
def test_two_nodes_c10d_rendezvous_as_in_sana():
    # Sana's line with fastddp.launch in place of torchrun.
    with two_nodes() as (a, b):
        port = free_port()
        line = [
            *LAUNCH,
            "--nnodes",
            "2",
            "--nproc_per_node",
            "2",
            "--rdzv_id",
            "sana1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{a['addr']}:{port}",
            WORKER,
            "--ddp",
        ]
        text = _ok(_run_all([_in(b["ns"], line), _in(a["ns"], line)], timeout=200), 4)
        assert (
            f"--local-addr {b['addr']}" in text and len(re.findall(r"launcher=\S+ ddp", text)) == 4
        ), text


@pytest.mark.netns
def test_unreachable_master_fails_fast():
    with two_nodes() as (a, b):
        nobody = a["addr"].rsplit(".", 1)[0] + ".77"  # on the link, but no host answers
        start = time.monotonic()
        res = _run_all(
            [
                _in(
                    b["ns"],
                    [
                        *LAUNCH,
                        "--nnodes",
                        "2",
                        "--node-rank",
                        "1",
                        "--master-addr",
                        nobody,
                        "--master-port",
                        "29400",
                        "--preflight-timeout",
                        "8",
                        WORKER,
                    ],
                )
            ],
            timeout=60,
        )
        elapsed = time.monotonic() - start
    rc, out = res[0]
    assert rc == 2, out
    assert f"cannot reach the master {nobody}:29400 within 8 s" in out
    assert f"local address {b['addr']}, interface {b['dev']}" in out
    # The 8 s deadline, not the 60 s job guard, ended it: 30 s is that plus the launcher's
    # start in a busy suite where `import torch` takes 1 CPU s, scaled like the hang guards
    # (36.6 s on a machine twice as slow).
    assert elapsed < slack.guard(30)


@pytest.mark.netns
@pytest.mark.parametrize(
    "master,message",
    [
        ("198.19.250.1", "no route from this node to the master 198.19.250.1"),
        ("no-such-host.invalid", "cannot resolve the master address 'no-such-host.invalid'"),
    ],
)
def test_master_without_route_or_name(master, message):
    # Inside a namespace with only loopback, so that nothing is sent anywhere.
    with lonely_node() as ns:
        cmd = [*LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-addr", master, WORKER]
        ((rc, out),) = _run_all([_in(ns, cmd)], timeout=60)
    assert rc == 2 and message in out, out
