"""fastddp.init_distributed under srun and mpirun when a rank never comes, and its environ=."""

import json
import os
import subprocess
import sys

import pytest

from fastddp.testing import slack
from fastddp.testing.ports import free_port

from .test_launch import _env

pytestmark = [pytest.mark.multiproc]

# Rank 0 of 2 whose rank 1 never comes: it must say so while it waits (after 0.5 s here, not
# the 20 s of a real job), then fail by its timeout. Each case gets the variables of one
# launcher alone, and a port of its own.
_WAIT = (
    "import json, os, sys\n"
    "from datetime import timedelta\n"
    "import fastddp, fastddp.joining as j\n"
    "j.WAIT_SAY_S = 0.5\n"
    "for case in json.loads(sys.argv[1]):\n"
    "    print('case', case['name'], file=sys.stderr, flush=True)\n"
    "    try:\n"
    "        fastddp.init_distributed(backend='gloo', timeout=timedelta(seconds=2),\n"
    "                                 environ=case['env'])\n"
    "    except Exception as e:\n"
    "        print('raised', case['name'], type(e).__name__, e, flush=True)\n"
)

_SRUN = {  # `python train.py` in the shell of `srun -n2 --pty bash`: task 0 of 2
    "SLURM_JOB_ID": "4711",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "MASTER_ADDR": "127.0.0.1",
}
_MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
}


def test_srun_and_mpirun_ranks_say_they_wait_for_a_rank_that_never_comes():
    base = _env()
    cases = [
        {"name": "srun", "env": {**base, **_SRUN, "MASTER_PORT": str(free_port())}},
        {"name": "mpirun", "env": {**base, **_MPIRUN, "MASTER_PORT": str(free_port())}},
    ]
    cmd = [sys.executable, "-c", _WAIT, json.dumps(cases)]
    res = slack.run(cmd, env=base, capture_output=True, text=True, timeout=slack.guard(60))
    out, err = res.stdout, res.stderr
    assert res.returncode == 0 and out.count("raised") == 2, out + err
    said = "raised {} ClusterError fastddp.init_distributed: rank 0 waited"
    never = "1 of 2 rank(s) never came (1)"
    srun_err, mpirun_err = err.split("case mpirun")
    for name, case, text in zip(("srun", "mpirun"), cases, (srun_err, mpirun_err)):
        port = case["env"]["MASTER_PORT"]
        assert said.format(name) in out and never in out, out
        head = f"rank 0 has waited 0.5 s for the other 1 rank(s) at 127.0.0.1:{port} ("
        assert head in text, err
    assert "srun step 4711.0: SLURM_PROCID=0" in srun_err, err
    assert "interactive `srun --pty` shell" in srun_err and "--cluster none" in srun_err, err
    assert "(mpirun: OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2)" in mpirun_err, err
    assert "srun" not in mpirun_err, err


# Two ranks started by hand, their variables given to init_distributed alone (not in
# os.environ): each its own FASTDDP_ switch, which every rank must share.
_SETTINGS = (
    "import os, sys\n"
    "from datetime import timedelta\n"
    "import fastddp\n"
    "rank, port = sys.argv[1], sys.argv[2]\n"
    "env = dict(os.environ, RANK=rank, WORLD_SIZE='2', LOCAL_RANK=rank,\n"
    "           MASTER_ADDR='127.0.0.1', MASTER_PORT=port, FASTDDP_TEST_SWITCH=rank)\n"
    "try:\n"
    "    fastddp.init_distributed(backend='gloo', timeout=timedelta(seconds=20), environ=env,\n"
    "                             peer_timeout=0)\n"
    "    print('joined', flush=True)\n"
    "except Exception as e:\n"
    "    print('raised', type(e).__name__, e, flush=True)\n"
    "os._exit(0)\n"
)


def test_ranks_compare_the_fastddp_settings_of_the_environ_they_are_given():
    port, base = str(free_port()), _env()
    assert not any(k.startswith("FASTDDP_TEST_SWITCH") for k in base)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SETTINGS, rank, port],
            env=base,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in ("0", "1")
    ]
    try:
        outs = [p.communicate(timeout=slack.guard(60))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        assert "raised ClusterError" in out and "different fastddp settings" in out, outs
        assert "'FASTDDP_TEST_SWITCH': '1'" in out, outs


def test_the_watchdog_reads_torchruns_agent_store_from_the_environ_given(monkeypatch):
    from fastddp import distributed

    made = []

    class Watchdog:
        def __init__(self, *args, store_in_rank0, **kwargs):
            made.append(store_in_rank0)

        def start(self):
            return self

        def stop(self, failure=None):
            pass

    monkeypatch.setattr(distributed, "PeerWatchdog", Watchdog)
    monkeypatch.setattr(distributed, "_watchdog", None)
    monkeypatch.setattr(distributed, "_excepthook", None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(distributed.atexit, "register", lambda *_: None)
    # torchrun's agent serves the store where the environ given says so, not os.environ.
    for env in ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, {}):
        distributed._start_watchdog("run/0", 60.0, 0, 2, "127.0.0.1", 1, "torchrun", env)
    assert made == [False, True]
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") is None
