"""What ``python -m fastddp.launch`` makes of a detected cluster, in dry runs in this process:
variables the command line covers are not read, a launch of one node meets on loopback as
torchrun's does, an error names the variable behind an option the user never gave, and no
detected setting reaches the workers' environment."""

import os
import re

import pytest

from fastddp.cluster import slurm_port
from fastddp.launch import cli, options

_CLUSTER = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PET_|MASTER_|FASTDDP_CLUSTER$|NNODES$|NODE_RANK$|NPROC_PER_NODE$|ADDR$|PORT$)"
)


@pytest.fixture
def launch(monkeypatch, capsys):
    """Run ``cli.main`` on a dry run with only the given cluster variables (each call's own);
    return ``(exit status, stderr)``. The environment is restored afterwards (the launcher sets
    interface variables in it)."""
    saved = dict(os.environ)
    monkeypatch.delenv(options.PREFLIGHT_TIMEOUT_VAR, raising=False)

    def run(*args, **env):
        for name in [n for n in os.environ if _CLUSTER.match(n)]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        status = cli.main(["--dry-run", *args, "train.py"])
        return status, capsys.readouterr().err

    yield run
    os.environ.clear()
    os.environ.update(saved)


SLURM = dict(SLURM_JOB_ID=1234, SLURM_STEP_ID=0, SLURM_NNODES=4, SLURM_NODEID=3)


def test_a_malformed_variable_the_command_line_covers_is_no_error(launch):
    status, err = launch(**SLURM, SLURM_NODELIST="node[01-03")
    assert status == 2, err
    assert "malformed Slurm node list 'node[01-03'" in err and "--cluster none" in err, err
    status, err = launch("--master-addr", "h0", **SLURM, SLURM_NODELIST="node[01-03")
    assert status == 0, err
    assert "master_addr: command line wins over node[01-03 from SLURM_NODELIST" in err, err
    status, err = launch("--nnodes", "1", SLURM_JOB_ID=1, SLURM_NNODES="abc")
    assert status == 0 and "nnodes: command line wins over abc from SLURM_NNODES" in err, err


def test_an_error_names_the_variable_behind_an_option_not_given(launch):
    status, err = launch("--nnodes", "2", **SLURM, SLURM_NODELIST="a,b")
    assert status == 2, err
    assert "--node-rank 3 is not valid with --nnodes 2" in err, err
    assert "(--node-rank 3 came from SLURM_NODEID: set it right" in err, err
    status, err = launch(FASTDDP_CLUSTER="bogus")
    assert status == 2 and "FASTDDP_CLUSTER='bogus' is not a cluster kind" in err, err


@pytest.mark.parametrize(
    "env",
    [
        dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=29622),
        dict(MASTER_PORT="tcp://10.96.0.5:29500"),  # Kubernetes' service variable
        dict(SLURM_JOB_ID=77, SLURM_STEP_ID=0, SLURM_NNODES=1, SLURM_NODELIST="n1"),
    ],
)
def test_one_node_meets_on_loopback_whatever_master_the_environment_names(launch, env):
    # torchrun's own choice for one node: a local rendezvous at a port the kernel picks, so a
    # port taken on this machine, or one that is no port, is no concern of the launch.
    status, err = launch("--nproc-per-node", "2", **env)
    assert status == 0, err
    assert "config rdzv_endpoint='localhost:0'" in err, err
    assert re.search(r"master_port: one node, which meets on loopback; .* is not read", err), err
    # Two nodes read it.
    status, err = launch("--nnodes", "2", "--node-rank", "1", MASTER_ADDR="h0", MASTER_PORT=29622)
    assert status == 0 and "config node_rank=1 master_addr=h0 master_port=29622" in err, err


def test_a_standalone_job_stays_on_loopback_without_the_preflight(launch, monkeypatch):
    # Its sockets on loopback are a setting, not a check: --no-preflight keeps them there, and
    # checks nothing, a bad FASTDDP_PEER_TIMEOUT included (the workers refuse that one).
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    for flags in ([], ["--no-preflight"]):
        status, err = launch("--standalone", *flags)
        assert status == 0, err
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            assert f"{var}=lo (one node: nothing listens beyond this machine)" in err, err
            del os.environ[var]
    status, err = launch("--standalone", FASTDDP_PEER_TIMEOUT="abc")
    assert status == 2 and "FASTDDP_PEER_TIMEOUT" in err, err
    status, err = launch("--standalone", "--no-preflight", GLOO_SOCKET_IFNAME="nosuch0")
    assert status == 0, err
    assert "GLOO_SOCKET_IFNAME=nosuch0 (yours; fastddp would use lo)" in err, err


def test_detected_settings_stay_out_of_the_workers_environment(launch):
    # They are the parser's defaults only: a PET_* exported here would reach the workers, and a
    # torchrun started in one would take this job's port.
    status, err = launch(**{**SLURM, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 0 and "master_port=" in err, err
    assert not [n for n in os.environ if n.startswith("PET_")], sorted(os.environ)


def test_a_launcher_outside_srun_is_refused_or_warned_of(launch):
    # A batch script's launcher runs on the first node only: a job of the allocation's nodes
    # would wait for launchers that never start (torchrun would run this node alone).
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    status, err = launch(**{**batch, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 2, err
    assert "SLURM_STEP_ID is not set, so this launcher is not an srun task" in err, err
    assert "srun --ntasks-per-node=1 python -m fastddp.launch" in err and "--nnodes 1" in err
    # Given on the command line, the count is the user's: a warning only.
    status, err = launch("--nnodes", "4", **{**batch, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 0, err
    assert "warning: SLURM_STEP_ID is not set, so this launcher is not an srun task" in err, err
    status, err = launch("--nnodes", "1", **{**batch, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 0 and "not an srun task" not in err, err
    status, err = launch(**{**SLURM, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 0 and "not an srun task" not in err, err


def test_more_nodes_than_the_slurm_step_has_are_warned_of(launch):
    # Each launcher would wait for nodes that never start, until the rendezvous' timeout.
    step = dict(SLURM, SLURM_STEP_NUM_NODES=2, SLURM_NODEID=0, SLURM_NODELIST="a,b")
    status, err = launch("--nnodes", "4", **step)
    assert status == 0, err
    assert (
        "warning: --nnodes 4 needs 4 nodes, but Slurm starts launchers on 2"
        " (SLURM_STEP_NUM_NODES=2)" in err
    ), err
    assert "Give --nnodes 2 (or leave it out" in err and "srun -N 4" in err, err
    # An elastic range that two nodes meet, and Slurm's own count: no warning.
    for args in (["--nnodes", "1:4"], []):
        status, err = launch(*args, **step)
        assert status == 0 and "needs" not in err, (args, err)


def test_fewer_nodes_than_the_slurm_step_started_launchers_on_are_refused(launch):
    # srun -N2 ... --nnodes 1: each node would run a job of its own, without a word.
    step = dict(SLURM, SLURM_STEP_NUM_NODES=2, SLURM_NODEID=1, SLURM_NODELIST="a,b")
    for nnodes, fate in (("1", "each would run a job of its own"), ("1:1", "each"),
                         ("2:3", "those past 3 would wait")):  # fmt: skip
        status, err = launch("--nnodes", nnodes, **{**step, "SLURM_STEP_NUM_NODES": 4})
        assert status == 2, err
        assert "srun started launchers on 4 nodes (SLURM_STEP_NUM_NODES=4): " + fate in err, err
        assert "Give --nnodes 4" in err and "--cluster none" in err, err
        assert "worker command" not in err, err
    # --standalone is one node whatever Slurm says, and said; a batch script's launcher runs on
    # one node, and the job's count (srun -N1 in a larger job) is no step's.
    status, err = launch("--standalone", **step)
    assert status == 0, err
    assert "--standalone: srun started launchers on 2 nodes" in err, err
    for env in ({k: v for k, v in step.items() if k != "SLURM_STEP_ID"},
                {k: v for k, v in step.items() if k != "SLURM_STEP_NUM_NODES"}):  # fmt: skip
        status, err = launch("--nnodes", "1", **env)
        assert status == 0, err
        # A detected rank is no --node-rank of the user's: one node is node 0.
        assert "node_rank: one node, node 0; 1 from SLURM_NODEID is not read" in err, err
        assert "--node-rank 1 is ignored" not in err, err


def test_fewer_nodes_than_mpirun_started_launchers_are_refused(launch):
    # mpirun -np 4 --npernode 1 ... --nnodes 2: two nodes would wait for a rendezvous that
    # never takes them, until its timeout.
    mpi = dict(OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_RANK=3, MASTER_ADDR="127.0.0.1")
    for nnodes, fate in (("1", "each would run a job of its own"),
                         ("2", "those past 2 would wait")):  # fmt: skip
        status, err = launch("--nnodes", nnodes, **mpi)
        assert status == 2, err
        assert "mpirun started 4 launchers (OMPI_COMM_WORLD_SIZE=4): " + fate in err, err
        assert "Give --nnodes 4" in err and "mpirun -np " + nnodes in err, err
        assert "--cluster none to read no MPI variables" in err, err
        assert "worker command" not in err, err
    status, err = launch("--nnodes", "1", **{**mpi, "OMPI_COMM_WORLD_SIZE": 1, "PMI_SIZE": 4})
    assert status == 0, err  # Open MPI's own count first
    status, err = launch("--standalone", **mpi)
    assert status == 0 and "--standalone: mpirun started 4 launchers" in err, err
    for args in (["--nnodes", "4"], ["--nnodes", "2:4"], []):
        status, err = launch(*args, **mpi)
        assert status == 0, (args, err)


def test_several_launchers_a_node_are_the_users_where_the_command_line_says_all(launch):
    # An interactive srun -N1 -n8 --pty bash, one launcher in it: --standalone, or every
    # setting on the command line, and nothing is read from Slurm or mpirun.
    pty = dict(SLURM_JOB_ID=1234, SLURM_STEP_ID=0, SLURM_STEP_NUM_TASKS=8, SLURM_NODEID=0,
               SLURM_STEP_NUM_NODES=1, SLURM_STEP_NODELIST="gpu01",
               SLURM_STEP_TASKS_PER_NODE=8)  # fmt: skip
    status, err = launch(**pty)
    assert status == 2 and "srun started 8 tasks per node" in err, err
    assert "pass --standalone, or --cluster none to read no Slurm variables" in err, err
    status, err = launch("--standalone", **pty)
    assert status == 0 and "config max_nodes=1" in err, err
    # Two launchers a node on purpose, each a node of its own to torch: 4 launchers, no
    # warning of nodes that never start.
    two = dict(pty, SLURM_STEP_NUM_TASKS=4, SLURM_NODEID=1, SLURM_STEP_NUM_NODES=2,
               SLURM_STEP_NODELIST="gpu[01-02]", SLURM_STEP_TASKS_PER_NODE="2(x2)")  # fmt: skip
    mpi = dict(OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_LOCAL_SIZE=2)
    given = ["--nnodes", "4", "--node-rank", "3", "--master-addr", "127.0.0.1"]
    for env in (two, mpi):
        status, err = launch(*given, "--master-port", "29500", **env)
        assert status == 0 and "config node_rank=3" in err and "needs" not in err, err
        status, err = launch(*given, **env)  # the port left to the environment: refused
        assert status == 2 and "per node" in err and "--cluster none" in err, err


def test_c10d_without_an_endpoint_meets_at_the_master_the_cluster_names(launch):
    # torch's c10d rendezvous without an endpoint meets at each node's own localhost:29400, so
    # the nodes of a Slurm step (or of mpirun) never met; the master is its endpoint.
    step = dict(SLURM, SLURM_STEP_NUM_NODES=2, SLURM_NODEID=1, SLURM_STEP_NODELIST="n[1-2]")
    status, err = launch("--rdzv-backend", "c10d", **step)
    assert status == 0, err
    ep = f"n1:{slurm_port('1234')}"
    assert (
        f"rdzv_endpoint={ep} (from slurm: the master, first host of SLURM_STEP_NODELIST; "
        "SLURM_JOB_ID and SLURM_STEP_ID)" in err
    ), err
    assert f"config rdzv_endpoint='{ep}'" in err and "loopback" not in err, err
    assert f"node_rank: not used by the c10d rendezvous at {ep}; 1 from SLURM_NODEID" in err, err
    # The command line's master port, and mpirun's MASTER_ADDR (c10d's port 29400).
    status, err = launch("--rdzv-backend", "c10d", "--master-port", "29511", **step)
    assert status == 0 and "config rdzv_endpoint='n1:29511'" in err, err
    mpi = dict(OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1, MASTER_ADDR="127.0.0.1")
    status, err = launch("--rdzv-backend", "c10d", **mpi)
    assert status == 0 and "rendezvous c10d at 127.0.0.1:29400" in err, err
    # A given endpoint, and one node, are left alone.
    status, err = launch("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29512", **step)
    assert status == 0 and "config rdzv_endpoint='127.0.0.1:29512'" in err, err
    status, err = launch("--rdzv-backend", "c10d", **dict(step, SLURM_STEP_NUM_NODES=1))
    assert status == 0 and "rdzv_endpoint=" not in err.replace("config rdzv_endpoint=", ""), err


def test_the_scripts_own_options_are_not_read_as_abbreviations(launch):
    # torchrun's parser takes a script's --nproc (or --log) for an ambiguous abbreviation of
    # its own options, and fails; a --help among them is the script's too.
    script = ["-m", "fastddp.bench", "allreduce", "--nproc", "7", "--log", "--help"]
    status, err = launch("--standalone", "--nproc-per-node", "1", *script)
    assert status == 0, err
    assert (
        "worker command: " in err
        and " -m fastddp.bench allreduce --nproc 7 --log --help train.py" in err
    )
    # An abbreviated option of the launcher's own still works (as torchrun's parser reads it).
    status, err = launch("--stand", "--nproc-per-node", "1")
    assert status == 0 and "config rdzv_endpoint='localhost:0'" in err, err


def test_a_local_rendezvous_takes_a_run_id_of_its_own(launch):
    # As torchrun's: --rdzv-id names no other node of a one-node launch.
    for args in (["--standalone"], []):
        status, err = launch(*args, "--rdzv-id", "mine", "--cluster", "none")
        assert status == 0, err
        run_id = re.search(r"config run_id='([^']*)'", err).group(1)
        assert run_id != "mine" and len(run_id) == 36, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-restarts", "-1"], "--max-restarts -1: give 0 or more restarts"),
        (["--rdzv-backend", "bogus"], "--rdzv-backend bogus: not a rendezvous backend torch knows"),
    ],
)
def test_options_torchrun_takes_with_a_traceback(launch, args, message):
    status, err = launch(*args, "--cluster", "none")
    assert status == 2 and message in err, err
