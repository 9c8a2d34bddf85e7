"""What ``python -m fastddp.launch`` makes of a detected cluster, in dry runs in this process:
variables the command line covers are not read, a launch of one node meets on loopback as
torchrun's does, an error names the variable behind an option the user never gave, and no
detected setting reaches the workers' environment."""

import os
import re

import pytest

from fastddp.launch import cli, options

_CLUSTER = re.compile(r"^(SLURM_|OMPI_|PMI_|PET_|MASTER_|FASTDDP_CLUSTER$|NNODES$|NODE_RANK$)")


@pytest.fixture
def launch(monkeypatch, capsys):
    """Run ``cli.main`` on a dry run with only the given cluster variables; return
    ``(exit status, stderr)``. The environment is restored afterwards (the launcher sets
    interface variables in it)."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if _CLUSTER.match(n)]:
        monkeypatch.delenv(name)
    monkeypatch.delenv(options.PREFLIGHT_TIMEOUT_VAR, raising=False)

    def run(*args, **env):
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


def test_a_launcher_outside_srun_is_warned_of(launch):
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    status, err = launch(**{**batch, "SLURM_NODEID": 0}, SLURM_NODELIST="a,b,c,d")
    assert status == 0, err
    assert "warning: SLURM_STEP_ID is not set, so this launcher is not an srun task" in err, err
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
    # An elastic range that two nodes meet, Slurm's own count, and fewer nodes: no warning.
    for args in (["--nnodes", "1:4"], [], ["--nnodes", "1", "--node-rank", "0"]):
        status, err = launch(*args, **step)
        assert status == 0 and "needs" not in err, (args, err)


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
